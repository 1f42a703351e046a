"""``gr-engine rank`` / ``generate`` stream their files: a chunk is read, served and written before the next is read,
and the output is the same as serving the whole file at once (and as ``GREngine.rank`` of its requests)."""

from __future__ import annotations

import json
import re

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gr_engine.io as gio
import gr_engine.output_writer as gow
from gr_engine import GenerateParams, GenerateRequest, GREngine, RankOutput, RankRequest
from gr_engine.cli import main
from gr_engine.io import RequestReader
from gr_engine.json_labels import overlong_labels
from gr_engine.output_writer import OutputWriter
from gr_engine.synthetic import synthetic_requests
from tests.conftest import tiny_config, with_cache

CHUNK = 4  # rows per chunk in these tests


def read_rows(path):
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_job(tmp_path, monkeypatch, command, source, out_name, chunk_rows, *extra):
    """Run ``gr-engine command`` on ``source`` with ``chunk_rows`` rows per chunk; the output's rows."""
    config = tmp_path / "engine.json"
    config.write_text(msgspec.json.encode(tiny_config()).decode())
    monkeypatch.setattr(gio, "CHUNK_ROWS", chunk_rows)
    out = tmp_path / out_name
    assert main([command, "--input", str(source), "--output", str(out), "--config", str(config),
                 "--no-progress", *extra]) == 0
    return read_rows(out)


def stream_requests(generate=False):
    """15 visits of 5 users, interleaved (retrieval requests: every history has an event)."""
    requests = synthetic_requests(tiny_config().model, 5, 3, first_history=(1, 40), new_events=(0, 8),
                                  num_candidates=(1, 6), seed=4)
    if generate:
        return [msgspec.convert(msgspec.to_builtins(r), GenerateRequest) for r in requests]
    return requests


def bad_rows(template, tag):
    """Rows that fail: one while parsing (fields missing), one in the engine (items outside the vocabulary)."""
    return [{"request_id": f"incomplete-{tag}", "user_id": 1, "item_ids": [1]},
            {**template, "request_id": f"oov-{tag}", "item_ids": [10**6] * len(template["item_ids"])}]


