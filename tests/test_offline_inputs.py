"""Bad inputs to the offline entry points (``gr-engine rank`` / ``generate`` / ``config``, ``GREngine``): a one-line
error and exit status 2 for a bad argument or config, never a traceback or a wrong answer."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from gr_engine import GenerateParams, GenerateRequest, GREngine, RequestError, io
from gr_engine.cli import main
from gr_engine.config import load_config
from gr_engine.output_writer import OutputWriter
from gr_engine.outputs import RankOutput
from tests.conftest import tiny_config
from tests.test_cli import one_line_error

DEEP = 100_000  # brackets: far past Python's recursion limit


@pytest.mark.parametrize("name, text", [("engine.json", "[" * DEEP + "]" * DEEP),
                                        ("engine.toml", "a = " + "[" * DEEP + "]" * DEEP)], ids=["json", "toml"])
def test_config_file_nested_too_deeply_is_a_config_error(name, text, tmp_path, capsys):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match="nested too deeply"):
        load_config(path)
    assert main(["config", "--config", str(path)]) == 2
    one_line_error(capsys, "nested too deeply")


def test_override_nested_too_deeply_is_a_config_error(capsys):
    value = "[" * 5000 + "]" * 5000
    with pytest.raises(ValueError, match=r"override 'model\.seed': its value is nested too deeply"):
        load_config(None, [f"model.seed={value}"])
    assert main(["config", "--set", f"model.seed={value}"]) == 2
    one_line_error(capsys, "nested too deeply")


@pytest.mark.parametrize("setting, message", [
    ("cache.num_gpu_pages=100000000000000000000000", "cannot build the engine"),
    ("cache.num_gpu_pages=1", "demo requests failed in recompute mode: history of"),
])
def test_demo_with_a_config_that_cannot_serve_it_is_a_one_line_error(setting, message, capsys):
    assert main(["demo", "--users", "1", "--visits", "1", "--set", setting]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_model_seed_beyond_64_bits_is_a_config_error(seed, capsys):
    with pytest.raises(ValueError, match=r"model\.seed must fit in 64 bits"):
        load_config(None, [f"model.seed={seed}"])
    assert load_config(None, [f"model.seed={2**64 - 1}"]).model.seed == 2**64 - 1  # torch takes it
    assert main(["demo", "--users", "1", "--visits", "1", "--set", f"model.seed={seed}"]) == 2
    one_line_error(capsys, "model.seed must fit in 64 bits")


def test_demo_negative_seed_is_a_usage_error(capsys):
    assert main(["demo", "--users", "1", "--visits", "1", "--seed", "-1"]) == 2
    one_line_error(capsys, "--seed must be at least 0, got -1")


@pytest.mark.parametrize("gib", ["inf", "nan"])
def test_bench_host_budget_must_be_finite(gib, tmp_path, capsys):
    assert main(["bench", "--quick", "--out", str(tmp_path), "--host-budget-gib", gib]) == 2
    one_line_error(capsys, f"--host-budget-gib must be a finite number, got {gib}")


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_an_output_that_cannot_be_written_fails_before_any_request_is_served(suffix, tmp_path, monkeypatch, capsys):
    (tmp_path / "in.jsonl").write_text(json.dumps(
        {"request_id": "a", "user_id": 1, "item_ids": [1], "action_ids": [0], "timestamps": [1],
         "candidate_item_ids": [2]}) + "\n")
    with pytest.raises(OSError):
        OutputWriter(tmp_path / "missing" / f"out.{suffix}", RankOutput)

    def served(*args):
        raise AssertionError("a request was served for an output that cannot be written")

    monkeypatch.setattr(io, "serve_rows", served)
    assert main(["rank", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "missing" / f"out.{suffix}"),
                 "--no-progress"]) == 2
    one_line_error(capsys, "No such file or directory")


def mistyped_params(**fields) -> GenerateParams:
    params = GenerateParams()
    for name, value in fields.items():  # set after construction, as a caller may: nothing checks it there
        setattr(params, name, value)
    return params


@pytest.mark.parametrize("fields, message", [
    (dict(top_k=1.5), "top_k must be an integer, got float"),
    (dict(top_k=float("nan")), "top_k must be an integer, got float"),
    (dict(top_k=True), "top_k must be an integer, got bool"),
    (dict(top_k=0), r"top_k must be in \[1, 9223372036854775807\], got 0"),
    (dict(exclude_history="no"), "exclude_history must be a bool, got str"),
])
def test_mistyped_generate_params_fail_their_request_not_its_batch_mates(fields, message):
    engine = GREngine(tiny_config())
    user = dict(item_ids=[1, 2, 3], action_ids=[0, 1, 2], timestamps=[1, 2, 3])
    engine.add_request(GenerateRequest(request_id="good", user_id=1, **user), GenerateParams(top_k=5))
    with pytest.raises(RequestError, match=message):
        engine.add_request(GenerateRequest(request_id="bad", user_id=2, **user), mistyped_params(**fields))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    [good] = outputs
    assert good.ok and len(good.item_ids) == 5
    [bad] = engine.generate([GenerateRequest(request_id="bad", user_id=2, **user)], mistyped_params(**fields),
                            use_tqdm=False)
    assert re.search(message, bad.error)
    [alone] = GREngine(tiny_config()).generate([GenerateRequest(request_id="good", user_id=1, **user)],
                                               GenerateParams(top_k=5), use_tqdm=False)
    assert good.item_ids == alone.item_ids
    np.testing.assert_allclose(good.scores, alone.scores, atol=1e-6)
    [numpy_typed] = engine.generate([GenerateRequest(request_id="np", user_id=3, **user)],
                                    GenerateParams(top_k=np.int64(4), exclude_history=np.bool_(False)), use_tqdm=False)
    assert numpy_typed.ok and len(numpy_typed.item_ids) == 4
