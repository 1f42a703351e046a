"""Refusing the rows of an Arrow batch of request fields that hold more than any valid request, before they become
Python objects: the Parquet rows of file jobs (:func:`gr_engine.io.parquet_rows`, in one process and on Ray) and the
request columns of a Ray dataset (:func:`gr_engine.ray_ranking.rank_dataset`).

Each row is measured in Arrow (:func:`_sizes`): the values of its lists, those of lists nested in lists, structs and
maps included, and the bytes of its strings and binaries, nested ones included. Converting a row makes a Python object
of every value (an int is about 40 bytes, a string its bytes and about 50 more), so a row over a bound is refused in
its place: a :class:`RefusedRow` labelled by its ``request_id`` and ``user_id``, where these are no longer than the
string bound. The other rows of the batch are converted as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from .outputs import output_user_id

#: The ``config.model`` limit on each list field of a request. A longer list makes a request invalid
#: (``validation.parse_fields``): history fields longer than ``max_history_len`` are too long or differ in length;
#: candidates count for ranking only (retrieval ignores them).
LIST_LIMITS = {"item_ids": "max_history_len", "action_ids": "max_history_len", "timestamps": "max_history_len",
               "candidate_item_ids": "max_candidates"}

#: The most bytes of strings (and binaries) a row may hold, in UTF-8, all its fields together (its ``request_id``
#: and ``user_id``, and any strings in its lists). No request has a limit on its ids, so this is the megabyte a JSONL
#: line may take besides its ints (:data:`gr_engine.io.ROW_SLACK_BYTES`): a 256-row chunk of rows at the bound holds
#: 256 MiB of strings, as a chunk of JSONL lines of megabyte ids does.
MAX_STRING_BYTES = 1 << 20

#: Characters of an id over :data:`MAX_STRING_BYTES` that its row's error quotes.
QUOTED_CHARS = 60

_LABELS = ("request_id", "user_id")


class RefusedRow(ValueError):
    """A row refused before it was read whole (:func:`bounded_rows`, and a JSONL line over its bound:
    :func:`gr_engine.io.jsonl_rows`): the message says why; ``request_id`` and ``user_id`` are the labels read from
    it, as its failed output shows them (``None``: the row has none, or one that could not be read)."""

    def __init__(self, message: str, request_id: str | None, user_id: int | str | None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.user_id = user_id


def bounded_rows(batch: Any, max_lengths: Mapping[str, int] | None, max_string_bytes: int | None) -> list[Any]:
    """The rows of the Arrow ``batch`` (a ``RecordBatch`` or ``Table``) as dicts, as ``to_pylist`` makes them, but a
    :class:`RefusedRow` in the place of each row that holds more than this allows, which is never converted:

    * a column named in ``max_lengths`` holding more values than its bound there (lists' values, nested ones
      counted too);
    * a column not in :data:`LIST_LIMITS` (``request_id``, ``user_id``: no list in a valid request) holding more
      values than the largest bound of ``max_lengths`` (so that it costs no more than a list; a shorter one is
      converted, and the request refused when parsed);
    * more than ``max_string_bytes`` bytes of strings and binaries in all its columns together.

    ``max_lengths`` ``None``: no bound on values; ``max_string_bytes`` ``None``: none on strings."""
    refused = _refused(batch, max_lengths or {}, max_string_bytes)
    rows: list[Any] = []
    start = 0
    for end in [*sorted(refused), batch.num_rows]:  # the kept rows between refused ones, as zero-copy slices
        rows += batch.slice(start, end - start).to_pylist()
        if end in refused:
            rows.append(refused[end])
        start = end + 1
    return rows


def _pyarrow() -> ModuleType:
    """``pyarrow`` with ``pyarrow.compute`` loaded, imported when a batch is bounded: :mod:`gr_engine.io` imports this
    module, and needs pyarrow only for Parquet."""
    import pyarrow
    import pyarrow.compute

    return pyarrow


def _refused(batch: Any, max_lengths: Mapping[str, int], max_string_bytes: int | None) -> dict[int, RefusedRow]:
    """``{row index: its RefusedRow}`` of the rows of ``batch`` over a bound (:func:`bounded_rows`); a row over
    several is refused for the first: a list of ``max_lengths`` (in its order), an id, then its strings."""
    names = batch.schema.names
    sizes = [_sizes(batch.column(index)) for index in range(len(names))]
    longest = max(max_lengths.values(), default=None)
    checks = [(index, field, bound) for field, bound in max_lengths.items()
              for index in batch.schema.get_all_field_indices(field)]
    if longest is not None:
        checks += [(index, name, longest) for index, name in enumerate(names) if name not in LIST_LIMITS]
    reasons: dict[int, str] = {}
    for index, field, bound in checks:
        values = sizes[index][0]
        for i in np.flatnonzero(values > bound).tolist():
            reasons.setdefault(i, _too_many(field, int(values[i]), bound))
    if max_string_bytes is not None and names:
        by_column = np.stack([size for _, size in sizes])  # [columns, rows] bytes
        totals = by_column.sum(axis=0)
        for i in np.flatnonzero(totals > max_string_bytes).tolist():
            column = int(np.argmax(by_column[:, i]))
            reasons.setdefault(i, _too_long(batch.column(column).slice(i, 1), names[column], int(totals[i]),
                                            int(by_column[column, i]), max_string_bytes))
    return {i: RefusedRow(reason, *_labels(batch, i, max_string_bytes)) for i, reason in reasons.items()}


def _too_many(field: str, count: int, bound: int) -> str:
    if field in LIST_LIMITS:
        return (f"{field} holds {count:,} values, over the {bound:,} that any valid request holds (model."
                f"{LIST_LIMITS[field]}: gr_engine.io.max_list_lengths); refused without reading the row's lists")
    return (f"{field} holds {count:,} values, over the {bound:,} of the longest list of any valid request (gr_engine."
            "io.max_list_lengths), where a valid request holds no list; refused without reading the row's lists")


def _too_long(value: Any, field: str, total: int, size: int, bound: int) -> str:
    """Why a row is refused whose strings take ``total`` bytes, ``size`` of them in ``field``, whose value (a
    one-row Arrow array) is ``value``: quoting its beginning if it is a string or binary."""
    pa = _pyarrow()
    if pa.types.is_string(value.type) or pa.types.is_large_string(value.type):
        begins = pa.compute.utf8_slice_codeunits(value, 0, QUOTED_CHARS)[0].as_py()
    elif pa.types.is_binary(value.type) or pa.types.is_large_binary(value.type):
        begins = pa.compute.binary_slice(value, 0, QUOTED_CHARS)[0].as_py()
    else:
        begins = None
    return (f"the row's strings take {total:,} bytes ({field}: {size:,}), over the {bound:,} that a row may hold "
            "(gr_engine.row_bounds.MAX_STRING_BYTES); refused without reading them"
            + ("" if begins is None else f"; {field} begins {begins!r}"))


def _labels(batch: Any, i: int, max_string_bytes: int | None) -> tuple[str | None, int | str | None]:
    """Row ``i``'s ``request_id`` (as a string) and ``user_id`` (:func:`~gr_engine.outputs.output_user_id`) from
    their scalar columns (the last of a repeated name, as ``to_pylist`` keeps it); ``None`` for one that is missing,
    nested, or of more than ``max_string_bytes`` bytes."""
    labels: list[Any] = []
    for name in _LABELS:
        indices = batch.schema.get_all_field_indices(name)
        value = batch.column(indices[-1]).slice(i, 1) if indices else None
        unread = (value is None or _pyarrow().types.is_nested(value.type)
                  or (max_string_bytes is not None and int(_sizes(value)[1][0]) > max_string_bytes))
        labels.append(None if unread else value[0].as_py())
    request_id, user_id = labels
    return None if request_id is None else str(request_id), output_user_id(user_id)


def _sizes(array: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(values, bytes)`` of each row of the Arrow array (or chunked array) ``array``, int64: how many values its
    lists hold (a list view's values each time it shows them; those of lists nested in lists, structs, maps and
    dictionaries counted too; a null list holds none) and how many bytes its strings and binaries take, nested ones
    included. Extension arrays are measured by their storage; unions (which Parquet does not hold) are not."""
    pa = _pyarrow()
    types = pa.types
    if isinstance(array, pa.ChunkedArray):
        parts = [_sizes(chunk) for chunk in array.chunks]
        return (np.concatenate([p[0] for p in parts] or [np.zeros(0, dtype=np.int64)]),
                np.concatenate([p[1] for p in parts] or [np.zeros(0, dtype=np.int64)]))
    kind, n = array.type, len(array)
    values, size = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    if not _measured(kind):
        return values, size
    if isinstance(array, pa.ExtensionArray):
        return _sizes(array.storage)
    if types.is_dictionary(kind):
        if not len(array.dictionary):  # every row is null
            return values, size
        inner_values, inner_size = _sizes(array.dictionary)
        valid = array.is_valid().to_numpy(zero_copy_only=False)
        at = pa.compute.fill_null(array.indices, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        return np.where(valid, inner_values[at], 0), np.where(valid, inner_size[at], 0)
    if types.is_map(kind):
        array = array.view(pa.list_(pa.struct([kind.key_field, kind.item_field])))
        kind = array.type
    if _is_list(kind):
        values = pa.compute.fill_null(pa.compute.list_value_length(array), 0).to_numpy().astype(np.int64)
        if _measured(kind.value_type):  # the values' own sizes, summed per row
            inner = _sizes(pa.compute.list_flatten(array))
            ends = np.cumsum(values)
            starts = ends - values
            for total, part in zip((values, size), inner):
                sums = np.concatenate([[0], np.cumsum(part)])
                total += sums[ends] - sums[starts]
    elif types.is_struct(kind):
        for child in array.flatten():
            child_values, child_size = _sizes(child)
            values += child_values
            size += child_size
    elif types.is_fixed_size_binary(kind):
        size[array.is_valid().to_numpy(zero_copy_only=False)] = kind.byte_width
    elif types.is_string_view(kind) or types.is_binary_view(kind):  # each view's first int32 is its length
        views = np.frombuffer(array.buffers()[1], dtype=np.int32).reshape(-1, 4)[array.offset:array.offset + n, 0]
        size = np.where(array.is_valid().to_numpy(zero_copy_only=False), views, 0).astype(np.int64)
    else:
        size = pa.compute.fill_null(pa.compute.binary_length(array), 0).to_numpy().astype(np.int64)
    return values, size


def _is_list(kind: Any) -> bool:
    types = _pyarrow().types
    return (types.is_list(kind) or types.is_large_list(kind) or types.is_fixed_size_list(kind)
            or types.is_list_view(kind) or types.is_large_list_view(kind))


def _measured(kind: Any) -> bool:
    """Whether values of the Arrow type ``kind`` hold lists, strings or binaries (which :func:`_sizes` counts)."""
    pa = _pyarrow()
    types = pa.types
    if isinstance(kind, pa.BaseExtensionType):
        return _measured(kind.storage_type)
    if types.is_dictionary(kind):
        return _measured(kind.value_type)
    if types.is_struct(kind):
        return any(_measured(kind.field(i).type) for i in range(kind.num_fields))
    return (_is_list(kind) or types.is_map(kind) or types.is_string(kind) or types.is_large_string(kind)
            or types.is_binary(kind) or types.is_large_binary(kind) or types.is_fixed_size_binary(kind)
            or types.is_string_view(kind) or types.is_binary_view(kind))