def write_input(tmp_path, fmt, requests):
    """The requests with bad rows in several chunks; the file, and the request id or label of each of its rows."""
    rows = msgspec.to_builtins(requests)
    first, second = bad_rows(rows[0], 1), bad_rows(rows[5], 2)
    if fmt == "jsonl":
        lines = [json.dumps(r) for r in rows]
        for at, line in ((1, "{not json"), (6, json.dumps(first[0])), (9, ""), (11, json.dumps(second[1])),
                         (15, json.dumps(first[1])), (17, "[1, 2]")):
            lines.insert(at, line)
        (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
        labels = [json.loads(line)["request_id"] if line.startswith('{"') else f"line-{n}"
                  for n, line in enumerate(lines, start=1) if line]
        return tmp_path / "in.jsonl", labels
    for at, row in ((2, first[0]), (7, second[1]), (10, {"user_id": 3}), (14, first[1])):
        rows.insert(at, row)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet", row_group_size=5)
    return tmp_path / "in.parquet", [r.get("request_id") or f"row-{n}" for n, r in enumerate(rows, start=1)]


JOBS = {  # command, input format, output file
    "rank-jsonl-to-parquet": ("rank", "jsonl", "out.parquet"),
    "rank-parquet-to-jsonl": ("rank", "parquet", "out.jsonl"),
    "generate-jsonl-to-parquet": ("generate", "jsonl", "out.parquet"),
}


@pytest.mark.parametrize("job", sorted(JOBS))
def test_streamed_job_equals_the_whole_file_at_once_and_offline_serving(job, tmp_path, monkeypatch):
    command, fmt, out_name = JOBS[job]
    generate = command == "generate"
    requests = stream_requests(generate)
    source, labels = write_input(tmp_path, fmt, requests)
    extra = ["--top-k", "5"] if generate else []
    writes = []
    monkeypatch.setattr(gow, "ROW_GROUP_ROWS", 6)  # several Parquet row groups
    monkeypatch.setattr(OutputWriter, "write", lambda self, outputs, write=OutputWriter.write: (
        writes.append(len(outputs)), write(self, outputs))[1])
    streamed = run_job(tmp_path, monkeypatch, command, source, out_name, CHUNK, *extra)
    assert len(writes) == -(-len(labels) // CHUNK) and max(writes) == CHUNK
    if out_name.endswith(".parquet"):
        assert pq.ParquetFile(tmp_path / out_name).metadata.num_row_groups > 1
    whole = run_job(tmp_path, monkeypatch, command, source, "whole-" + out_name, 10**6, *extra)
    assert [r["request_id"] for r in streamed] == [r["request_id"] for r in whole] == labels
    for s, w in zip(streamed, whole):
        assert (s["user_id"], s["error"], s["num_gpu_cached_tokens"]) == (w["user_id"], w["error"],
                                                                           w["num_gpu_cached_tokens"])
        np.testing.assert_allclose(np.array(s["scores"], dtype=np.float64), np.array(w["scores"]), atol=1e-5)
    failed = [r["request_id"] for r in streamed if r["error"]]
    assert sum(label.startswith(("line-", "row-", "incomplete")) for label in failed) >= 2
    assert {"oov-1", "oov-2"} <= set(failed)
    served = [r for r in streamed if r["error"] is None]
    assert [r["request_id"] for r in served] == [r.request_id for r in requests]
    for config in (tiny_config(), with_cache(tiny_config(), mode="recompute")):
        engine = GREngine(config)
        expected = (engine.generate(requests, GenerateParams(top_k=5), use_tqdm=False) if generate
                    else engine.rank(requests, use_tqdm=False))
        for row, exp in zip(served, expected):
            assert row["user_id"] == exp.user_id
            if generate:
                assert row["item_ids"] == exp.item_ids
            np.testing.assert_allclose(row["scores"], exp.scores, atol=1e-5)


def test_a_users_visits_in_two_chunks_hit_the_cache(tmp_path, monkeypatch):
    """Chunks are served in order by one engine: a visit in the next chunk finds the user's cached history."""
    visits = {r.request_id: r for r in stream_requests()}
    requests = [visits["u0-v0"], visits["u1-v0"], visits["u0-v1"]]  # chunks of 2 rows: user 0 returns in chunk 2
    assert requests[2].item_ids[:len(requests[0].item_ids)] == requests[0].item_ids
    (tmp_path / "in.jsonl").write_text("".join(msgspec.json.encode(r).decode() + "\n" for r in requests))
    rows = run_job(tmp_path, monkeypatch, "rank", tmp_path / "in.jsonl", "out.jsonl", 2)
    assert rows[2]["num_gpu_cached_tokens"] > 0
    engine = GREngine(tiny_config())
    for row, request in zip(rows, requests):
        [expected] = engine.rank([request], use_tqdm=False)  # one visit at a time
        assert row["num_gpu_cached_tokens"] == expected.num_gpu_cached_tokens
        np.testing.assert_allclose(row["scores"], expected.scores, atol=1e-5)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_the_job_writes_each_chunk_before_parsing_the_next(fmt, tmp_path, monkeypatch):
    source, labels = write_input(tmp_path, fmt, stream_requests())
    events = []
    parse = gio.parse_row
    monkeypatch.setattr(gio, "parse_row", lambda *args: (events.append("parse"), parse(*args))[1])
    monkeypatch.setattr(OutputWriter, "write", lambda self, outputs, write=OutputWriter.write: (
        events.append(f"write {len(outputs)}"), write(self, outputs))[1])
    run_job(tmp_path, monkeypatch, "rank", source, "out.jsonl", CHUNK)
    sizes = [len(labels[start:start + CHUNK]) for start in range(0, len(labels), CHUNK)]
    assert events == [e for n in sizes for e in ["parse"] * n + [f"write {n}"]]
    assert len(sizes) >= 4  # bad rows in several chunks


def test_the_parquet_reader_streams_a_large_row_group(tmp_path, monkeypatch):
    """Reading a file of one 39 MB row group, chunk by chunk, never holds the row group in Arrow memory."""
    n, events = 2400, 512
    rng = np.random.default_rng(0)
    offsets = pa.array(np.arange(0, (n + 1) * events, events, dtype=np.int32))
    column = lambda: pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, 10**9, n * events)))  # noqa: E731
    table = pa.table({"request_id": [f"r{i}" for i in range(n)], "user_id": np.arange(n), "item_ids": column(),
                      "action_ids": column(), "timestamps": column(), "candidate_item_ids": column()})
    size = table.nbytes
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=n)  # incompressible: the file is as large
    del table
    monkeypatch.setattr(gio, "CHUNK_ROWS", 16)
    before, held, rows = pa.total_allocated_bytes(), 0, 0
    with RequestReader(tmp_path / "big.parquet") as reader:
        assert reader.num_rows == n
        for chunk in reader:
            held = max(held, pa.total_allocated_bytes() - before)
            rows += len(chunk)
            assert all(len(r.item_ids) == events for r in chunk)
    assert rows == n
    assert held < size / 2, (held, size)  # about 13 MB of read buffers and pages; 40 MB unbuffered


