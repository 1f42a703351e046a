"""Writing outputs to JSONL and Parquet files, chunk by chunk (``gr-engine rank`` / ``generate``): rows in the order
written, each output's fields as columns (Parquet) or keys (JSONL), ranking scores as nested lists."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from .io import file_format, import_pyarrow, open_parquet
from .outputs import GenerateOutput, RankOutput, StepTimings

Output = RankOutput | GenerateOutput

#: Rows per Parquet row group written. Each row group adds an entry per column to the footer, which the writer holds
#: until it closes: row groups of one chunk would grow it by megabytes per million rows. 4,096 ranking outputs of
#: 128 candidates and 8 tasks are 16 MB of scores.
ROW_GROUP_ROWS = 4096


class OutputWriter:
    """Appends outputs to a JSONL or Parquet file (by ``path``'s extension), in the order written.

    JSONL: one object per output; each :meth:`write` reaches the file before it returns. Parquet: one fixed schema
    for ``output_type`` (scores float32, as the engine computes them; ``item_ids`` int64), in row groups of
    :data:`ROW_GROUP_ROWS` (the last may be shorter). A Parquet column has one type, so ``user_id`` is int64 while
    every user id written is an int that fits, and string once any is not: the first string id turns the column
    into strings, rewriting the rows already written once (a row group at a time). The file is the same however its
    outputs were chunked: integer ids if all were integers, else all as strings.

    Close it (or use it as a context manager) to finish the file; what was written before an error is kept.

    Args:
        path: the output file (created or truncated here). A symbolic link is written through: its target is the
            file written (and renamed, and deleted: see ``_user_ids_as_strings``), the link stays.
        output_type: :class:`RankOutput` or :class:`GenerateOutput`, the Parquet schema's columns.
    """

    def __init__(self, path: str | Path, output_type: type[Output]) -> None:
        self.path = Path(path)
        self.format = file_format(self.path)
        self.output_type = output_type
        # Deleting or renaming a link acts on the link: the file itself is written (and beside it, a rewrite's copy).
        self._file = Path(os.path.realpath(self.path))
        if self.format == "jsonl":
            self._encoder = msgspec.json.Encoder(enc_hook=array_as_lists)
            self._jsonl = self._file.open("wb")
            return
        self._pa = import_pyarrow()
        self._user_ids = self._pa.int64()
        self._pending: list[Any] = []  # pyarrow Tables of the row group being gathered
        self._pending_rows = 0
        # Opened (and an old file truncated) now, as a JSONL file is: a path that cannot be written fails before any
        # request is served, not at the first row group (4,096 rows later) or at the end of a shorter job.
        self._writer = self._new_writer()

    def write(self, outputs: Sequence[Output]) -> None:
        """Append ``outputs`` (of ``output_type``) after those written before."""
        if self.format == "jsonl":
            self._jsonl.write(self._encoder.encode_lines(outputs))
            self._jsonl.flush()
            return
        rows = msgspec.to_builtins(outputs, enc_hook=array_as_lists)
        if self._user_ids == self._pa.int64() and any(_not_int64(row["user_id"]) for row in rows):
            self._user_ids_as_strings()
        if self._user_ids == self._pa.string():
            for row in rows:
                row["user_id"] = None if row["user_id"] is None else str(row["user_id"])
        self._pending.append(self._pa.Table.from_pylist(rows, schema=self._schema()))
        self._pending_rows += len(rows)
        if self._pending_rows >= ROW_GROUP_ROWS:
            self._flush()

    def close(self) -> None:
        """Write what is pending and finish the file (an empty Parquet file still has its schema)."""
        if self.format == "jsonl":
            self._jsonl.close()
            return
        self._flush()
        if self._writer is None:
            self._writer = self._new_writer()
        self._writer.close()

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _new_writer(self) -> Any:
        """A ``ParquetWriter`` of the output file that stores each page's CRC, which readers can check
        (:func:`~gr_engine.io.open_parquet`)."""
        return self._pa.parquet.ParquetWriter(self._file, self._schema(), write_page_checksum=True)

    def _schema(self) -> Any:
        return output_schema(self.output_type, self._user_ids)

    def _flush(self) -> None:
        if self._pending:
            self._write_group(self._pa.concat_tables(self._pending))
            self._pending, self._pending_rows = [], 0

    def _write_group(self, table: Any) -> None:
        if self._writer is None:
            self._writer = self._new_writer()
        self._writer.write_table(table, row_group_size=len(table))

    def _user_ids_as_strings(self) -> None:
        """Turn the user_id column into strings: in the pending tables and in the row groups already written."""
        self._user_ids = self._pa.string()
        self._pending = [table.cast(self._schema()) for table in self._pending]
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        written = self._file.with_name(self._file.name + ".int-user-ids")
        os.replace(self._file, written)
        with open_parquet(written) as source:
            for group in range(source.num_row_groups):
                self._write_group(source.read_row_group(group).cast(self._schema()))
        written.unlink()  # only once copied: should the copy fail, the rows are still there


def output_schema(output_type: type[Output], user_ids: Any) -> Any:
    """The ``pyarrow`` schema of ``output_type``'s fields (scores float32, ``item_ids`` int64), with ``user_ids``
    (``pyarrow.int64()`` or ``pyarrow.string()``) as the ``user_id`` column's type."""
    pa = import_pyarrow()
    types = {
        "request_id": pa.string(), "user_id": user_ids, "num_gpu_cached_tokens": pa.int64(),
        "num_host_cached_tokens": pa.int64(), "num_computed_tokens": pa.int64(),
        "timings": pa.struct([(name, pa.float64()) for name in StepTimings.__struct_fields__]),
        "latency_s": pa.float64(), "error": pa.string(), "item_ids": pa.list_(pa.int64()),
        "scores": pa.list_(pa.list_(pa.float32()) if issubclass(output_type, RankOutput) else pa.float32()),
    }
    return pa.schema([(name, types[name]) for name in output_type.__struct_fields__])


def _not_int64(user_id: object) -> bool:
    """Whether ``user_id`` (an output's: int, str or None) cannot go in an int64 column."""
    return isinstance(user_id, str) or (user_id is not None and not -2**63 <= user_id < 2**63)


def array_as_lists(value: object) -> object:
    """``msgspec`` encoding hook: numpy arrays (ranking scores) as nested lists; any other type is an error."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot write a {type(value).__name__}")
