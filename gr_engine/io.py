"""Reading requests from JSONL and Parquet files, a chunk of rows at a time (offline ranking and retrieval in bounded
memory: ``gr-engine rank`` / ``generate``).

One request per line (JSONL) or row (Parquet), with the fields of :class:`~gr_engine.request.RankRequest` (or
:class:`~gr_engine.request.GenerateRequest`). A malformed row becomes an output in its place whose ``error`` says why,
with the row's ``request_id`` and ``user_id`` where readable; without a ``request_id`` it is labelled ``line-N``
(JSONL, 1-based; blank lines skipped but counted) or ``row-N`` (Parquet, 1-based). A JSONL line longer than any valid
request can be (:func:`max_line_bytes`) is such an error without being decoded, or even held whole: its
``request_id`` and ``user_id`` label it only where they are top-level keys within its first :data:`LABEL_SCAN_BYTES`
(:mod:`gr_engine.json_labels`), else it is ``line-N``. Of a Parquet file only the columns of the request's fields
are read (the request ignores others), and a row is such an error, never made Python objects, when a list holds more
values than any valid request's (:func:`max_list_lengths`) or its strings more bytes than
:data:`~gr_engine.row_bounds.MAX_STRING_BYTES` (:mod:`gr_engine.row_bounds`); its ``request_id`` and ``user_id``
label it, unless too long to read; a Parquet row group that cannot be read (a damaged page) fails its unread rows, and
the next group is read (:func:`parquet_rows`).

:class:`RequestReader` yields chunks of at most :data:`CHUNK_ROWS` rows, and
:class:`~gr_engine.output_writer.OutputWriter` appends each chunk's outputs: a job that reads a chunk, serves it and
writes it before reading the next holds one chunk of requests.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import msgspec

from .json_labels import overlong_labels
from .outputs import GenerateOutput, RankOutput, output_user_id
from .request import GenerateParams, GenerateRequest, RankRequest
from .row_bounds import LIST_LIMITS, MAX_STRING_BYTES, RefusedRow, bounded_rows

if TYPE_CHECKING:
    from .config import EngineConfig
    from .engine import GREngine

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}

#: Rows per chunk. A request of 4,096 events (the default ``model.max_history_len``) holds about 350 KB of Python
#: ints, so a chunk of the longest histories is about 90 MB (typical ones: tens of MB; a Parquet chunk's decoded rows
#: are held too while it is parsed). 256 rows are 32 full steps of the default scheduler (``max_num_seqs=8``): the
#: partly filled steps at a chunk's end are few (on CPU, 3,000 requests run as fast in chunks of 256 as at once).
CHUNK_ROWS = 256

#: Bytes pyarrow reads of a Parquet column at a time. Without a buffer (and with its pre-buffering) pyarrow reads and
#: decodes a whole row group, which another tool may have written with millions of rows.
PARQUET_READ_BUFFER = 1 << 20

#: Bytes of a JSONL file read at a time.
READ_BYTES = 1 << 20

#: The most bytes an int of a valid request takes in JSON, with its separator: 20 characters (-2**63 and 2**64 - 1
#: have 20) and ", ".
INT_BYTES = 22

#: Bytes a valid request's line may take besides its ints: its ``request_id``, ``user_id``, keys, brackets,
#: whitespace and any fields the request does not have (ignored when parsed, but read). A Parquet row's strings have
#: the same bound (:data:`~gr_engine.row_bounds.MAX_STRING_BYTES`).
ROW_SLACK_BYTES = 1 << 20

Parsed = GenerateRequest | RankOutput | GenerateOutput
Output = RankOutput | GenerateOutput
_UTF8_BOM = b"\xef\xbb\xbf"


def file_format(path: str | Path) -> str:
    """``"jsonl"`` or ``"parquet"`` from the file extension. Call it on a job's input and output before any work
    starts: it raises ``ValueError`` for an unknown extension, ``ImportError`` for Parquet without pyarrow."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot tell the format of {path}: use one of {', '.join(sorted(FORMATS))}")
    if FORMATS[suffix] == "parquet":
        import_pyarrow()
    return FORMATS[suffix]