def overlong_input(tmp_path):
    """Good rows around a line of a 1.2 M-event history (13.5 MB; the model takes 256): the file and that line's
    number (the 4th line, in the first chunk of ``CHUNK`` rows)."""
    requests = stream_requests()[:7]
    long_row = {**msgspec.to_builtins(requests[0]), "request_id": "long", "item_ids": list(range(10**5, 13 * 10**5)),
                "action_ids": [1] * 12 * 10**5, "timestamps": [7] * 12 * 10**5}
    lines = [msgspec.json.encode(r) for r in requests]
    lines.insert(3, msgspec.json.encode(long_row))
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return tmp_path / "in.jsonl", 4, len(lines[3])


def test_an_overlong_jsonl_line_is_refused_unread_in_its_place(tmp_path, monkeypatch):
    """A line longer than any valid request can be (``io.max_line_bytes``) is its row's error before it is decoded,
    labelled by the request and user ids at the start of the line (they used to be left unread: ``line-4``), and its
    batch-mates are served; reading holds at most the bound plus a read block, not the line (it used to be read
    whole and decoded: about 100 MB here)."""
    import tracemalloc

    source, number, size = overlong_input(tmp_path)
    limit = gio.max_line_bytes(tiny_config())
    assert limit < size and limit == (3 * 256 + 12) * 22 + 2**20  # max_history_len 256, max_candidates 12
    monkeypatch.setattr(gio, "CHUNK_ROWS", CHUNK)
    tracemalloc.start()
    try:
        with RequestReader(source, max_line_bytes=limit) as reader:
            chunks = list(reader)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit + gio.READ_BYTES + 2**20, peak
    [refused] = [p for chunk in chunks for p in chunk if isinstance(p, RankOutput)]
    user_id = stream_requests()[0].user_id
    assert refused is chunks[0][number - 1] and (refused.request_id, refused.user_id) == ("long", user_id)
    assert refused.error.startswith(f"line {number} is {size:,} bytes long, over the {limit:,} bytes that any valid "
                                    "request takes")
    assert refused.error.endswith("refused without decoding it (its request_id and user_id are looked for in its "
                                  "first 65,536 bytes only); it begins "
                                  + repr(source.read_bytes().split(b"\n")[number - 1][:60].decode()))
    rows = run_job(tmp_path, monkeypatch, "rank", source, "out.parquet", CHUNK)
    assert [r["request_id"] for r in rows] == [p.request_id for chunk in chunks for p in chunk]
    assert (rows[number - 1]["error"], rows[number - 1]["user_id"]) == (refused.error, user_id)
    served = [r for r in rows if r["request_id"] != "long"]
    expected = GREngine(tiny_config()).rank(stream_requests()[:7], use_tqdm=False)
    assert [r["error"] for r in served] == [None] * 7
    for row, exp in zip(served, expected):
        np.testing.assert_allclose(row["scores"], exp.scores, atol=1e-5)


