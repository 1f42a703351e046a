"""File jobs read of a Parquet file only what a request can hold: the columns of its fields, and of a row only what
is within the bounds of ``gr_engine.row_bounds`` (list values, bytes of strings); a row over them is its own error,
labelled by its ids, without becoming Python objects. Memory is measured where it is the point: the peak of Python
allocations (``tracemalloc``) and of Arrow's (a proxy of its memory pool)."""

from __future__ import annotations

import contextlib
import gc
import tracemalloc
from collections.abc import Iterator

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gr_engine.io as gio
from gr_engine import GenerateRequest, RankOutput, RankRequest
from gr_engine.io import RequestReader
from tests.conftest import tiny_config
from tests.test_streaming_io import BIG, CHUNK, stream_requests

MB = 10**6


@contextlib.contextmanager
def peaks() -> Iterator[dict[str, int]]:
    """``{"python": bytes, "arrow": bytes}``: the peaks of Python and Arrow allocations in the block, over what was
    held before (Arrow's through a proxy of its default pool, kept alive with the result: buffers made in the block
    return to it)."""
    default = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default)
    measured: dict[str, object] = {"pool": pool}
    pa.set_memory_pool(pool)
    tracemalloc.start()
    try:
        yield measured  # type: ignore[misc]
    finally:
        measured["python"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        pa.set_memory_pool(default)
        gc.collect()
        measured["arrow"] = pool.max_memory()


def read_all(path, request_type=RankRequest, **bounds):
    with RequestReader(path, request_type, max_list_lengths=gio.max_list_lengths(
            tiny_config(), ranking=request_type is RankRequest), **bounds) as reader:
        return [parsed for chunk in reader for parsed in chunk]


def blob_file(tmp_path):
    """Six requests and a column they do not have, of 8 MiB blobs (48 MiB): the file and the requests."""
    requests = stream_requests()[:6]
    table = pa.Table.from_pylist(msgspec.to_builtins(requests))
    table = table.append_column("blob", pa.array([b"x" * (8 << 20)] * len(requests)))
    pq.write_table(table, tmp_path / "blobs.parquet")
    return tmp_path / "blobs.parquet", requests


def big_candidates_file(tmp_path):
    """Three retrieval requests, the second with 3 M candidates (retrieval ignores them): the file and the
    requests."""
    requests = stream_requests()[:3]
    rows = msgspec.to_builtins(requests)
    table = pa.Table.from_pylist(rows)
    offsets = pa.array([0, 2, 2 + BIG, 4 + BIG], type=pa.int32())
    values = pa.array(np.concatenate([[1, 2], np.arange(BIG) % 100, [3, 4]]))
    table = table.set_column(table.schema.get_field_index("candidate_item_ids"), "candidate_item_ids",
                             pa.ListArray.from_arrays(offsets, values))
    pq.write_table(table, tmp_path / "candidates.parquet")
    return tmp_path / "candidates.parquet", [msgspec.convert(row, GenerateRequest) for row in rows]


@pytest.mark.parametrize("make_file, request_type", [(blob_file, RankRequest),
                                                     (big_candidates_file, GenerateRequest)],
                         ids=["blob-column", "retrieval-candidates"])
def test_parquet_columns_the_request_does_not_have_are_not_read(make_file, request_type, tmp_path, monkeypatch):
    """A request ignores fields it does not have (msgspec's default), so their columns are not read: a column of
    48 MiB of blobs, or a retrieval file's 3 M candidates, cost neither Arrow nor Python memory (they used to be
    read and converted: peaks of 59 MB in Arrow and 50 MB in Python for the blobs, 51 MB and 24 MB for the
    candidates; now 13 KB and 30 KB, 7 KB and 16 KB), and the requests are the same."""
    source, requests = make_file(tmp_path)
    monkeypatch.setattr(gio, "CHUNK_ROWS", CHUNK)
    with peaks() as peak:
        parsed = read_all(source, request_type)
    assert parsed == requests
    assert peak["python"] < MB and peak["arrow"] < MB, peak


def test_a_parquet_row_with_a_50_mb_id_is_refused_unconverted_in_its_place(tmp_path, monkeypatch):
    """A row whose strings take more than ``row_bounds.MAX_STRING_BYTES`` (1 MiB, the reader's default; here a
    50 MiB ``request_id``) is its row's error before it is made Python objects (it used to be converted whole: a
    Python peak of 52 MB, now 16 KB; Arrow still decodes it, 105 MB of page and value, as before), labelled by its
    row number and user id: the error quotes the id's first 60 characters, not the id. Its batch-mates are
    served."""
    requests = stream_requests()[:4]
    rows = msgspec.to_builtins(requests)
    rows[2] = {**rows[2], "request_id": "r" * (50 << 20), "user_id": 77}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    monkeypatch.setattr(gio, "CHUNK_ROWS", CHUNK)
    with peaks() as peak:
        parsed = read_all(tmp_path / "in.parquet")
    assert peak["python"] < MB, peak
    refused = parsed[2]
    assert isinstance(refused, RankOutput) and (refused.request_id, refused.user_id) == ("row-3", 77)
    assert refused.error == (f"the row's strings take {50 << 20:,} bytes (request_id: {50 << 20:,}), over the "
                             f"{1 << 20:,} that a row may hold (gr_engine.row_bounds.MAX_STRING_BYTES); "
                             f"refused without reading them; request_id begins {'r' * 60!r}")
    assert parsed[:2] + parsed[3:] == requests[:2] + requests[3:]


def table_file(tmp_path, name, **columns):
    pq.write_table(pa.table(columns), tmp_path / name)
    return tmp_path / name


def test_string_bounds_count_every_string_of_the_row(tmp_path):
    """The bound is on all of a row's strings together, nested ones included; a row at the bound is read; an id
    over it is not read as a label (``row-N``, or no ``user_id``), one within it is."""
    history = {"item_ids": [[1]] * 4, "action_ids": [[1]] * 4, "timestamps": [[7]] * 4,
               "candidate_item_ids": [[2]] * 4}
    path = table_file(tmp_path, "ids.parquet", request_id=["ok", "x" * 101, "a" * 50, "big-user"],
                      user_id=["u" * 60, "v", "w" * 50, "z" * 101], **history)
    ok, long_id, at_bound, long_user = read_all(path, max_string_bytes=100)
    assert (ok.request_id, at_bound.request_id) == ("ok", "a" * 50)
    assert (long_id.request_id, long_id.user_id) == ("row-2", "v")
    assert long_id.error == ("the row's strings take 102 bytes (request_id: 101), over the 100 that a row may hold "
                             f"(gr_engine.row_bounds.MAX_STRING_BYTES); refused without reading them; request_id "
                             f"begins {'x' * 60!r}")
    assert (long_user.request_id, long_user.user_id) == ("big-user", None)
    assert long_user.error.startswith("the row's strings take 109 bytes (user_id: 101)")
    nested = table_file(tmp_path, "nested.parquet", request_id=["a", "b"], user_id=[1, 2],
                        item_ids=[["s" * 60, "t" * 60], ["s"]])
    refused, read = read_all(nested, max_string_bytes=100)
    assert refused.error.startswith("the row's strings take 121 bytes (item_ids: 120), over the 100")
    assert refused.error.endswith("refused without reading them") and refused.user_id == 1
    assert read.request_id == "b" and read.error.startswith("invalid request")  # read, and refused by msgspec
    unbounded = read_all(nested, max_string_bytes=None)
    assert [p.error.startswith("invalid request") for p in unbounded] == [True, True]


def test_lists_are_bounded_wherever_they_are_nested(tmp_path):
    """A list field's values are counted through structs and maps too, and an id holding lists is bounded by the
    longest list a valid request holds (a shorter one is read, and refused as a request)."""
    hidden = pa.StructArray.from_arrays([pa.array([list(range(300)), [1]])], names=["inner"])
    path = table_file(tmp_path, "struct.parquet", request_id=["a", "b"], user_id=[1, 2], item_ids=hidden)
    refused, read = read_all(path)
    assert refused.error.startswith("item_ids holds 300 values, over the 256 that any valid request holds")
    assert read.request_id == "b" and read.error.startswith("invalid request")
    ids = table_file(tmp_path, "ids.parquet", request_id=["a", "b"], user_id=[list(range(300)), [1]])
    refused, read = read_all(ids)
    assert (refused.request_id, refused.user_id) == ("a", None)
    assert refused.error == ("user_id holds 300 values, over the 256 of the longest list of any valid request "
                             "(gr_engine.io.max_list_lengths), where a valid request holds no list; refused without "
                             "reading the row's lists")
    assert read.error.startswith("invalid request: Expected `int | str`, got `array`")


def test_row_sizes_of_every_arrow_layout():
    """``row_bounds._sizes``: values of lists (nulls hold none, list views count what they show, dictionaries
    their values), bytes of strings and binaries of every layout, through structs, maps, chunks and extensions."""
    cases = {
        "list": (pa.array([[1, 2], None, []]), [2, 0, 0], [0, 0, 0]),
        "null list over values": (pa.ListArray.from_arrays(pa.array([0, 2, 5, 6]), pa.array(range(6)),
                                                           mask=pa.array([False, True, False])), [2, 0, 1], [0, 0, 0]),
        "sliced nested": (pa.array([[[1]], [[1, 2], [3]], [[4]]], pa.large_list(pa.list_(pa.int8()))).slice(1, 1),
                          [5], [0]),
        "fixed list": (pa.FixedSizeListArray.from_arrays(pa.array(["ab", "c", "d", "e"]), 2,
                                                         mask=pa.array([False, True])), [2, 0], [3, 0]),
        "list view": (pa.ListViewArray.from_arrays(pa.array([0, 1], pa.int32()), pa.array([3, 2], pa.int32()),
                                                   pa.array(["a", "bb", "ccc", "d"])), [3, 2], [6, 5]),
        "map": (pa.array([[("k", ["vv"])], None], pa.map_(pa.string(), pa.list_(pa.string()))), [2, 0], [3, 0]),
        "struct": (pa.StructArray.from_arrays([pa.array([[1, 2], [3]]), pa.array(["a", "bb"])], names=["x", "y"],
                                              mask=pa.array([False, True])), [2, 0], [1, 0]),
        "dictionary": (pa.array(["abc", None, "abc", "d"]).dictionary_encode(), [0, 0, 0, 0], [3, 0, 3, 1]),
        "string view": (pa.array(["héllo", None, "x" * 20], pa.string_view()).slice(1), [0, 0], [0, 20]),
        "binary": (pa.array([b"ab", None], pa.large_binary()), [0, 0], [2, 0]),
        "fixed binary": (pa.array([b"abc", None], pa.binary(3)), [0, 0], [3, 0]),
        "chunked": (pa.chunked_array([pa.array(["a"]), pa.array(["bc", None])]), [0, 0, 0], [1, 2, 0]),
        "extension": (pa.ExtensionArray.from_storage(pa.json_(), pa.array(['{"a": 1}', None])), [0, 0], [8, 0]),
        "sliced dictionary": (pa.array(["abc", "d", "ef"]).dictionary_encode().slice(1), [0, 0], [1, 2]),
        "ints": (pa.array([1, None]), [0, 0], [0, 0]),
    }
    from gr_engine.row_bounds import _sizes

    for name, (array, values, size) in cases.items():
        got = _sizes(array)
        assert (got[0].tolist(), got[1].tolist()) == (values, size), name
