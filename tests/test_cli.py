"""The command line: demo, offline ranking over JSONL and Parquet, config resolution."""

from __future__ import annotations

import json
import re
import sys

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from attention_backends import BackendRegistry
from attention_backends.torch_ref import TorchRefBackend
from gr_engine import EngineConfig, GenerateParams, GenerateRequest, GREngine, RankRequest
from gr_engine.cli import main
from gr_engine.config import load_config
from gr_engine.demo import run_demo
from gr_engine.io import read_requests
from gr_engine.synthetic import synthetic_requests
from tests.conftest import tiny_config


def write_config(tmp_path):
    path = tmp_path / "engine.json"
    path.write_text(msgspec.json.encode(tiny_config()).decode())
    return path


def requests_for(config, n_users=5, visits=3):
    return synthetic_requests(config.model, n_users, visits, first_history=(0, 40), new_events=(0, 8),
                              num_candidates=(1, 6), seed=4)


def test_rank_jsonl_to_parquet_with_bad_rows(tmp_path, capsys):
    config_path = write_config(tmp_path)
    requests = requests_for(tiny_config())
    lines = [msgspec.json.encode(r).decode() for r in requests]
    lines.insert(2, "{not json")
    lines.insert(5, json.dumps({"request_id": "typed-wrong", "user_id": 1, "item_ids": ["x"], "action_ids": [],
                                "timestamps": [], "candidate_item_ids": [1]}))
    lines.insert(7, json.dumps({**json.loads(lines[0]), "request_id": "oov", "candidate_item_ids": [10**6]}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n\n")
    out = tmp_path / "out.parquet"
    assert main(["rank", "--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--config", str(config_path),
                 "--no-progress"]) == 0
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == len(lines)
    assert "not valid JSON" in rows[2]["error"] and rows[2]["request_id"] == "line-3"
    assert rows[5]["request_id"] == "typed-wrong" and "invalid request" in rows[5]["error"]
    assert rows[5]["user_id"] == 1 and rows[2]["user_id"] is None
    assert rows[7]["request_id"] == "oov" and "outside the item vocabulary" in rows[7]["error"]
    good = [r for r in rows if r["error"] is None]
    assert [r["request_id"] for r in good] == [r.request_id for r in requests]
    expected = GREngine(tiny_config()).rank(requests, use_tqdm=False)
    for row, exp in zip(good, expected):
        np.testing.assert_allclose(row["scores"], exp.scores, atol=1e-6)
        assert row["num_gpu_cached_tokens"] == exp.num_gpu_cached_tokens
    assert "3 failed" in capsys.readouterr().err


def test_error_rows_are_labelled_by_their_place_in_the_file(tmp_path):
    good = msgspec.json.encode(requests_for(tiny_config(), n_users=1, visits=1)[0]).decode()
    (tmp_path / "in.jsonl").write_text(f"\n{good}\n\n  \n{{not json\n\n[1, 2]\n")
    parsed = read_requests(tmp_path / "in.jsonl")
    assert [p.request_id for p in parsed[1:]] == ["line-5", "line-7"]  # blank lines 1, 3, 4 and 6 count
    assert "line 5 is not valid JSON" in parsed[1].error
    pq.write_table(pa.Table.from_pylist([{"request_id": None, "user_id": 1}, json.loads(good)]),
                   tmp_path / "in.parquet")
    assert read_requests(tmp_path / "in.parquet")[0].request_id == "row-1"


def test_rows_rejected_while_parsing_keep_their_user_id(tmp_path):
    rows = [{"request_id": "a", "user_id": "u-1", "item_ids": "x"}, {"request_id": "b", "user_id": 7},
            {"request_id": "c", "user_id": True}, {"user_id": [1]}, {"request_id": "e", "user_id": 2.5}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    parsed = read_requests(tmp_path / "in.jsonl")
    assert [(p.request_id, p.user_id) for p in parsed] == [
        ("a", "u-1"), ("b", 7), ("c", None), ("line-4", None), ("e", None)]
    assert all("invalid request" in p.error for p in parsed)


def test_a_file_job_serves_every_row_whatever_its_bytes_or_its_repeats(tmp_path):
    """A line nested thousands deep is that line's error (msgspec raised RecursionError and the job died after the
    rows written so far); a UTF-8 byte-order mark does not spoil line 1; a ``request_id`` repeated within a chunk
    is served as one repeated in another chunk is (the engine refuses an id in flight: the second failed)."""
    requests = requests_for(tiny_config(), n_users=4, visits=2)
    lines = [msgspec.json.encode(r).decode() for r in requests]
    repeat = json.loads(lines[1])
    lines.insert(3, json.dumps({**repeat, "user_id": 99}))  # the id of line 2, another user, same chunk
    lines.insert(4, '{"request_id": "deep", "item_ids": ' + "[" * 3000 + "]" * 3000 + "}")
    (tmp_path / "in.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    out = tmp_path / "out.jsonl"
    assert main(["rank", "--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--config",
                 str(write_config(tmp_path)), "--no-progress"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(lines) and rows[4]["error"] == "line 5 is not valid JSON: values nested too deeply"
    assert [r["error"] for i, r in enumerate(rows) if i != 4] == [None] * (len(lines) - 1)
    assert rows[1]["request_id"] == rows[3]["request_id"] == repeat["request_id"] and rows[3]["user_id"] == 99
    alone = GREngine(tiny_config()).rank([msgspec.convert(json.loads(lines[3]), RankRequest)], use_tqdm=False)
    np.testing.assert_allclose(rows[3]["scores"], alone[0].scores, atol=1e-6)


def test_bad_files_flags_and_sizes_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text("{}\n")
    job = ["rank", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    (tmp_path / "list.json").write_text("[1, 2]")
    assert main(["config", "--config", str(tmp_path / "list.json"), "--set", "cache.mode=recompute"]) == 2
    one_line_error(capsys, "holds a JSON list, not an object of sections")
    assert main([*job, "--set", "cache.num_gpu_pages=100000000000000000000000"]) == 2
    one_line_error(capsys, "cannot build the engine")
    (tmp_path / "w.safetensors").write_text("not safetensors")
    assert main([*job, "--weights", str(tmp_path / "w.safetensors")]) == 2
    one_line_error(capsys, "as safetensors")
    assert main([*job, "--workers", "1", "--partitions", "0"]) == 2
    one_line_error(capsys, "--partitions must be at least 1, got 0")
    assert main(["demo", "--users", "0"]) == 2
    one_line_error(capsys, "--users and --visits must be at least 1")
    assert main(["config", "--set", "serving.max_queue_ms=NaN"]) == 2
    one_line_error(capsys, "serving.max_queue_ms must be a finite number >= 0, got nan")
    assert main(["config", "--set", "serving.max_reading_bytes=1000"]) == 2
    one_line_error(capsys, "serving.max_reading_bytes (1000) must be at least serving.max_body_bytes (67108864)")


def test_rank_exits_1_when_every_request_failed(tmp_path, capsys):
    good = msgspec.json.encode(requests_for(tiny_config(), n_users=1, visits=1)[0]).decode()
    (tmp_path / "in.jsonl").write_text('{not json\n{"request_id": "r", "user_id": 1}\n')
    args = ["rank", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
            "--config", str(write_config(tmp_path)), "--no-progress"]
    assert main(args) == 1
    assert "all 2 requests failed" in capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["error"] for r in rows)  # the error rows are still written
    (tmp_path / "in.jsonl").write_text("{not json\n" + good + "\n")
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "ranked 1 requests (1 failed)" in err and "error" not in err


def generate_requests(config, n_users, visits):
    """Retrieval requests (every history has at least one event)."""
    return [msgspec.convert(msgspec.to_builtins(r), GenerateRequest) for r in synthetic_requests(
        config.model, n_users, visits, first_history=(1, 40), new_events=(0, 8), num_candidates=(1, 6), seed=5)]


@pytest.mark.parametrize("exclude_history", [True, False])
def test_generate_jsonl_with_bad_rows(exclude_history, tmp_path, capsys):
    config = tiny_config()
    requests = generate_requests(config, 4, 3)
    lines = [msgspec.json.encode(r).decode() for r in requests]
    lines.insert(1, "{not json")
    lines.insert(4, json.dumps({"request_id": "typed-wrong", "user_id": "u", "item_ids": ["x"], "action_ids": [],
                                "timestamps": []}))
    lines.insert(6, json.dumps({**json.loads(lines[0]), "request_id": "empty", "item_ids": [], "action_ids": [],
                                "timestamps": []}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    flag = "--exclude-history" if exclude_history else "--no-exclude-history"
    assert main(["generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--top-k", "7", flag,
                 "--config", str(write_config(tmp_path)), "--no-progress"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(lines)
    assert rows[1]["request_id"] == "line-2" and "not valid JSON" in rows[1]["error"] and rows[1]["item_ids"] == []
    assert (rows[4]["request_id"], rows[4]["user_id"]) == ("typed-wrong", "u") and "invalid request" in rows[4]["error"]
    assert rows[6]["request_id"] == "empty" and "at least one history event" in rows[6]["error"]
    good = [r for r in rows if r["error"] is None]
    assert [r["request_id"] for r in good] == [r.request_id for r in requests]
    expected = GREngine(config).generate(requests, GenerateParams(top_k=7, exclude_history=exclude_history),
                                         use_tqdm=False)
    for row, request, exp in zip(good, requests, expected):
        assert exp.error is None and len(exp.item_ids) == 7
        assert row["item_ids"] == exp.item_ids and row["user_id"] == request.user_id
        np.testing.assert_allclose(row["scores"], exp.scores, atol=1e-6)
        assert row["num_gpu_cached_tokens"] == exp.num_gpu_cached_tokens
        if exclude_history:
            assert not set(row["item_ids"]) & set(request.item_ids)
    assert "retrieved items for 12 requests (3 failed)" in capsys.readouterr().err


def test_generate_to_parquet_and_bad_arguments(tmp_path, capsys):
    requests = generate_requests(tiny_config(), 2, 1)
    (tmp_path / "in.jsonl").write_text("".join(msgspec.json.encode(r).decode() + "\n" for r in requests))
    args = ["generate", "--input", str(tmp_path / "in.jsonl"), "--config", str(write_config(tmp_path)),
            "--no-progress"]
    assert main([*args, "--output", str(tmp_path / "out.parquet"), "--top-k", "3"]) == 0
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["request_id"] for r in rows] == [r.request_id for r in requests]
    assert all(r["error"] is None and len(r["item_ids"]) == len(r["scores"]) == 3 for r in rows)
    capsys.readouterr()
    assert main([*args, "--output", str(tmp_path / "x.jsonl"), "--top-k", "0"]) == 2
    one_line_error(capsys, "top_k must be positive, got 0")
    assert not (tmp_path / "x.jsonl").exists()
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert main([*args[:1], "--input", str(tmp_path / "bad.jsonl"), *args[3:], "--output",
                 str(tmp_path / "y.jsonl")]) == 1
    assert "all 1 requests failed" in capsys.readouterr().err


def test_rank_parquet_to_jsonl(tmp_path):
    requests = requests_for(tiny_config())
    pq.write_table(pa.Table.from_pylist(msgspec.to_builtins(requests)), tmp_path / "in.parquet")
    out = tmp_path / "out.jsonl"
    assert main(["rank", "--input", str(tmp_path / "in.parquet"), "--output", str(out),
                 "--config", str(write_config(tmp_path)), "--set", "cache.mode=recompute", "--no-progress"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["request_id"] for r in rows] == [r.request_id for r in requests]
    assert all(r["error"] is None and r["num_gpu_cached_tokens"] == 0 for r in rows)


def test_rank_reports_bad_arguments(tmp_path, capsys):
    assert main(["rank", "--input", str(tmp_path / "x.csv"), "--output", str(tmp_path / "y.jsonl")]) == 2
    assert "cannot tell the format" in capsys.readouterr().err
    assert main(["rank", "--input", "a.jsonl", "--output", "b.jsonl", "--set", "cache.mode=nope"]) == 2
    assert "invalid config" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["rank", "generate"])
@pytest.mark.parametrize("parquet_side", ["input", "output"])
def test_rank_without_pyarrow_fails_before_ranking(command, parquet_side, tmp_path, capsys, monkeypatch):
    requests = requests_for(tiny_config(), n_users=2, visits=1)
    paths = {"input": tmp_path / "in.jsonl", "output": tmp_path / "out.jsonl"}
    paths[parquet_side] = paths[parquet_side].with_suffix(".parquet")
    if parquet_side == "input":
        pq.write_table(pa.Table.from_pylist(msgspec.to_builtins(requests)), paths["input"])
    else:
        paths["input"].write_text("".join(msgspec.json.encode(r).decode() + "\n" for r in requests))
    for module in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, module, None)  # `import pyarrow` now raises ImportError

    def no_ranking(*args, **kwargs):
        raise AssertionError("ranking started although the output cannot be written")

    monkeypatch.setattr(GREngine, "rank", no_ranking)
    monkeypatch.setattr(GREngine, "generate", no_ranking)
    assert main([command, "--input", str(paths["input"]), "--output", str(paths["output"]),
                 "--config", str(write_config(tmp_path)), "--no-progress"]) == 2
    one_line_error(capsys, "Parquet files need pyarrow")
    assert not paths["output"].exists()


def test_config_file_and_overrides(tmp_path):
    toml = tmp_path / "engine.toml"
    toml.write_text('device = "cpu"\n[model]\nnum_layers = 3\n[cache]\nmode = "unlimited"\n')
    config = load_config(toml, ["scheduler.max_num_seqs=2", "model.dtype=bfloat16"])
    assert (config.model.num_layers, config.cache.mode, config.scheduler.max_num_seqs) == (3, "unlimited", 2)
    assert config.model.dtype == "bfloat16" and config.model.d_model == 64  # defaults kept
    with pytest.raises(ValueError, match="unknown field"):
        load_config(None, ["model.num_layerz=3"])
    with pytest.raises(ValueError, match="Expected `int`"):
        load_config(None, ["model.num_layers=three"])
    with pytest.raises(ValueError, match="must be positive"):
        load_config(None, ["cache.page_size=0"])
    with pytest.raises(ValueError, match="host_budget_bytes must be >= 0"):
        load_config(None, ["cache.host_budget_bytes=-1"])
    with pytest.raises(ValueError, match="must exceed"):
        load_config(None, ["scheduler.max_num_batched_tokens=100", "model.max_candidates=128"])


def test_an_engine_checks_a_config_built_in_python_as_load_config_does():
    """msgspec does not type-check a struct built in Python: ``GREngine`` checks it (types, allowed values, the
    attention backend) and says what is wrong in a ``ValueError``; numpy integers are accepted as ints."""
    from msgspec.structs import replace

    base = tiny_config()
    bad = {
        "`int`, got `bool`": replace(base, cache=replace(base.cache, num_gpu_pages=True)),
        "`int`, got `float`": replace(base, cache=replace(base.cache, num_gpu_pages=64.0)),
        "Invalid enum value 'foo'": replace(base, cache=replace(base.cache, mode="foo")),
        "Invalid enum value 'float16'": replace(base, cache=replace(base.cache, host_dtype="float16")),
        "attention_backend 'nope' is unknown": replace(base, attention_backend="nope"),
    }
    for message, config in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            GREngine(config)
    for alpha in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"model\.attn_alpha must be finite"):
            replace(base.model, attn_alpha=alpha)
        with pytest.raises(ValueError, match=r"model\.attn_alpha must be finite"):
            load_config(None, [f"model.attn_alpha={'NaN' if alpha != alpha else 'Infinity'}"])
    numpy_ints = replace(base, cache=replace(base.cache, num_gpu_pages=np.int64(base.cache.num_gpu_pages)))
    assert GREngine(numpy_ints).kv.pool.num_pages == base.cache.num_gpu_pages


BAD_SETTINGS = {
    "device=cdua": "device 'cdua' is not one of 'cpu', 'cuda', 'cuda:N' or 'auto'",
    "device=meta": "device 'meta' is not one of",
    "device=cuda": "device 'cuda' requested but CUDA is not available",
    "attention_backend=nope": "attention_backend 'nope' is unknown: use 'auto' or one of flashinfer, hstu_triton",
}


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def one_line_error(capsys, message: str) -> None:
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("setting", sorted(BAD_SETTINGS))
def test_bad_device_or_backend_is_a_config_error(setting, no_cuda, tmp_path, capsys):
    with pytest.raises(ValueError, match=re.escape(BAD_SETTINGS[setting])):
        load_config(None, [setting])
    (tmp_path / "in.jsonl").write_text("{}\n")
    rank = ["rank", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    for command in (["config"], ["demo"], rank):
        assert main([*command, "--set", setting]) == 2
        one_line_error(capsys, BAD_SETTINGS[setting])
    assert not (tmp_path / "out.jsonl").exists()
    key, value = setting.split("=")
    flag = "--device" if key == "device" else "--backend"
    assert main(["bench", "--quick", flag, value, "--out", str(tmp_path / "bench")]) == 2
    one_line_error(capsys, BAD_SETTINGS[setting])
    assert not (tmp_path / "bench").exists()


def test_device_and_backend_settings_that_are_accepted(no_cuda, monkeypatch):
    for device in ("cpu", "auto", "cuda:1"):
        assert EngineConfig(device=device).device == device  # the struct checks the syntax only
    with pytest.raises(ValueError, match="device 'cdua'"):
        EngineConfig(device="cdua")
    assert load_config(None, ["attention_backend=auto", "device=auto"]).attention_backend == "auto"
    registry = BackendRegistry(load_entry_points=False)
    registry.register("mine", TorchRefBackend)
    assert load_config(None, ["attention_backend=mine"], backends=registry).attention_backend == "mine"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert load_config(None, ["device=cuda:0"]).device == "cuda:0"
    with pytest.raises(ValueError, match=r"'cuda:1' requested but this machine has 1 CUDA device\(s\)"):
        load_config(None, ["device=cuda:1"])


@pytest.mark.parametrize("name", ["engine.yaml", "engine.yml", "engine", "engine.txt"])
def test_config_file_of_unknown_format_is_rejected(name, tmp_path, capsys):
    path = tmp_path / name
    path.write_text('{"device": "cpu"}')  # valid JSON: still not read as JSON under another suffix
    with pytest.raises(ValueError, match=r"unknown format .*; use \.json \(JSON\) or \.toml \(TOML\)"):
        load_config(path)
    assert main(["config", "--config", str(path)]) == 2
    one_line_error(capsys, "use .json (JSON) or .toml (TOML)")
    upper = tmp_path / "ENGINE.JSON"
    upper.write_text('{"device": "cpu"}')
    assert load_config(upper).device == "cpu"


def test_config_command_prints_resolved_json(capsys):
    assert main(["config", "--set", "cache.num_gpu_pages=77"]) == 0
    assert json.loads(capsys.readouterr().out)["cache"]["num_gpu_pages"] == 77


def test_demo_shows_hits_and_equal_scores():
    lines = []
    results = run_demo(tiny_config(num_gpu_pages=400, max_num_batched_tokens=200), num_users=6,
                       visits_per_user=4, echo=lines.append)
    by_mode = {r.mode: r for r in results}
    assert set(by_mode) == {"recompute", "gpu_only", "hierarchical", "unlimited"}
    assert by_mode["recompute"].hit_ratio == 0 and by_mode["unlimited"].hit_ratio > 0.5
    assert by_mode["hierarchical"].hit_ratio >= by_mode["gpu_only"].hit_ratio
    assert all(r.max_abs_diff <= 1e-5 for r in results)
    assert any("speedup" in line for line in lines)


def test_bench_calibrate_prints_gpu_only_hit_ratios(capsys, tmp_path):
    assert main(["bench", "--quick", "--calibrate", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["seed 0", "seed 1", "seed 2"]
    assert all("gpu_only at 40 pages hits" in line for line in lines)
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("command", [[], ["demo"], ["rank"], ["generate"], ["bench"], ["config"]])
def test_help_is_plain_text(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gr-engine")
    for markup in ("``", ":class:", ":func:", ":mod:"):
        assert markup not in out, f"reStructuredText {markup!r} in the help text"


def test_module_entry_point_is_safe_to_reimport():
    """Spawned workers (the benchmark's simulations) re-import ``python -m gr_engine``'s main module under
    another name; that must not run the command line again."""
    import runpy

    runpy.run_module("gr_engine.__main__", run_name="__mp_main__")  # would raise SystemExit if it ran main()