HUGE = '"item_ids": [' + ", ".join(["123456"] * 40_000) + "]"  # 320 KB
OVERLONG_LABELS = {  # an overlong line: the labels of its error, as (request_id or None, user_id)
    '{"request_id": "first", "user_id": 7, ' + HUGE + "}": ("first", 7),
    '{"user_id": "u-1", "x": [[1, {"a": []}], null, true, -2.5e3], "request_id": "after-junk", ' + HUGE + "}": (
        "after-junk", "u-1"),
    '{"request_\\u0069d": "escaped-key", "user_id": 18446744073709551615, ' + HUGE + "}": (
        "escaped-key", 2**64 - 1),
    '{' + HUGE + ', "request_id": "after-the-array", "user_id": 1}': (None, None),  # beyond the scanned prefix
    '{"pad": "' + "x" * 70_000 + '", "request_id": "late", ' + HUGE + "}": (None, None),
    '{"note": "\\"request_id\\": \\"in-a-string\\", \\"user_id\\": 5", ' + HUGE + "}": (None, None),
    '{"note": "a backslash \\\\", "request_id": "after-escapes", ' + HUGE + "}": ("after-escapes", None),
    '{"meta": {"request_id": "nested", "user_id": 9}, "rows": [{"user_id": 3}], ' + HUGE + "}": (None, None),
    '{"request_id": "dup", "request_id": ["a"], "user_id": [1], ' + HUGE + "}": (None, None),  # lists: not read
    '{"request_id": 42, "user_id": true, ' + HUGE + "}": ("42", None),  # labelled as a short row would be
    '{"request_id": "not-json", "x": NaN, ' + HUGE + "}": (None, None),
    '{"request_id": "bad-utf8", "x": "\udcff", ' + HUGE + "}": (None, None),  # the byte 0xff
    '{"request_id": "closed"} {' + HUGE + "}": (None, None),
    '[{"request_id": "in-a-list"}, ' + HUGE[12:]: (None, None),
}


@pytest.mark.parametrize("block", [7, 1 << 20])
def test_an_overlong_lines_labels_are_read_only_where_they_are_sure(block, monkeypatch):
    """An overlong line's ``request_id`` and ``user_id`` label its error where they are keys of its top-level
    object within its first ``io.LABEL_SCAN_BYTES`` (64 KiB), read strictly as JSON: not after the long array, not
    in a string or a nested object, not from a line whose beginning is not JSON (then it is ``line-N``, as before);
    whatever the read block."""
    import io

    monkeypatch.setattr(gio, "READ_BYTES", block)
    lines = [line.encode("utf-8", "surrogateescape") for line in OVERLONG_LABELS]
    data = b"\xef\xbb\xbf" + b"\r\n".join(lines) + b"\r\n[1]\n"  # a byte-order mark before line 1, CRLF
    rows = list(gio.jsonl_rows(io.BytesIO(data), 300_000))
    assert [number for number, _ in rows] == list(range(1, len(lines) + 2)) and rows[-1][1] == [1]
    got = [(row.request_id, row.user_id) for _, row in rows[:-1]]
    assert got == list(OVERLONG_LABELS.values())
    assert all(str(row).startswith(f"line {n} is ") for n, row in rows[:-1])
    served = gio.parse_row("line-1", rows[0][1], RankRequest)
    assert (served.request_id, served.user_id) == ("first", 7) and served.error.startswith("line 1 is 320,0")