def max_line_bytes(config: EngineConfig) -> int:
    """The longest JSONL line (in bytes, its newline not counted) of a request that ``config``'s engine could serve:
    ``3 * model.max_history_len`` history ints and ``model.max_candidates`` candidates of :data:`INT_BYTES` each,
    plus :data:`ROW_SLACK_BYTES`. A longer line is refused unread (:func:`jsonl_rows`): however it is written, it
    holds too many ints, or ints padded with whitespace, or a megabyte of other fields."""
    model = config.model
    return (3 * model.max_history_len + model.max_candidates) * INT_BYTES + ROW_SLACK_BYTES


def max_list_lengths(config: EngineConfig, ranking: bool = True) -> dict[str, int]:
    """The most values each list field of a request that ``config``'s engine could serve holds
    (:data:`~gr_engine.row_bounds.LIST_LIMITS`): ``model.max_history_len`` for ``item_ids``, ``action_ids`` and
    ``timestamps``, ``model.max_candidates`` for ``candidate_item_ids`` (only when ``ranking``: retrieval ignores
    candidates, however many). A Parquet row with a longer list is refused before its lists are read
    (:func:`parquet_rows`), and so is one whose ``request_id`` or ``user_id`` holds more values than the largest of
    these (:func:`~gr_engine.row_bounds.bounded_rows`)."""
    model = config.model
    return {field: getattr(model, limit) for field, limit in LIST_LIMITS.items()
            if ranking or limit != "max_candidates"}


