"""Reading requests from and writing outputs to JSONL and Parquet files (offline ranking and retrieval).

One request per line (JSONL) or row (Parquet), with the fields of :class:`~gr_engine.request.RankRequest` (or
:class:`~gr_engine.request.GenerateRequest`). A malformed row becomes an output in its place whose ``error`` says why,
with the row's ``request_id`` and ``user_id`` where readable; without a ``request_id`` it is labelled ``line-N``
(JSONL, 1-based; blank lines skipped but counted) or ``row-N`` (Parquet, 1-based).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from .outputs import GenerateOutput, RankOutput, output_user_id
from .request import GenerateRequest, RankRequest

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


def file_format(path: str | Path) -> str:
    """``"jsonl"`` or ``"parquet"`` from the file extension. Call it on a job's input and output before any work
    starts: it raises ``ValueError`` for an unknown extension, ``ImportError`` for Parquet without pyarrow."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot tell the format of {path}: use one of {', '.join(sorted(FORMATS))}")
    if FORMATS[suffix] == "parquet":
        _pyarrow()
    return FORMATS[suffix]


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise ImportError("Parquet files need pyarrow: pip install 'gr-engine[io]'") from exc
    return pyarrow


def _read_rows(path: Path) -> list[tuple[str, Any]]:
    """``(label, row)`` of every row of ``path``, labelled as the module docstring says; a line that is not JSON
    comes back as a ``ValueError`` instead of a row."""
    if file_format(path) == "parquet":
        table = _pyarrow().parquet.read_table(path).to_pylist()
        return [(f"row-{number}", row) for number, row in enumerate(table, start=1)]
    rows: list[tuple[str, Any]] = []
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"line-{number}", msgspec.json.decode(line)))
            except msgspec.DecodeError as exc:
                rows.append((f"line-{number}", ValueError(f"line {number} is not valid JSON: {exc}")))
    return rows


def read_requests(path: str | Path, request_type: type[GenerateRequest] = RankRequest,
                  ) -> list[GenerateRequest | RankOutput | GenerateOutput]:
    """Parse a request file; rows that are not valid requests come back as failed outputs, in their place.

    Args:
        path: a ``.jsonl``/``.json``/``.ndjson`` or ``.parquet`` file.
        request_type: :class:`RankRequest` (rows need candidates; failed rows are :class:`RankOutput`s) or
            :class:`GenerateRequest` (other fields, such as candidates, are ignored; failed rows are
            :class:`GenerateOutput`s).
    """
    failed = RankOutput if issubclass(request_type, RankRequest) else GenerateOutput
    parsed: list[GenerateRequest | RankOutput | GenerateOutput] = []
    for label, row in _read_rows(Path(path)):
        if isinstance(row, Exception):
            parsed.append(failed(request_id=label, error=str(row)))
            continue
        try:
            parsed.append(msgspec.convert(row, request_type))
        except msgspec.ValidationError as exc:
            fields = row if isinstance(row, dict) else {}
            request_id = fields.get("request_id")
            parsed.append(failed(
                request_id=str(request_id) if request_id is not None else label,
                user_id=output_user_id(fields.get("user_id")),
                error=f"invalid request: {exc}",
            ))
    return parsed


def write_outputs(path: str | Path, outputs: Sequence[RankOutput | GenerateOutput]) -> None:
    """Write outputs as JSONL (one object per line) or Parquet, by ``path``'s extension."""
    path = Path(path)
    rows = msgspec.to_builtins(outputs, enc_hook=array_as_lists)
    if file_format(path) == "jsonl":
        encoder = msgspec.json.Encoder()
        with path.open("wb") as f:
            for row in rows:
                f.write(encoder.encode(row) + b"\n")
        return
    pa = _pyarrow()
    if len({type(r["user_id"]) for r in rows if r["user_id"] is not None}) > 1:
        for r in rows:  # a Parquet column has one type: mixed int/str user ids become strings
            r["user_id"] = None if r["user_id"] is None else str(r["user_id"])
    pa.parquet.write_table(pa.Table.from_pylist(rows), path)


def array_as_lists(value: object) -> object:
    """``msgspec.to_builtins`` hook: numpy arrays (ranking scores) as nested lists; any other type is an error."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"write_outputs cannot write a {type(value).__name__}")