def test_overlong_labels_of_a_whole_line_and_of_a_cut_one():
    """``overlong_labels`` of a whole line (an overlong line under a small bound) reads labels only from valid
    JSON; of a line's beginning, not from a token that may go on beyond it."""
    whole = b'{"request_id": "r", "user_id": 12}'
    assert overlong_labels(whole, complete=True) == ("r", 12)
    assert overlong_labels(whole[:-1], complete=True) == (None, None)  # not closed: not JSON
    assert overlong_labels(whole + b" x", complete=True) == (None, None)
    assert overlong_labels(whole[:-2]) == ("r", None)  # 1 of 12: the user id may go on
    assert overlong_labels(whole[:-1]) == ("r", None)  # 12 of 123?
    assert overlong_labels(whole[:-1] + b" ") == ("r", 12)
    assert overlong_labels(b'{"request_id": "r", "x": "cut \\u00') == ("r", None)  # cut in an escape
    assert overlong_labels(b'{"request_id": "r", "x": "bad \\q"') == (None, None)
    assert overlong_labels(b'{"request_id": "r", "x": [1,], "y": [') == (None, None)


BIG = 3 * 10**6  # events of an overlong Parquet row's history (the model takes 256)


def overlong_parquet(tmp_path):
    """Two good rows of two users around a row of a 3 M-event history, in one row group: the file, the good
    requests."""
    visits = {r.request_id: r for r in stream_requests()}
    good = [visits["u0-v0"], visits["u1-v0"]]
    table = pa.Table.from_pylist(msgspec.to_builtins(good))
    offsets = pa.array([0, BIG], type=pa.int32())
    big = pa.table({"request_id": ["big"], "user_id": [77],
                    "item_ids": pa.ListArray.from_arrays(offsets, pa.array(np.arange(BIG) + 10**5)),
                    "action_ids": pa.ListArray.from_arrays(offsets, pa.array(np.ones(BIG, dtype=np.int64))),
                    "timestamps": pa.ListArray.from_arrays(offsets, pa.array(np.full(BIG, 7))),
                    "candidate_item_ids": pa.array([[1, 2]])}).select(table.column_names).cast(table.schema)
    pq.write_table(pa.concat_tables([table.slice(0, 1), big, table.slice(1)]), tmp_path / "in.parquet")
    return tmp_path / "in.parquet", good


def test_a_parquet_row_over_the_models_lists_is_refused_unconverted_in_its_place(tmp_path, monkeypatch):
    """A Parquet row whose history is longer than any valid request's (``io.max_list_lengths``) is its row's error,
    labelled by its request and user ids, before its lists are made Python objects (they used to be, whole: a read
    peak of 240 MB here, now about 30 KB; then the engine refused it); its batch-mates are served as alone."""
    import tracemalloc

    source, good = overlong_parquet(tmp_path)
    limits = gio.max_list_lengths(tiny_config())
    assert limits == {"item_ids": 256, "action_ids": 256, "timestamps": 256, "candidate_item_ids": 12}
    monkeypatch.setattr(gio, "CHUNK_ROWS", CHUNK)
    tracemalloc.start()
    try:
        with RequestReader(source, max_list_lengths=limits) as reader:
            [chunk] = list(reader)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < BIG * 8 * 3 / 20, peak  # a twentieth of the lists' int64s
    error = (f"item_ids holds {BIG:,} values, over the 256 that any valid request holds (model.max_history_len: "
             "gr_engine.io.max_list_lengths); refused without reading the row's lists")
    assert isinstance(chunk[1], RankOutput) and (chunk[1].request_id, chunk[1].user_id, chunk[1].error) == (
        "big", 77, error)
    assert chunk[0] == good[0] and chunk[2] == good[1]
    rows = run_job(tmp_path, monkeypatch, "rank", source, "out.jsonl", CHUNK)
    assert [(r["request_id"], r["user_id"], r["error"]) for r in rows] == [
        ("u0-v0", good[0].user_id, None), ("big", 77, error), ("u1-v0", good[1].user_id, None)]
    for row, request in zip(rows[::2], good):
        [alone] = GREngine(tiny_config()).rank([request], use_tqdm=False)
        np.testing.assert_allclose(row["scores"], alone.scores, atol=1e-5)