def import_pyarrow() -> ModuleType:
    """The ``pyarrow`` module with ``pyarrow.parquet`` loaded; ``ImportError`` saying how to install it."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise ImportError("Parquet files need pyarrow: pip install 'gr-engine[io]'") from exc
    return pyarrow


class RequestReader:
    """The rows of a request file, parsed, in chunks of at most :data:`CHUNK_ROWS` rows, in file order.

    The file is opened here (a missing file fails before any work); iterate once. Each chunk is a list of
    requests of ``request_type`` and, in the places of rows that are not valid requests, failed outputs
    (:class:`RankOutput` for ranking requests, :class:`GenerateOutput` for retrieval). A chunk is parsed only when
    the iteration asks for it.

    Args:
        path: a ``.jsonl``/``.json``/``.ndjson`` or ``.parquet``/``.pq`` file.
        request_type: :class:`RankRequest` (rows need candidates) or :class:`GenerateRequest` (other fields, such
            as candidates, are ignored: Parquet columns of other names are not read).
        max_line_bytes: JSONL lines longer than this (bytes) are refused unread (:func:`jsonl_rows`); the engine's
            bound is :func:`max_line_bytes` of its config. ``None``: no bound (a line is held and decoded whole).
        max_list_lengths: Parquet rows with a list column of these names holding more values than this gives it are
            refused without reading their lists (:func:`parquet_rows`); the engine's bound is
            :func:`max_list_lengths` of its config. ``None``: no bound (every row is converted whole).
        max_string_bytes: Parquet rows whose strings take more bytes than this (all their columns together) are
            refused without reading them (:func:`parquet_rows`); by default
            :data:`~gr_engine.row_bounds.MAX_STRING_BYTES` (1 MiB). ``None``: no bound.

    Attributes:
        num_rows: rows in the file (Parquet, from its metadata), or ``None`` (JSONL: unknown until read).
    """

    def __init__(self, path: str | Path, request_type: type[GenerateRequest] = RankRequest,
                 max_line_bytes: int | None = None, max_list_lengths: Mapping[str, int] | None = None,
                 max_string_bytes: int | None = MAX_STRING_BYTES) -> None:
        self.path = Path(path)
        self.format = file_format(self.path)
        self.request_type = request_type
        self.max_line_bytes = max_line_bytes
        self.max_list_lengths = max_list_lengths
        self.max_string_bytes = max_string_bytes
        self.num_rows: int | None = None
        if self.format == "parquet":
            try:
                self._parquet = open_parquet(self.path)
            except (OSError, import_pyarrow().ArrowException) as exc:  # not Parquet, or its footer is damaged
                raise ValueError(f"cannot read {self.path} as Parquet: {exc}") from exc
            self.num_rows = self._parquet.metadata.num_rows
        else:
            self._jsonl = self.path.open("rb")

    def __iter__(self) -> Iterator[list[Parsed]]:
        rows = CHUNK_ROWS
        chunk: list[Parsed] = []
        for label, row in self._parquet_rows(rows) if self.format == "parquet" else self._jsonl_rows():
            chunk.append(parse_row(label, row, self.request_type))
            if len(chunk) == rows:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    def _parquet_rows(self, batch_rows: int) -> Iterator[tuple[str, Any]]:
        for number, row in parquet_rows(self._parquet, self.request_type.__struct_fields__, self.max_list_lengths,
                                        self.max_string_bytes, batch_rows):
            yield f"row-{number}", row

    def _jsonl_rows(self) -> Iterator[tuple[str, Any]]:
        for number, row in jsonl_rows(self._jsonl, self.max_line_bytes):
            yield f"line-{number}", row

    def close(self) -> None:
        """Close the file."""
        (self._parquet if self.format == "parquet" else self._jsonl).close()

    def __enter__(self) -> RequestReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def jsonl_rows(f: Any, max_bytes: int | None) -> Iterator[tuple[int, Any]]:
    """``(1-based line number, row)`` of each non-blank line of the binary stream ``f`` (anything with
    ``read(n)``), split at ``\\n`` as Python's binary files split lines. The row is :func:`decode_line`'s (the
    decoded line or a ``ValueError``); for a line over ``max_bytes`` bytes (newline not counted), a
    :class:`~gr_engine.row_bounds.RefusedRow` saying so, quoting the line's first bytes and labelled by the
    ``request_id`` and ``user_id`` that :func:`~gr_engine.json_labels.overlong_labels` finds in its first
    :data:`LABEL_SCAN_BYTES`: such a line is neither decoded nor held whole (its first ``max_bytes`` bytes only,
    while it is read, then its first :data:`LABEL_SCAN_BYTES`), so memory stays within ``max_bytes`` plus
    :data:`READ_BYTES` (and :data:`LABEL_SCAN_BYTES`) whatever its length.
    ``max_bytes`` ``None``: no bound. A UTF-8 byte-order mark that begins the stream is skipped: line 1 is what
    follows it (blank, if only whitespace does); a UTF-16 or UTF-32 one raises ``ValueError`` (JSONL is UTF-8)."""
    number = size = 0  # size: bytes of the line being read, so far
    pieces: list[bytes] = []  # its bytes, while they are at most max_bytes
    head: bytearray | None = None  # once it is over max_bytes: its first LABEL_SCAN_BYTES bytes
    blank = True  # whether it is whitespace so far
    block = _without_bom(f) or f.read(READ_BYTES)
    while block:
        parts = block.split(b"\n")
        for at, part in enumerate(parts, start=1 - len(parts)):  # the last part (at 0) is a line still open
            size += len(part)
            blank = blank and (not part or part.isspace())
            if head is not None:
                head += part[:LABEL_SCAN_BYTES - len(head)]
            elif max_bytes is None or size <= max_bytes:
                pieces.append(part)
            else:  # over the bound: from now on only the line's beginning is kept
                head, pieces = _beginning([*pieces, part]), []
            if at:
                number += 1
                if not blank:
                    yield number, _line_row(number, pieces, head, size, max_bytes)
                size, pieces, head, blank = 0, [], None, True
        block = f.read(READ_BYTES)
    if size and not blank:
        yield number + 1, _line_row(number + 1, pieces, head, size, max_bytes)


def _without_bom(f: Any) -> bytes:
    """The first bytes of the stream ``f``, up to three, less a UTF-8 byte-order mark."""
    start = b""
    while len(start) < len(_UTF8_BOM) and (more := f.read(len(_UTF8_BOM) - len(start))):
        start += more
    if start[:2] in (b"\xff\xfe", b"\xfe\xff"):  # UTF-16's byte-order marks (UTF-32's begin with one too)
        raise ValueError("the file is UTF-16 or UTF-32 (its first bytes are a byte-order mark): JSONL is UTF-8, "
                         "re-encode it (e.g. iconv -f UTF-16 -t UTF-8)")
    return b"" if start == _UTF8_BOM else start


#: Bytes of an overlong line quoted in its error.
_HEAD_BYTES = 60

#: Bytes at the start of a JSONL line over :func:`max_line_bytes` in which its ``request_id`` and ``user_id`` are
#: looked for (:func:`~gr_engine.json_labels.overlong_labels`): writers put them before the long lists (as
#: ``RankRequest``'s fields are ordered), and this is the most held of such a line once it is over the bound.
LABEL_SCAN_BYTES = 64 << 10


def _beginning(pieces: list[bytes]) -> bytearray:
    """The first :data:`LABEL_SCAN_BYTES` of the bytes of ``pieces``."""
    head = bytearray()
    for piece in pieces:
        head += piece[:LABEL_SCAN_BYTES - len(head)]
    return head


def _line_row(number: int, pieces: list[bytes], head: bytearray | None, size: int, max_bytes: int | None) -> Any:
    if head is None:
        return decode_line(number, pieces[0] if len(pieces) == 1 else b"".join(pieces))
    begins = bytes(head[:_HEAD_BYTES]).decode("utf-8", "replace")
    complete = size == len(head)  # a line over a bound shorter than LABEL_SCAN_BYTES (in tests)
    return RefusedRow(f"line {number} is {size:,} bytes long, over the {max_bytes:,} bytes that any valid request "
                      "takes (from model.max_history_len and model.max_candidates: gr_engine.io.max_line_bytes); "
                      f"refused without decoding it (its request_id and user_id are looked for in its first "
                      f"{LABEL_SCAN_BYTES:,} bytes only); it begins {begins!r}",
                      *overlong_labels(head, complete))


def parquet_rows(source: Any, fields: Collection[str], max_lengths: Mapping[str, int] | None,
                 max_string_bytes: int | None, batch_rows: int | None = None) -> Iterator[tuple[int, Any]]:
    """``(1-based row number, row)`` of each row of the ``pyarrow.parquet.ParquetFile`` ``source``, read
    ``batch_rows`` rows (default :data:`CHUNK_ROWS`) at a time, only its columns named in ``fields`` (a request's
    fields: it ignores others, so the file's other columns are not read, however large): the row as a dict of those
    columns, or a :class:`~gr_engine.row_bounds.RefusedRow` for a row that holds more than ``max_lengths`` (a list's
    values; ``None``: no bound) or ``max_string_bytes`` (bytes of strings; ``None``: no bound) allow
    (:func:`~gr_engine.row_bounds.bounded_rows`). Sizes are read from Arrow before any row is converted, so such a
    row never becomes Python objects (millions of list values would be hundreds of MB of ints, a 50 MB id 50 MB of
    string; in Arrow a value is its own bytes, held while its batch is read): only its ``request_id`` and
    ``user_id`` are read, to label it, where they are within ``max_string_bytes``. A row group that cannot be read
    (a damaged page: its CRC, compression or encoding; :func:`open_parquet`) gives a ``RefusedRow`` labelled by
    nothing (its failed output shows ``row-N``) for each of its rows not yet read, and the next group is read."""
    columns = [name for name in dict.fromkeys(source.schema_arrow.names) if name in fields]
    damaged = (OSError, import_pyarrow().ArrowException)
    number = 0
    for group in range(source.num_row_groups):
        end = number + source.metadata.row_group(group).num_rows  # the group's last row
        batches = source.iter_batches(batch_size=batch_rows or CHUNK_ROWS, row_groups=[group], columns=columns)
        why = f"it holds fewer rows than the file's metadata says ({end - number})"
        while True:
            try:
                batch = next(batches, None)
            except damaged as exc:
                why = str(exc)
                break
            if batch is None:
                break
            for row in bounded_rows(batch, max_lengths, max_string_bytes):
                number += 1
                yield number, row
        for lost in range(number + 1, end + 1):  # the group's rows not yet read fail; the next group is read
            yield lost, RefusedRow(f"row {lost} could not be read: row group {group} of the file is damaged ({why})",
                                   None, None)
        number = max(number, end)


def open_parquet(source: Any) -> Any:
    """The ``pyarrow.parquet.ParquetFile`` of ``source`` (a path or a random-access file) as file jobs read it: a
    buffer of :data:`PARQUET_READ_BUFFER` bytes of a column at a time, and each page checked against its CRC where
    the writer stored one (as :class:`~gr_engine.output_writer.OutputWriter` does), so that a damaged page fails
    (:func:`parquet_rows`) rather than giving other values."""
    return import_pyarrow().parquet.ParquetFile(source, buffer_size=PARQUET_READ_BUFFER, pre_buffer=False,
                                                page_checksum_verification=True)


def decode_line(number: int, line: bytes) -> Any:
    """JSONL line ``number`` (1-based) decoded, or a ``ValueError`` saying it is not valid JSON (for
    :func:`parse_row`); a byte-order mark that begins the file is not part of line 1 (:func:`jsonl_rows`)."""
    try:
        return msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        return ValueError(f"line {number} is not valid JSON: {exc}")
    except RecursionError:  # msgspec's answer to values nested thousands deep
        return ValueError(f"line {number} is not valid JSON: values nested too deeply")


def parse_row(label: str, row: Any, request_type: type[GenerateRequest]) -> Parsed:
    """A decoded row (or the ``ValueError`` of one that could not be decoded, or the
    :class:`~gr_engine.row_bounds.RefusedRow` of one refused unread) as a request of ``request_type``, or as a
    failed output labelled by its ``request_id`` or, without one, by ``label``."""
    failed = RankOutput if issubclass(request_type, RankRequest) else GenerateOutput
    if isinstance(row, RefusedRow):
        return failed(request_id=label if row.request_id is None else row.request_id, user_id=row.user_id,
                      error=str(row))
    if isinstance(row, Exception):
        return failed(request_id=label, error=str(row))
    try:
        return msgspec.convert(row, request_type)
    except msgspec.ValidationError as exc:
        fields = row if isinstance(row, dict) else {}
        request_id = fields.get("request_id")
        return failed(request_id=str(request_id) if request_id is not None else label,
                      user_id=output_user_id(fields.get("user_id")), error=f"invalid request: {exc}")


def serve_rows(engine: GREngine, parsed: list[Parsed], params: GenerateParams | None) -> list[Output]:
    """The outputs of a chunk of parsed rows (:class:`RequestReader`), in order: its requests ranked (``params``
    ``None``) or retrieved by ``engine`` in one call, its failed rows as they are. Rows that repeat a ``request_id``
    of the chunk are served too, under a stand-in id (the engine refuses a ``request_id`` already in flight) that
    their outputs do not show: a file's duplicates are served wherever they fall."""
    valid = [p for p in parsed if isinstance(p, GenerateRequest)]
    seen: set[str] = set()
    renamed: dict[int, str] = {}  # place in valid -> the request_id it was read with
    for i, request in enumerate(valid):
        if request.request_id in seen:
            renamed[i] = request.request_id
            stand_in = f"{request.request_id}#{i}"
            while stand_in in seen:
                stand_in += "#"
            valid[i] = msgspec.structs.replace(request, request_id=stand_in)
        seen.add(valid[i].request_id)
    served = engine.rank(valid, use_tqdm=False) if params is None else engine.generate(valid, params, use_tqdm=False)
    for i, request_id in renamed.items():
        served[i].request_id = request_id
    outputs = iter(served)
    return [next(outputs) if isinstance(p, GenerateRequest) else p for p in parsed]


def read_requests(path: str | Path, request_type: type[GenerateRequest] = RankRequest,
                  max_line_bytes: int | None = None, max_list_lengths: Mapping[str, int] | None = None,
                  max_string_bytes: int | None = MAX_STRING_BYTES) -> list[Parsed]:
    """Every row of a (small) request file at once, parsed as :class:`RequestReader` does."""
    with RequestReader(path, request_type, max_line_bytes, max_list_lengths, max_string_bytes) as reader:
        return [parsed for chunk in reader for parsed in chunk]
