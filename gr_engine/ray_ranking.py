"""Offline ranking and retrieval on Ray Data: a dataset of requests served by a pool of :class:`~gr_engine.GREngine`
actors, every user's visits by one engine, in their input order (so a returning user's later visits reuse the KV
cache of the earlier ones, as in one process). Needs ``pip install 'gr-engine[ray]'``; nothing else in the package
imports this module.

How rows reach the engines (docs/scale_out.md, "Offline ranking on Ray Data"):

1. Each row gets a ``partition``: ``stable_hash(user_id) % num_partitions`` (rows without a valid user id, which
   fail to parse anyway, by their ``row_order``).
2. ``groupby("partition").map_groups(...)``: Ray's hash shuffle co-locates each partition's rows and calls the
   engine actor once per partition with all of its rows (a zero-copy Arrow slice), so all visits of a user are
   served by one actor in one call. The shuffle does not keep row order, so the actor sorts the partition by
   ``row_order`` and serves it a chunk of :data:`~gr_engine.io.CHUNK_ROWS` rows at a time, yielding each chunk's
   outputs (bounded output blocks). ``repartition(keys=...)`` + ``map_batches`` promises neither that a partition
   stays one block nor that one call sees it whole; ``sort`` spreads a partition over blocks that different
   actors serve; ``groupby("user_id")`` would call the engine once per user, one request per step.
3. The actors are a fixed pool (``ActorPoolStrategy(size=num_workers)``), one device each (``num_gpus=1`` on CUDA).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from .config import EngineConfig
from .io import CHUNK_ROWS, max_list_lengths, parse_row, serve_rows
from .output_writer import array_as_lists, output_schema
from .outputs import GenerateOutput, RankOutput
from .ray_source import WIRE_SCHEMA, RequestFilesDatasource, wire_row, wire_table
from .request import GenerateParams, GenerateRequest, RankRequest
from .row_bounds import MAX_STRING_BYTES, bounded_rows

#: The column that orders the input rows (int64, unique); a user's visits are served in its order and every output
#: carries it, so that sorting by it restores input order.
ROW_ORDER = "row_order"


def read_request_files(paths: str | list[str], max_line_bytes: int | None = None,
                       max_list_lengths: Mapping[str, int] | None = None, *,
                       request_type: type[GenerateRequest] = RankRequest,
                       max_string_bytes: int | None = MAX_STRING_BYTES, **file_args: Any) -> ray.data.Dataset:
    """The request files under ``paths`` (files or folders of ``.jsonl`` and ``.parquet``) as wire rows
    (:mod:`gr_engine.ray_source`), ready for :func:`rank_dataset`; malformed rows become error outputs there, with
    the labels a single-process job gives them. JSONL lines over ``max_line_bytes`` bytes are such rows, refused
    unread (pass :func:`gr_engine.io.max_line_bytes` of the engine's config, as ``gr-engine rank --workers`` does;
    ``None``: no bound). Of Parquet files only the columns of ``request_type``'s fields are read (pass
    :class:`GenerateRequest` for retrieval, which ignores candidates), and rows with a list longer than
    ``max_list_lengths`` gives it (pass :func:`gr_engine.io.max_list_lengths` of the config; ``None``: no bound) or
    more than ``max_string_bytes`` bytes of strings (``None``: no bound) are such rows, labelled by their request and
    user ids. ``file_args`` go to Ray's ``FileBasedDatasource``."""
    return ray.data.read_datasource(RequestFilesDatasource(paths, max_line_bytes, max_list_lengths,
                                                           request_type=request_type,
                                                           max_string_bytes=max_string_bytes, **file_args))


