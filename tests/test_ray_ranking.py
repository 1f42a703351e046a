"""Offline ranking on Ray Data (``gr-engine rank --workers``, :func:`gr_engine.ray_ranking.rank_dataset`) gives the
single-process outputs: the same request ids and error rows, scores within 1e-5, and the same cached-token counts,
which holds only if every user's visits were served by one engine, in input order (the cache mode never evicts, so
a visit's hits are its previous visit's history whatever the batch-mates)."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gr_engine import GenerateParams, GenerateRequest, GREngine, RankRequest
from gr_engine.cli import main
from gr_engine.output_writer import array_as_lists
from gr_engine.synthetic import synthetic_requests
from tests.conftest import tiny_config

#: Never evicts, and holds every user of the streams below.
CONFIG = tiny_config(mode="unlimited", num_gpu_pages=8192)
COUNTERS = ("num_gpu_cached_tokens", "num_host_cached_tokens", "num_computed_tokens")


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the module: 2 CPUs for the 2 engine actors, 1 for the read and shuffle tasks."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


def stream(num_users, visits, seed):
    """Returning users' visits, interleaved; every seventh user has a string id."""
    requests = synthetic_requests(CONFIG.model, num_users, visits, first_history=(1, 30), new_events=(0, 6),
                                  num_candidates=(1, 6), seed=seed)
    rows = msgspec.to_builtins(requests)
    for row in rows:
        if row["user_id"] % 7 == 0:
            row["user_id"] = f"s{row['user_id']}"
    return rows


def malformed_lines(template):
    """JSONL lines that fail: in parsing (JSON syntax, wrong types, missing fields) or in the engine (too many
    candidates, items outside the vocabulary); None marks a blank line."""
    return [
        "{not json", None, json.dumps([1, 2]), json.dumps({**template, "request_id": "bad-user", "user_id": [1]}),
        json.dumps({**template, "request_id": "bad-items", "item_ids": "abc"}),
        json.dumps({"user_id": 3, "item_ids": [1]}),
        json.dumps({**template, "request_id": "too-many",
                    "candidate_item_ids": list(range(CONFIG.model.max_candidates + 1))}),
        json.dumps({**template, "request_id": "oov", "item_ids": [10**6] * len(template["item_ids"])}),
        json.dumps({**template, "request_id": "huge-user", "user_id": 2**70}),
        json.dumps({**template, "request_id": "huge-item", "item_ids": [2**70] + template["item_ids"][1:]}),
        json.dumps({**template, "request_id": "overlong", "item_ids": list(range(3 * 10**5))}),  # 2 MB: unread
    ]


def write_jsonl(path, rows, seed):
    """``rows`` as JSONL with :func:`malformed_lines` spread among them."""
    lines = [json.dumps(row) for row in rows]
    rng = np.random.default_rng(seed)
    for line in malformed_lines(rows[0]):
        lines.insert(int(rng.integers(0, len(lines))), "" if line is None else line)
    path.write_text("\n".join(lines) + "\n")


def run_cli(*args):
    return main([*args, "--no-progress"])


def by_id(rows):
    index = {row["request_id"]: row for row in rows}
    assert len(index) == len(rows)
    return index


def assert_same_outputs(distributed, single):
    """Same ids, errors, user ids (as strings), cached-token counts, scores (1e-5) and item ids."""
    got, want = by_id(distributed), by_id(single)
    assert got.keys() == want.keys()
    for request_id, expected in want.items():
        row = got[request_id]
        assert row["error"] == expected["error"], request_id
        assert row["user_id"] == (None if expected["user_id"] is None else str(expected["user_id"])), request_id
        assert [row[name] for name in COUNTERS] == [expected[name] for name in COUNTERS], request_id
        assert row.get("item_ids") == expected.get("item_ids"), request_id
        got_scores, want_scores = np.asarray(row["scores"], np.float32), np.asarray(expected["scores"], np.float32)
        assert got_scores.shape == want_scores.shape, request_id
        np.testing.assert_allclose(got_scores, want_scores, atol=1e-5, rtol=0, err_msg=request_id)


