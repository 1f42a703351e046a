"""``gr-engine rank`` / ``generate`` with ``--workers N``: the job on Ray Data (:mod:`gr_engine.ray_ranking`), from
request files or folders to a folder of Parquet or JSONL output files."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from .cli import finish_file_job
from .config import EngineConfig, load_config
from .io import max_line_bytes, max_list_lengths
from .request import GenerateParams, GenerateRequest, RankRequest

#: Output columns the job's summary reads back.
_TALLY_COLUMNS = ["error", "num_gpu_cached_tokens", "num_host_cached_tokens", "num_computed_tokens"]


def import_ray() -> Any:
    """The ``ray`` module with Ray Data loaded; ``ImportError`` saying how to install it."""
    try:
        import ray
        import ray.data
    except ImportError as exc:
        raise ImportError("--workers runs the job on Ray, which is not installed: pip install 'gr-engine[ray]'") \
            from exc
    return ray


def serve_files_on_ray(args: argparse.Namespace, generate: bool) -> int:
    """Rank (or, with ``generate``, retrieve for) every row of ``args.input`` (files or folders) on ``args.workers``
    engine actors; write one output per row, with its ``row_order``, to the folder ``args.output`` (new or empty)
    as ``args.output_format`` files. Exit status 1 when every request failed, else 0.

    Uses the Ray cluster of ``RAY_ADDRESS`` (or one already initialised); else it starts a local one, with a CPU
    more than the CPU engines need (the read and shuffle tasks run beside them)."""
    ray = import_ray()
    from .ray_ranking import rank_dataset, read_request_files

    inputs = [Path(path) for path in args.input]
    for path in inputs:
        if not path.exists():
            raise FileNotFoundError(f"--input {path} does not exist")
    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--output {out} must be a new or empty folder with --workers (Ray writes its files there)")
    params = GenerateParams(top_k=args.top_k, exclude_history=args.exclude_history) if generate else None
    config = load_config(args.config, args.overrides + ([f"weights_path={args.weights}"] if args.weights else []))
    if not ray.is_initialized():
        _start_ray(ray, config, args.workers)
    ray.data.DataContext.get_current().enable_progress_bars = not args.no_progress
    t0 = time.perf_counter()
    requests = read_request_files([str(path.resolve()) for path in inputs], max_line_bytes(config),
                                  max_list_lengths(config, ranking=not generate),
                                  request_type=GenerateRequest if generate else RankRequest)
    outputs = rank_dataset(requests, config, args.workers, generate=generate, params=params,
                           num_partitions=args.partitions)
    parquet = args.output_format == "parquet"
    (outputs.write_parquet if parquet else outputs.write_json)(str(out))
    rows = failed = hits = history = 0
    if out.is_dir() and any(out.iterdir()):  # no rows, no files
        written = ray.data.read_parquet(str(out)) if parquet else ray.data.read_json(str(out))
        counts = written.select_columns(_TALLY_COLUMNS).map_batches(_tally, batch_format="pyarrow").take_all()
        rows, failed, hits, history = (sum(c[name] for c in counts) for name in ("rows", "failed", "hits", "history"))
    return finish_file_job(args.command, generate, rows, failed, hits / history if history else 0.0,
                           time.perf_counter() - t0, out, f" on {args.workers} workers")


def _start_ray(ray: Any, config: EngineConfig, workers: int) -> None:
    if "RAY_ADDRESS" in os.environ or config.device.startswith("cuda"):
        ray.init()
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, workers + 1))


def _tally(batch: Any) -> Any:
    """Counts of a batch of outputs (a ``pyarrow.Table``), as one row, which the summary adds up (a few rows per
    output file): rows, failed rows, history tokens served from a cache and history tokens in all."""
    import pyarrow as pa
    import pyarrow.compute as pc

    hits = pc.sum(batch["num_gpu_cached_tokens"]).as_py() or 0
    hits += pc.sum(batch["num_host_cached_tokens"]).as_py() or 0
    history = hits + (pc.sum(batch["num_computed_tokens"]).as_py() or 0)
    return pa.table({"rows": [len(batch)], "failed": [len(batch) - batch["error"].null_count],
                     "hits": [hits], "history": [history]})