def test_parquet_list_bounds_follow_the_requests_rules(tmp_path):
    """Candidates over ``max_candidates`` are refused for ranking and ignored for retrieval; a list at its bound is
    read; nested lists count their values; null lists and labels of other types are read as the engine would."""
    template = {**msgspec.to_builtins(stream_requests()[0]), "user_id": "u-1"}  # a column has one type
    rows = [{**template, "request_id": "at-bound", "item_ids": [1] * 256, "action_ids": [1] * 256,
             "timestamps": [7] * 256},
            {**template, "request_id": "many-candidates", "candidate_item_ids": [1] * 13},
            {**template, "request_id": None, "user_id": "u-9", "timestamps": [7] * 300},
            {**template, "request_id": "null-lists", "item_ids": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "flat.parquet")
    ranked = gio.read_requests(tmp_path / "flat.parquet", max_list_lengths=gio.max_list_lengths(tiny_config()))
    assert [(p.request_id, p.user_id, getattr(p, "error", None)) for p in ranked[1:3]] == [
        ("many-candidates", "u-1", "candidate_item_ids holds 13 values, over the 12 that any valid "
         "request holds (model.max_candidates: gr_engine.io.max_list_lengths); refused without reading the row's "
         "lists"),
        ("row-3", "u-9", "timestamps holds 300 values, over the 256 that any valid request holds (model."
         "max_history_len: gr_engine.io.max_list_lengths); refused without reading the row's lists")]
    assert ranked[0].request_id == "at-bound" and len(ranked[0].item_ids) == 256
    assert "invalid request" in ranked[3].error  # a null list is read (as None) and refused by msgspec
    retrieved = gio.read_requests(tmp_path / "flat.parquet", GenerateRequest,
                                  max_list_lengths=gio.max_list_lengths(tiny_config(), ranking=False))
    assert [type(p) is GenerateRequest for p in retrieved] == [True, True, False, False]
    nested = pa.table({"request_id": ["a", "b"], "user_id": [1, 2],
                       "item_ids": [[[1] * 200, [2] * 100], [[1] * 2]]})  # 302 values, then 3
    pq.write_table(nested, tmp_path / "nested.parquet")
    refused, unread = gio.read_requests(tmp_path / "nested.parquet", max_list_lengths={"item_ids": 256})
    assert refused.error.startswith("item_ids holds 302 values, over the 256") and refused.user_id == 1
    assert unread.request_id == "b" and unread.error.startswith("invalid request")


@pytest.mark.parametrize("block", [1, 3, 5, 64])
def test_jsonl_lines_split_as_python_splits_them_whatever_the_read_block(block, monkeypatch):
    """Lines split at b"\\n" across read blocks, blank lines skipped but counted, a last line without its newline;
    a line over the bound (newline not counted) is refused, one at the bound is decoded."""
    import io

    monkeypatch.setattr(gio, "READ_BYTES", block)
    data = b'\n  \n[1, 2]\r\n{"a": 12345}\n[1,2,3,4,5,6,7]\n\t\n"x"\n[10, 20]'
    rows = list(gio.jsonl_rows(io.BytesIO(data), 12))
    assert [(n, r) for n, r in rows if not isinstance(r, Exception)] == [(3, [1, 2]), (4, {"a": 12345}), (7, "x"),
                                                                         (8, [10, 20])]
    [(number, error)] = [(n, r) for n, r in rows if isinstance(r, Exception)]
    assert number == 5 and str(error).startswith("line 5 is 15 bytes long, over the 12 bytes")
    unbounded = dict(gio.jsonl_rows(io.BytesIO(data), None))
    assert unbounded[5] == [1, 2, 3, 4, 5, 6, 7] and sorted(unbounded) == [3, 4, 5, 7, 8]


@pytest.mark.parametrize("block", [1, 2, 64])
def test_a_byte_order_mark_begins_the_file_not_its_first_line(block, monkeypatch):
    """A UTF-8 byte-order mark that begins the file is skipped before line 1 is read: a line 1 that is blank after
    it is a blank line (it used to be an error row, "line 1 is not valid JSON"); a mark anywhere else is not JSON."""
    import io

    monkeypatch.setattr(gio, "READ_BYTES", block)
    bom = b"\xef\xbb\xbf"
    rows = list(gio.jsonl_rows(io.BytesIO(bom + b" \r\n[1]\n" + bom + b"[2]\n"), None))
    assert rows[0] == (2, [1]) and rows[1][0] == 3 and "line 3 is not valid JSON" in str(rows[1][1])
    assert list(gio.jsonl_rows(io.BytesIO(bom), None)) == list(gio.jsonl_rows(io.BytesIO(bom + b"\n"), 1)) == []
    assert list(gio.jsonl_rows(io.BytesIO(bom + b'{"a": 1}'), None)) == [(1, {"a": 1})]
    [(number, twice)] = gio.jsonl_rows(io.BytesIO(bom + bom + b"[1]"), None)
    assert number == 1 and "line 1 is not valid JSON" in str(twice)
    [(number, cut)] = gio.jsonl_rows(io.BytesIO(bom[:2]), None)
    assert number == 1 and "line 1 is not valid JSON" in str(cut)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_a_utf16_or_utf32_jsonl_file_is_one_error_saying_so(encoding, tmp_path, capsys):
    """A JSONL file written as UTF-16 (as some shells redirect output) or UTF-32, with its byte-order mark, ends the
    job with one line saying so (each line used to be an error row "not valid JSON", with no hint why)."""
    source = tmp_path / "in.jsonl"
    source.write_text(msgspec.json.encode(stream_requests()[0]).decode() + "\n", encoding=encoding)
    config = tmp_path / "engine.json"
    config.write_text(msgspec.json.encode(tiny_config()).decode())
    assert main(["rank", "--input", str(source), "--output", str(tmp_path / "out.jsonl"), "--config", str(config),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the file is UTF-16 or UTF-32" in err and len(err.strip().splitlines()) == 1, err


def test_jsonl_row_count_is_unknown_and_parquet_one_is_read_from_metadata(tmp_path):
    source, labels = write_input(tmp_path, "parquet", stream_requests())
    with RequestReader(source) as reader:
        assert reader.num_rows == len(labels)
    source, _ = write_input(tmp_path, "jsonl", stream_requests())
    with RequestReader(source) as reader:
        assert reader.num_rows is None


def outputs_for(user_ids, start=0):
    return [RankOutput(request_id=f"r{start + i}", user_id=u, scores=np.full((1, 2), i, dtype=np.float32))
            for i, u in enumerate(user_ids)]


@pytest.mark.parametrize("row_group_rows", [2, 100])
def test_a_string_user_id_in_a_later_chunk_turns_the_column_into_strings(row_group_rows, tmp_path, monkeypatch):
    """Row groups already written (2) or still pending (100) are rewritten with their ids as strings."""
    monkeypatch.setattr(gow, "ROW_GROUP_ROWS", row_group_rows)
    chunks = [[1, 2], [None, 3], ["u-4", 5], [2**64]]
    with OutputWriter(tmp_path / "out.parquet", RankOutput) as writer:
        for n, ids in enumerate(chunks):
            writer.write(outputs_for(ids, start=2 * n))
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("user_id").type == pa.string()
    assert table["user_id"].to_pylist() == ["1", "2", None, "3", "u-4", "5", str(2**64)]
    assert table["request_id"].to_pylist() == [f"r{i}" for i in range(7)]
    assert [s[0][0] for s in table["scores"].to_pylist()] == [0, 1, 0, 1, 0, 1, 0]
    assert table.schema.field("scores").type == pa.list_(pa.list_(pa.float32()))
    assert [p.name for p in tmp_path.iterdir()] == ["out.parquet"]  # no copy left behind


def test_integer_user_ids_stay_integers_and_an_empty_job_has_the_schema(tmp_path, monkeypatch):
    monkeypatch.setattr(gow, "ROW_GROUP_ROWS", 2)
    with OutputWriter(tmp_path / "out.parquet", RankOutput) as writer:
        writer.write(outputs_for([1, None]))
        writer.write(outputs_for([-(2**63), 2**63 - 1], start=2))
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("user_id").type == pa.int64()
    assert table["user_id"].to_pylist() == [1, None, -(2**63), 2**63 - 1]
    (tmp_path / "empty.parquet").write_bytes(b"stale")
    with OutputWriter(tmp_path / "empty.parquet", RankOutput):
        pass
    empty = pq.read_table(tmp_path / "empty.parquet")
    assert empty.num_rows == 0 and empty.schema.names == list(RankOutput.__struct_fields__)


@pytest.mark.parametrize("name", ["out.parquet", "out.jsonl"])
def test_an_output_path_that_is_a_symlink_is_written_through(name, tmp_path, monkeypatch):
    """The link stays a link and its target gets the rows, the rewrite of a Parquet file's user ids into strings
    (a file renamed aside and back) included; nothing is left beside either. The Parquet writer used to delete the
    link and write a regular file in its place."""
    monkeypatch.setattr(gow, "ROW_GROUP_ROWS", 2)
    (tmp_path / "data").mkdir()
    target = tmp_path / "data" / name
    target.write_bytes(b"stale")
    link = tmp_path / name
    link.symlink_to(target)
    with OutputWriter(link, RankOutput) as writer:
        writer.write(outputs_for([1, 2, 3]))
        writer.write(outputs_for(["u-4"], start=3))
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert [r["request_id"] for r in read_rows(target)] == ["r0", "r1", "r2", "r3"]
    assert [r["user_id"] for r in read_rows(target)] == (["1", "2", "3", "u-4"] if name.endswith(".parquet")
                                                         else [1, 2, 3, "u-4"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", name]
    assert [p.name for p in (tmp_path / "data").iterdir()] == [name]
    with OutputWriter(link, RankOutput):  # an empty job truncates the target, through the link
        pass
    assert link.is_symlink() and read_rows(target) == []


def test_mixed_user_ids_from_the_command_line(tmp_path, monkeypatch):
    """Integer ids in the first chunks and a string id later: the Parquet output has every id as a string, as a
    one-chunk job writes it; JSONL keeps each id's type."""
    requests = stream_requests()[:9]
    requests[7] = msgspec.structs.replace(requests[7], user_id="guest")
    (tmp_path / "in.jsonl").write_text("".join(msgspec.json.encode(r).decode() + "\n" for r in requests))
    monkeypatch.setattr(gow, "ROW_GROUP_ROWS", CHUNK)
    streamed = run_job(tmp_path, monkeypatch, "rank", tmp_path / "in.jsonl", "out.parquet", CHUNK)
    whole = run_job(tmp_path, monkeypatch, "rank", tmp_path / "in.jsonl", "whole.parquet", 10**6)
    assert [r["user_id"] for r in streamed] == [r["user_id"] for r in whole] == [str(r.user_id) for r in requests]
    assert all(r["error"] is None for r in streamed)
    as_jsonl = run_job(tmp_path, monkeypatch, "rank", tmp_path / "in.jsonl", "out.jsonl", CHUNK)
    assert [r["user_id"] for r in as_jsonl] == [r.user_id for r in requests]


def test_one_progress_bar_counts_the_rows_of_the_whole_job(tmp_path, monkeypatch, capsys):
    source, labels = write_input(tmp_path, "parquet", stream_requests())
    run_job(tmp_path, monkeypatch, "rank", source, "out.jsonl", CHUNK)
    capsys.readouterr()
    assert main(["rank", "--input", str(source), "--output", str(tmp_path / "out.jsonl"),
                 "--config", str(tmp_path / "engine.json")]) == 0
    bars = [line for line in re.split(r"[\r\n]", capsys.readouterr().err) if "Ranking" in line]
    assert bars and all(f"/{len(labels)} " in bar for bar in bars)  # one total, from the Parquet metadata
    assert f"{len(labels)}/{len(labels)}" in bars[-1]


def test_the_output_may_not_be_the_input(tmp_path, capsys):
    source, _ = write_input(tmp_path, "jsonl", stream_requests())
    before = source.read_bytes()
    assert main(["rank", "--input", str(source), "--output", str(tmp_path / "." / source.name)]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert source.read_bytes() == before