def test_rank_on_two_workers_equals_single_process(ray_session, tmp_path):
    config = tmp_path / "engine.json"
    config.write_text(msgspec.json.encode(CONFIG).decode())
    write_jsonl(tmp_path / "in.jsonl", stream(400, 6, seed=3), seed=3)
    assert run_cli("rank", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "single.parquet"),
                   "--config", str(config)) == 0
    assert run_cli("rank", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"),
                   "--config", str(config), "--workers", "2") == 0
    single = pq.read_table(tmp_path / "single.parquet").to_pylist()
    distributed = pq.read_table(tmp_path / "out").to_pylist()
    assert len(single) > 2000 and sum(row["error"] is not None for row in single) == 10
    assert sum(row["num_gpu_cached_tokens"] > 0 for row in single) > 1000  # returning users hit their caches
    assert_same_outputs(distributed, single)
    # row_order is the line number of the (only) file: sorting by it gives the input order back
    in_order = sorted(distributed, key=lambda row: row["row_order"])
    assert [row["request_id"] for row in in_order] == [row["request_id"] for row in single]
    lines = (tmp_path / "in.jsonl").read_text().splitlines()
    [overlong] = [row for row in in_order if "bytes that any valid request takes" in (row["error"] or "")]
    assert json.loads(lines[overlong["row_order"] - 1])["request_id"] == "overlong"  # its leading ids label it
    for row in in_order:
        if row["request_id"].startswith("line-"):
            assert row["request_id"] == f"line-{row['row_order']}"
        else:
            assert json.loads(lines[row["row_order"] - 1])["request_id"] == row["request_id"]


def test_generate_over_a_folder_of_parquet_files(ray_session, tmp_path):
    """Two Parquet files, one user's visits spread over both: files in name order, rows in file order. Retrieval
    never reads candidates: a candidate column over the string bound (``row_bounds.MAX_STRING_BYTES``) refuses
    no row."""
    rows = [{**row, "user_id": str(row["user_id"]), "candidate_item_ids": ["c"]}  # one type per column
            for row in stream(60, 4, seed=5)]
    rows[3]["candidate_item_ids"] = ["c" * 2**21]
    folder = tmp_path / "in"
    folder.mkdir()
    half = len(rows) // 2
    pq.write_table(pa.Table.from_pylist(rows[:half] + [{"user_id": "9"}]), folder / "a.parquet", row_group_size=50)
    pq.write_table(pa.Table.from_pylist(rows[half:]), folder / "b.parquet", row_group_size=50)
    (folder / "_SUCCESS").write_text("")  # skipped, as Ray skips such names
    config = tmp_path / "engine.json"
    config.write_text(msgspec.json.encode(CONFIG).decode())
    assert run_cli("generate", "--input", str(folder), "--output", str(tmp_path / "out"), "--config", str(config),
                   "--workers", "2", "--partitions", "5", "--output-format", "jsonl", "--top-k", "4") == 0
    distributed = [json.loads(line) for path in sorted((tmp_path / "out").iterdir())
                   for line in path.read_text().splitlines()]
    requests = [msgspec.convert(row, GenerateRequest) for row in rows]
    outputs = GREngine(CONFIG).generate(requests, GenerateParams(top_k=4), use_tqdm=False)
    single = msgspec.to_builtins(outputs)
    [failed] = [row for row in distributed if row["error"] is not None]
    assert failed["request_id"] == f"a.parquet:row-{half + 1}" and failed["user_id"] == "9"
    distributed.remove(failed)
    assert_same_outputs(distributed, single)


def test_rank_dataset_of_request_columns(ray_session):
    """A dataset of request fields (as ``ray.data.read_parquet`` gives) plus ``row_order``."""
    from gr_engine.ray_ranking import rank_dataset

    rows = stream(40, 4, seed=7)
    ds = ray_session.data.from_items([{**row, "row_order": order} for order, row in enumerate(rows)])
    distributed = rank_dataset(ds, CONFIG, 2).take_all()
    outputs = GREngine(CONFIG).rank([msgspec.convert(row, RankRequest) for row in rows], use_tqdm=False)
    single = msgspec.to_builtins(outputs, enc_hook=array_as_lists)
    assert_same_outputs(distributed, single)
    assert sorted(row["row_order"] for row in distributed) == list(range(len(rows)))


