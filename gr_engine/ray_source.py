"""Request files (JSONL and Parquet) as a Ray Data dataset of *wire rows*, the rows that
:func:`~gr_engine.ray_ranking.rank_dataset` partitions by user and serves (``gr-engine rank --workers``).

A wire row holds one input row, undecoded into request fields, so that one Arrow schema fits every row, malformed
ones included (a column of Arrow has one type; a bad row's ``user_id`` may be a list):

=============  ==========  ================================================================================
column         type        meaning
=============  ==========  ================================================================================
``row_order``  int64       the row's place in the input: ``file_index << ROW_BITS | row_number`` (files in
                           sorted path order, rows 1-based in each file, JSONL blank lines counted)
``label``      string      the failed output's ``request_id`` when the row has none: ``line-N`` / ``row-N``
                           as in single-process jobs, prefixed by ``file name:`` when there are several files
``user_hash``  uint64      :func:`~gr_engine.routing.stable_hash` of the row's ``user_id``; null without a
                           valid one (such a row fails to parse anyway)
``request``    binary      the decoded row as msgpack (:func:`encode_request`; null when it could not be
                           decoded; of a Parquet row, only its request fields' columns); for a row refused
                           unread, only its ``request_id`` and ``user_id``
``error``      string      why the row could not be decoded (JSON syntax, a type msgpack cannot hold) or was
                           refused unread (a Parquet list or strings over their bounds:
                           :class:`~gr_engine.row_bounds.RefusedRow`)
=============  ==========  ================================================================================

msgpack has no integers beyond 64 bits (outside ``[-2**63, 2**64)``), which JSON rows (and Python rows) may hold,
e.g. a ``user_id`` of ``2**70``: such an int travels as a msgpack extension of its decimal digits
(:data:`BIG_INT_EXT`) and :func:`decode_request` gives it back, so that the engine refuses the request as in a single
process (``validation.parse_fields``), with its ``request_id`` and ``user_id``.

Ray's ``read_json`` fails the whole read on one bad line and neither it nor ``read_parquet`` numbers rows, so the
files are read here, each by one read task, in file order, a chunk of :data:`~gr_engine.io.CHUNK_ROWS` rows at a
time (bounded memory per task, as in single-process jobs). Parsing into requests (:func:`~gr_engine.io.parse_row`)
happens in the engine workers, exactly as single-process.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import PurePath
from typing import Any

import msgspec
import pyarrow as pa
from ray.data.datasource import FileBasedDatasource

from .io import CHUNK_ROWS, FORMATS, jsonl_rows, open_parquet, parquet_rows
from .outputs import output_user_id
from .request import GenerateRequest, RankRequest
from .routing import stable_hash
from .row_bounds import MAX_STRING_BYTES, RefusedRow

#: Bits of ``row_order`` that number the rows of one file (up to 2**40 rows a file, 2**23 files).
ROW_BITS = 40

WIRE_SCHEMA = pa.schema([("row_order", pa.int64()), ("label", pa.string()), ("user_hash", pa.uint64()),
                         ("request", pa.binary()), ("error", pa.string())])

#: msgpack extension code of an int outside msgpack's range in a wire row's ``request``: its decimal digits (ASCII).
BIG_INT_EXT = 1

_MSGPACK_INTS = (-(1 << 63), (1 << 64) - 1)  # the ints msgpack holds

_encoder = msgspec.msgpack.Encoder()


def _big_int(code: int, data: memoryview) -> int:
    if code != BIG_INT_EXT:
        raise ValueError(f"unknown msgpack extension {code} in a wire row")
    return int(bytes(data))


_decoder = msgspec.msgpack.Decoder(ext_hook=_big_int)


def encode_request(row: Any) -> bytes:
    """A decoded row (JSON values, or a Parquet row's) as a wire row's ``request``: msgpack, with any int beyond
    64 bits as a :data:`BIG_INT_EXT`. Raises ``TypeError`` for a value msgpack has no form for."""
    try:
        return _encoder.encode(row)
    except OverflowError:  # an int beyond 64 bits: rare, so only then is the row copied
        return _encoder.encode(_big_ints_as_ext(row))


def decode_request(data: bytes) -> Any:
    """The row :func:`encode_request` encoded, ints beyond 64 bits included."""
    return _decoder.decode(data)


def wire_row(request: bytes | None, error: str | None) -> Any:
    """The row a wire row's ``request`` and ``error`` hold, for :func:`~gr_engine.io.parse_row`: the decoded row,
    the ``ValueError`` of one that could not be decoded, or the :class:`~gr_engine.row_bounds.RefusedRow` of one refused
    unread, with its labels."""
    if error is None:
        return decode_request(request)
    if request is None:
        return ValueError(error)
    return RefusedRow(error, **decode_request(request))


def _big_ints_as_ext(row: Any) -> Any:
    """A copy of ``row`` with each int outside msgpack's range as a :data:`BIG_INT_EXT` (lists and tuples copied as
    lists, dicts as dicts; dict keys as they are). Iterative: a row may be nested as deeply as the decoder allows."""
    low, high = _MSGPACK_INTS
    root = [row]
    stack: list[Any] = [root]  # copies whose items are still to convert
    while stack:
        container = stack.pop()
        for key in container.keys() if isinstance(container, dict) else range(len(container)):
            value = container[key]
            if isinstance(value, int) and not low <= value <= high:
                container[key] = msgspec.msgpack.Ext(BIG_INT_EXT, str(value).encode())
            elif isinstance(value, (list, tuple, dict)):
                container[key] = copy = dict(value) if isinstance(value, dict) else list(value)
                stack.append(copy)
    return root[0]


def wire_table(rows: Iterable[tuple[int, str, Any]]) -> pa.Table:
    """Wire rows (:data:`WIRE_SCHEMA`) of ``(row_order, label, decoded row, the ValueError of an undecodable
    one or the RefusedRow of one refused unread)`` triples."""
    columns: dict[str, list[Any]] = {name: [] for name in WIRE_SCHEMA.names}
    for order, label, row in rows:
        request = error = user_hash = None
        if isinstance(row, RefusedRow):  # its labels as its request, beside its error (wire_row)
            error = str(row)
            request = encode_request({"request_id": row.request_id, "user_id": row.user_id})
            user_hash = None if row.user_id is None else stable_hash(row.user_id)
        elif isinstance(row, Exception):
            error = str(row)
        else:
            try:
                request = encode_request(row)
            except (TypeError, OverflowError, ValueError) as exc:  # e.g. a type msgpack has no form for
                error = f"invalid request: {exc}"
            user_id = output_user_id(row.get("user_id")) if isinstance(row, dict) else None
            user_hash = None if user_id is None else stable_hash(user_id)
        for name, value in zip(WIRE_SCHEMA.names, (order, label, user_hash, request, error)):
            columns[name].append(value)
    return pa.Table.from_pydict(columns, schema=WIRE_SCHEMA)


class RequestFilesDatasource(FileBasedDatasource):
    """The request files under ``paths`` (files or folders; only ``.jsonl``/``.json``/``.ndjson`` and
    ``.parquet``/``.pq`` names are read, names starting with ``_`` or ``.`` are skipped, as Ray lists folders) as
    wire rows. Use it with ``ray.data.read_datasource``; keyword arguments go to Ray's ``FileBasedDatasource``
    (e.g. ``filesystem``). JSONL lines over ``max_line_bytes`` are refused unread, as in single-process jobs
    (:func:`~gr_engine.io.jsonl_rows`; the engine's bound is :func:`~gr_engine.io.max_line_bytes` of its config).
    Of Parquet files only the columns of ``request_type``'s fields are read, and rows with a list longer than
    ``max_list_lengths`` gives it (the engine's bound is :func:`~gr_engine.io.max_list_lengths` of its config) or
    strings of more than ``max_string_bytes`` bytes are refused unread (:func:`~gr_engine.io.parquet_rows`)."""

    def __init__(self, paths: str | list[str], max_line_bytes: int | None = None,
                 max_list_lengths: Mapping[str, int] | None = None, *,
                 request_type: type[GenerateRequest] = RankRequest, max_string_bytes: int | None = MAX_STRING_BYTES,
                 **file_args: Any) -> None:
        super().__init__(paths, file_extensions=[ext.lstrip(".") for ext in FORMATS], **file_args)
        self._max_line_bytes = max_line_bytes
        self._max_list_lengths = max_list_lengths
        self._fields = request_type.__struct_fields__
        self._max_string_bytes = max_string_bytes
        files = sorted(self._paths())
        if len(files) >= 1 << (63 - ROW_BITS):
            raise ValueError(f"{len(files)} input files: at most {(1 << (63 - ROW_BITS)) - 1} can be ranked at once")
        self._file_index = {path: index for index, path in enumerate(files)}
        self._named = len(files) > 1

    def _open_input_source(self, filesystem: Any, path: str, **open_args: Any) -> Any:
        if _format(path) == "parquet":  # Parquet needs random access (its footer first), not a stream
            return filesystem.open_input_file(path)
        return super()._open_input_source(filesystem, path, **open_args)

    def _read_stream(self, f: Any, path: str) -> Iterator[pa.Table]:
        base = self._file_index[path] << ROW_BITS
        prefix = f"{PurePath(path).name}:" if self._named else ""
        if _format(path) == "parquet":
            kind, rows = "row", _parquet_rows(f, self._fields, self._max_list_lengths, self._max_string_bytes)
        else:
            kind, rows = "line", jsonl_rows(f, self._max_line_bytes)
        chunk: list[tuple[int, str, Any]] = []
        for number, row in rows:
            if number >= 1 << ROW_BITS:
                raise ValueError(f"{path} has more than {(1 << ROW_BITS) - 1} rows")
            chunk.append((base | number, f"{prefix}{kind}-{number}", row))
            if len(chunk) == CHUNK_ROWS:
                yield wire_table(chunk)
                chunk = []
        if chunk:
            yield wire_table(chunk)


def _format(path: str) -> str:
    return FORMATS[PurePath(path).suffix.lower()]


def _parquet_rows(f: Any, fields: Collection[str], max_list_lengths: Mapping[str, int] | None,
                  max_string_bytes: int | None) -> Iterator[tuple[int, Any]]:
    """``(1-based row number, row)`` of a Parquet file, a buffer of columns at a time, as single-process jobs read
    them (:func:`~gr_engine.io.parquet_rows`)."""
    with open_parquet(f) as source:
        yield from parquet_rows(source, fields, max_list_lengths, max_string_bytes, CHUNK_ROWS)