def rank_dataset(ds: ray.data.Dataset, config: EngineConfig, num_workers: int, *, generate: bool = False,
                 params: GenerateParams | None = None, num_partitions: int | None = None) -> ray.data.Dataset:
    """Serve every row of ``ds`` on ``num_workers`` engine actors; a (lazy) dataset of one output per row.

    Args:
        ds: either :func:`read_request_files`'s wire rows, or rows whose columns are request fields (e.g. from
            ``ray.data.read_parquet``) plus :data:`ROW_ORDER` (int64, unique, the order of each user's visits; a
            row without a ``request_id`` is labelled ``row-<row_order>``). Of such rows only the request's fields
            are converted to Python (it ignores other columns), and a row with a list longer than any valid
            request's (:func:`gr_engine.io.max_list_lengths` of ``config``) or more than
            :data:`~gr_engine.row_bounds.MAX_STRING_BYTES` bytes of strings is not: it is that row's error output,
            labelled by its request and user ids, as in a file job.
        config: the engine configuration of every actor (``weights_path`` must be readable where they run). With
            a CUDA device each actor gets one GPU from Ray and uses it as ``cuda``.
        num_workers: engine actors (at least 1).
        generate: retrieval (:meth:`GREngine.generate` with ``params``) instead of ranking.
        num_partitions: user partitions (default ``num_workers``). Each is served whole by one actor call, so it
            must fit in a node's object store; raise it for datasets larger than the workers' object stores.

    Returns:
        Rows of the fields of :class:`RankOutput` (``generate``: :class:`GenerateOutput`; scores as nested lists of
        float32, ``user_id`` as a string, since blocks are written independently and a column has one type) plus
        :data:`ROW_ORDER`, in no particular order.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    num_partitions = num_workers if num_partitions is None else num_partitions
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be at least 1, got {num_partitions}")
    if generate:
        params = params or GenerateParams()
    elif params is not None:
        raise ValueError("params are for retrieval (generate=True)")
    resources = {"num_gpus": 1} if config.device.startswith("cuda") else {"num_cpus": 1}
    bounds = {"fields": (GenerateRequest if generate else RankRequest).__struct_fields__,
              "max_lengths": max_list_lengths(config, ranking=not generate), "max_string_bytes": MAX_STRING_BYTES}
    return (ds.map_batches(_partitioned, batch_format="pyarrow", fn_kwargs={"num_partitions": num_partitions, **bounds})
            .groupby("partition", num_partitions=num_partitions)
            .map_groups(EngineWorker, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=num_workers),
                        fn_constructor_kwargs={"config": config, "generate": generate, "params": params},
                        **resources))


class EngineWorker:
    """One engine actor: serves whole partitions of wire rows (plus ``partition``), in :data:`ROW_ORDER`."""

    def __init__(self, config: EngineConfig, generate: bool, params: GenerateParams | None) -> None:
        from .engine import GREngine

        if config.device.startswith("cuda"):  # Ray shows the actor only its own GPU
            config = msgspec.structs.replace(config, device="cuda")
        self.engine = GREngine(config)
        self.generate, self.params = generate, params
        self.request_type = GenerateRequest if generate else RankRequest
        self.output_type = GenerateOutput if generate else RankOutput
        self.schema = output_schema(self.output_type, pa.string()).append(pa.field(ROW_ORDER, pa.int64()))

    def __call__(self, partition: pa.Table) -> Iterator[pa.Table]:
        """The outputs of ``partition``'s rows, a chunk of :data:`CHUNK_ROWS` input rows at a time."""
        order = pc.sort_indices(partition[ROW_ORDER]).to_numpy()
        for start in range(0, len(order), CHUNK_ROWS):
            chunk = partition.take(order[start:start + CHUNK_ROWS]).to_pydict()
            parsed = [parse_row(label, wire_row(request, error), self.request_type)
                      for label, request, error in zip(chunk["label"], chunk["request"], chunk["error"])]
            outputs = serve_rows(self.engine, parsed, self.params if self.generate else None)
            rows = msgspec.to_builtins(outputs, enc_hook=array_as_lists)
            for row, order_of_row in zip(rows, chunk[ROW_ORDER]):
                row["user_id"] = None if row["user_id"] is None else str(row["user_id"])
                row[ROW_ORDER] = order_of_row
            yield pa.Table.from_pylist(rows, schema=self.schema)


def _partitioned(batch: pa.Table, num_partitions: int, fields: Collection[str], max_lengths: Mapping[str, int],
                 max_string_bytes: int) -> pa.Table:
    """``batch`` as wire rows (encoded here if its columns are request fields: :func:`_as_wire` with ``fields``,
    ``max_lengths`` and ``max_string_bytes``) with a ``partition`` column (int64): the user's hash, else the row
    order, modulo ``num_partitions``. Checked per batch, so that no schema has to be read before the job starts."""
    if ROW_ORDER not in batch.column_names or batch[ROW_ORDER].null_count:
        raise ValueError(f"every row needs a {ROW_ORDER!r} (int64): the order of each user's visits")
    if batch.column_names != WIRE_SCHEMA.names:
        batch = _as_wire(batch, fields, max_lengths, max_string_bytes)
    divisor = np.uint64(num_partitions)
    by_user = (pc.fill_null(batch["user_hash"], 0).to_numpy() % divisor).astype(np.int64)
    by_row = batch[ROW_ORDER].to_numpy().astype(np.int64) % num_partitions
    keys = np.where(batch["user_hash"].is_valid().to_numpy(zero_copy_only=False), by_user, by_row)
    return batch.append_column("partition", pa.array(keys, type=pa.int64()))


def _as_wire(batch: pa.Table, fields: Collection[str], max_lengths: Mapping[str, int],
             max_string_bytes: int) -> pa.Table:
    """Rows of request-field columns plus :data:`ROW_ORDER` as wire rows (:data:`WIRE_SCHEMA`): only the columns
    named in ``fields`` are converted, and a row over ``max_lengths`` (list values) or ``max_string_bytes`` (bytes of
    strings) is not, but refused with its labels (:func:`~gr_engine.row_bounds.bounded_rows`)."""
    orders = batch[ROW_ORDER].to_pylist()
    requests = batch.select([i for i, name in enumerate(batch.column_names) if name in fields])
    rows = bounded_rows(requests, max_lengths, max_string_bytes)
    return wire_table((order, f"row-{order}", row) for order, row in zip(orders, rows))