def test_an_integer_beyond_64_bits_is_its_rows_error_with_its_labels():
    """msgpack holds no int beyond 64 bits: the wire row carries it all the same, so the engine refuses it as in one
    process (``validation.parse_fields``), labelled by the row's request and user ids; its batch-mates are served.
    (The wire rows used to hold msgpack's OverflowError instead, labelled ``line-N``.) No Ray cluster needed: the
    worker is called here, on the wire rows of its partition."""
    pytest.importorskip("ray")
    from gr_engine.io import parse_row, serve_rows
    from gr_engine.ray_ranking import ROW_ORDER, EngineWorker
    from gr_engine.ray_source import wire_table

    rows = stream(3, 2, seed=2)
    template = rows[0]
    rows[1:1] = [{**template, "request_id": "huge-user", "user_id": 2**70},
                 {**template, "request_id": "huge-item", "item_ids": [2**70, -(2**64)] + template["item_ids"][2:]},
                 {**template, "request_id": "huge-nested", "user_id": -(2**70), "extra": {"a": [[2**100]]}},
                 {**template, "request_id": "uint64-user", "user_id": 2**64 - 1}]
    wire = wire_table((order, f"line-{order}", row) for order, row in enumerate(rows, start=1))
    assert wire["error"].null_count == len(rows)
    distributed = pa.concat_tables(EngineWorker(CONFIG, False, None)(wire)).to_pylist()
    assert [row[ROW_ORDER] for row in distributed] == list(range(1, len(rows) + 1))
    parsed = [parse_row(f"line-{order}", row, RankRequest) for order, row in enumerate(rows, start=1)]
    single = msgspec.to_builtins(serve_rows(GREngine(CONFIG), parsed, None), enc_hook=array_as_lists)
    assert_same_outputs(distributed, single)
    errors = {row["request_id"]: (row["user_id"], row["error"]) for row in distributed if row["error"]}
    assert errors.keys() == {"huge-user", "huge-item", "huge-nested"}
    assert errors["huge-user"] == (str(2**70), f"user_id {2**70} does not fit in 64 bits (signed or unsigned): "
                                               f"the range is [{-(2**63)}, {2**64 - 1}]")
    assert errors["huge-item"][0] == str(template["user_id"]) and f"item_ids contains {2**70}" in errors["huge-item"][1]
    assert errors["huge-nested"][0] == str(-(2**70))


def test_a_parquet_row_over_the_models_lists_is_refused_as_in_one_process(tmp_path):
    """The Ray reader refuses a Parquet row with a list over the model's limits (``io.max_list_lengths``) before
    converting it, as a single process does: the same error, request id and user id; its batch-mates are served.
    No Ray cluster needed: the datasource's read and the worker are called here."""
    pytest.importorskip("ray")
    from pyarrow.fs import LocalFileSystem

    from gr_engine.io import max_list_lengths, read_requests, serve_rows
    from gr_engine.ray_ranking import EngineWorker
    from gr_engine.ray_source import RequestFilesDatasource

    rows = [{**row, "user_id": str(row["user_id"])} for row in stream(3, 2, seed=2)]  # one type per column
    template = rows[0]
    rows[1:1] = [{**template, "request_id": "long", "user_id": "u-long", "item_ids": list(range(1000)),
                  "action_ids": [1] * 1000, "timestamps": [7] * 1000},
                 {**template, "request_id": "too-many", "candidate_item_ids": [1] * 13}]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    limits = max_list_lengths(CONFIG)
    source = RequestFilesDatasource(str(path), None, limits)
    with LocalFileSystem().open_input_file(str(path)) as f:
        wire = pa.concat_tables(source._read_stream(f, str(path)))
    distributed = pa.concat_tables(EngineWorker(CONFIG, False, None)(wire)).to_pylist()
    parsed = read_requests(path, RankRequest, None, limits)
    single = msgspec.to_builtins(serve_rows(GREngine(CONFIG), parsed, None), enc_hook=array_as_lists)
    assert_same_outputs(distributed, single)
    errors = {row["request_id"]: (row["user_id"], row["error"]) for row in distributed if row["error"]}
    assert errors.keys() == {"long", "too-many"} and errors["long"][0] == "u-long"
    assert errors["long"][1].startswith("item_ids holds 1,000 values, over the 256 that any valid request holds")
    assert errors["too-many"][1].startswith("candidate_item_ids holds 13 values, over the 12")


def read_wire(path, limits, **options):
    """The wire rows the Ray reader makes of the file ``path`` (its read task, called here: no cluster needed) and
    the peak of Python allocations while it reads (bytes)."""
    import tracemalloc

    from pyarrow.fs import LocalFileSystem

    from gr_engine.ray_source import RequestFilesDatasource

    source = RequestFilesDatasource(str(path), None, limits, **options)
    tracemalloc.start()
    try:
        with LocalFileSystem().open_input_file(str(path)) as f:
            wire = pa.concat_tables(source._read_stream(f, str(path)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return wire, peak


def test_the_ray_reader_reads_request_columns_and_refuses_long_strings_as_in_one_process(tmp_path):
    """The Ray reader reads a Parquet file's request columns only (here not a column of 6 x 8 MiB blobs, nor
    candidates for retrieval), and refuses a row of a 2 MiB ``request_id`` before converting it, labelled by its
    row and user id, as one process does; its batch-mates are served. It used to convert and encode the blobs and
    the id (a Python peak of 131 MB, now 15 KB)."""
    pytest.importorskip("ray")
    from gr_engine.io import max_list_lengths, read_requests, serve_rows
    from gr_engine.ray_ranking import EngineWorker
    from gr_engine.ray_source import decode_request

    rows = [{**row, "user_id": str(row["user_id"])} for row in stream(3, 2, seed=2)]  # one type per column
    rows[2] = {**rows[2], "request_id": "r" * (2 << 20), "user_id": "u-long"}
    table = pa.Table.from_pylist(rows).append_column("blob", pa.array([b"x" * (8 << 20)] * len(rows)))
    path = tmp_path / "in.parquet"
    pq.write_table(table, path)
    limits = max_list_lengths(CONFIG)
    wire, peak = read_wire(path, limits)
    assert peak < 10**6, peak
    requests = [decode_request(request) for request in wire["request"].to_pylist()]
    assert all("blob" not in request for request in requests)
    distributed = pa.concat_tables(EngineWorker(CONFIG, False, None)(wire)).to_pylist()
    single = msgspec.to_builtins(serve_rows(GREngine(CONFIG), read_requests(path, RankRequest, None, limits), None),
                                 enc_hook=array_as_lists)
    assert_same_outputs(distributed, single)
    [refused] = [row for row in distributed if row["error"]]
    assert (refused["request_id"], refused["user_id"]) == ("row-3", "u-long")
    assert refused["error"].startswith(f"the row's strings take {(2 << 20) + 6:,} bytes (request_id: {2 << 20:,})")
    retrieval, _ = read_wire(path, max_list_lengths(CONFIG, ranking=False), request_type=GenerateRequest)
    read = [decode_request(request) for request, error in zip(retrieval["request"].to_pylist(),
                                                             retrieval["error"].to_pylist()) if error is None]
    assert len(read) == len(rows) - 1 and all(set(row) == set(GenerateRequest.__struct_fields__) for row in read)


def test_the_ray_reader_fails_a_damaged_row_groups_rows_and_reads_on(tmp_path):
    """A flipped byte in the second row group's values: the Ray reader makes its rows error rows labelled
    ``row-N``, as one process does, and serves the next group's (no cluster needed)."""
    pytest.importorskip("ray")
    from gr_engine.io import max_list_lengths, read_requests, serve_rows
    from gr_engine.ray_ranking import EngineWorker
    from tests.test_damaged_parquet import column_chunk, flipped

    rows = [{**row, "user_id": str(row["user_id"])} for row in stream(3, 3, seed=2)]  # one type per column
    clean = tmp_path / "clean.parquet"
    pq.write_table(pa.Table.from_pylist(rows), clean, row_group_size=3, write_page_checksum=True)
    path = flipped(clean, column_chunk(clean, 1, "item_ids")[-1], tmp_path / "in.parquet")
    limits = max_list_lengths(CONFIG)
    wire, _ = read_wire(path, limits)
    distributed = pa.concat_tables(EngineWorker(CONFIG, False, None)(wire)).to_pylist()
    single = msgspec.to_builtins(serve_rows(GREngine(CONFIG), read_requests(path, RankRequest, None, limits), None),
                                 enc_hook=array_as_lists)
    assert_same_outputs(distributed, single)
    failed = {row["request_id"]: row["error"] for row in distributed if row["error"]}
    assert failed.keys() == {"row-4", "row-5", "row-6"}
    assert all("row group 1 of the file is damaged" in error for error in failed.values())
    assert len(distributed) == len(rows)


class MappedBatches:
    """Stands in for a Ray dataset in :func:`rank_dataset`: keeps the function and arguments it maps over each
    batch, so that a batch can be given to them here (no cluster needed)."""

    def map_batches(self, fn, *, batch_format, fn_kwargs):
        self.fn, self.kwargs = fn, fn_kwargs
        return self

    def groupby(self, *args, **kwargs):
        return self

    def map_groups(self, *args, **kwargs):
        return self

    def __call__(self, batch):
        return self.fn(batch, **self.kwargs)


def test_rank_dataset_refuses_request_columns_over_the_bounds_before_converting_them():
    """A dataset of request columns (not read by ``read_request_files``) is bounded as a file job is: a row of a
    3 M-event history, or of a 2 MiB ``request_id``, is its row's error with its labels before it is converted to
    Python (it used to be converted whole: a peak of 201 MB here, now 14 KB), and a column the request does not
    have is not converted; the other rows are served as in one process."""
    pytest.importorskip("ray")
    import tracemalloc

    from gr_engine.io import parse_row, serve_rows
    from gr_engine.ray_ranking import ROW_ORDER, EngineWorker, rank_dataset
    from gr_engine.ray_source import decode_request

    big = 3 * 10**6
    rows = [{**row, "user_id": str(row["user_id"])} for row in stream(3, 2, seed=2)]  # one type per column
    template = {**rows[0], "user_id": "u-77"}
    offsets = pa.array([0, big], type=pa.int32())
    long_lists = pa.table({"request_id": ["big"], "user_id": ["u-77"],
                           "item_ids": pa.ListArray.from_arrays(offsets, pa.array(np.arange(big) + 10**5)),
                           "action_ids": pa.ListArray.from_arrays(offsets, pa.array(np.ones(big, dtype=np.int64))),
                           "timestamps": pa.ListArray.from_arrays(offsets, pa.array(np.full(big, 7))),
                           "candidate_item_ids": pa.array([[1, 2]])})
    good = pa.Table.from_pylist(rows)
    long_id = pa.Table.from_pylist([{**template, "request_id": "r" * (2 << 20)}]).cast(good.schema)
    table = pa.concat_tables([good.slice(0, 2), long_lists.select(good.column_names).cast(good.schema), long_id,
                              good.slice(2)])
    table = table.append_column("extra", pa.array([[b"x"]] * len(table))).append_column(
        ROW_ORDER, pa.array(np.arange(1, len(table) + 1)))
    mapped = rank_dataset(MappedBatches(), CONFIG, 2)
    tracemalloc.start()
    try:
        wire = mapped(table)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10**6, peak
    assert all("extra" not in decode_request(request) for request in wire["request"].to_pylist())
    distributed = pa.concat_tables(EngineWorker(CONFIG, False, None)(wire)).to_pylist()
    errors = {row["request_id"]: (row["user_id"], row["error"]) for row in distributed if row["error"]}
    assert errors.keys() == {"big", "row-4"} and errors["big"][0] == errors["row-4"][0] == "u-77"
    assert errors["big"][1].startswith(f"item_ids holds {big:,} values, over the 256 that any valid request holds")
    assert errors["row-4"][1].startswith("the row's strings take")
    parsed = [parse_row("", row, RankRequest) for row in rows]
    single = msgspec.to_builtins(serve_rows(GREngine(CONFIG), parsed, None), enc_hook=array_as_lists)
    assert_same_outputs([row for row in distributed if not row["error"]], single)


def test_workers_without_ray_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    (tmp_path / "in.jsonl").write_text("")
    assert run_cli("rank", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"),
                   "--workers", "2") == 2
    assert "pip install 'gr-engine[ray]'" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--partitions", "3"], "are for --workers"),
    (["--output-format", "jsonl"], "are for --workers"),
])
def test_bad_worker_arguments(tmp_path, capsys, extra, message):
    (tmp_path / "in.jsonl").write_text("")
    assert run_cli("rank", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"), *extra) == 2
    assert message in capsys.readouterr().err


def test_output_folder_must_be_empty(ray_session, tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text("")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.parquet").write_text("")
    assert run_cli("rank", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"),
                   "--workers", "2") == 2
    assert "must be a new or empty folder" in capsys.readouterr().err


def test_the_package_does_not_import_ray():
    code = "import sys, gr_engine, gr_engine.cli; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
