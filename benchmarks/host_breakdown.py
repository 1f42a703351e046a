"""Host time per batch of the engine's step functions, on the GPU machine (a diagnostic for ``gr-engine bench``).

    python benchmarks/host_breakdown.py --out breakdown.json [--modes hierarchical unlimited] [--batches 60]

cProfile's per-call cost inflates Python-heavy code unevenly; this wraps only the functions of the engine's step
path (scheduling, metadata, the host tier's transfers, staging, replay, commit) with ``time.perf_counter`` and
reports each one's inclusive time (mean milliseconds per batch of 8; median, p90 and max microseconds per call) in
the benchmark's steady state (same set-up as
``bench_profile.py``). Nested functions are included in their callers' times.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from attention_backends import base as attention_base
from attention_backends.hstu_triton import HSTUTritonBackend
from cache_engine import dma_staging
from cache_engine import transfer as transfer_module
from cache_engine.batched_copy import BatchedCopier
from cache_engine.dma_staging import DmaStaging
from cache_engine.host_tier import HostTier
from cache_engine.kernel_cache import CompiledKernels
from cache_engine.kv_cache_manager import KVCacheManager
from cache_engine.offload_kernel import ChunkPacker
from cache_engine.onload_graphs import OnloadGraphs
from cache_engine.onload_kernel import OnloadLauncher
from cache_engine.transfer import TransferEngine
from gr_engine import engine as engine_module
from gr_engine import model_runner as runner_module
from gr_engine import step_expand
from gr_engine.bench.experiments import steady_state_parser, steady_state_runs, steady_state_settings
from gr_engine.step_graphs import StepGraphs
from scheduler.scheduler import Scheduler

WRAPPED = {
    "Scheduler.schedule": (Scheduler, "schedule"), "Scheduler.complete": (Scheduler, "complete"),
    "kv.begin_step": (KVCacheManager, "begin_step"), "kv.acquire": (KVCacheManager, "acquire"),
    "kv._evict": (KVCacheManager, "_evict"), "kv.page_table": (KVCacheManager, "page_table"),
    "kv.commit": (KVCacheManager, "commit"), "kv.release": (KVCacheManager, "release"),
    "kv.end_step": (KVCacheManager, "end_step"), "kv.prefetch": (KVCacheManager, "prefetch"),
    "kv.hand_back_prefetched": (KVCacheManager, "hand_back_prefetched"),
    "engine._next_step_size": (engine_module.GREngine, "_next_step_size"),
    "kv.issue_deferred_offloads": (KVCacheManager, "issue_deferred_offloads"),
    "host.poll": (HostTier, "poll"), "host.persist_all": (HostTier, "persist_all"),
    "host.plan_onload": (HostTier, "plan_onload"), "host.flush": (HostTier, "flush"),
    "host.launch_onloads": (HostTier, "launch_onloads"), "host.launch_offloads": (HostTier, "launch_offloads"),
    "transfer.offload": (TransferEngine, "offload"), "transfer.onload": (TransferEngine, "onload"),
    "transfer.before_writes": (TransferEngine, "before_writes"), "transfer._upload": (TransferEngine, "_upload"),
    "transfer.issue_deferred": (TransferEngine, "issue_deferred"), "transfer._pack": (TransferEngine, "_pack"),
    "transfer.host_page_addresses": (transfer_module, "host_page_addresses"),
    "runner.prepare": (runner_module.ModelRunner, "prepare"), "runner.strip": (runner_module.ModelRunner, "strip"),
    "runner.forward": (runner_module.ModelRunner, "forward"), "runner.score": (runner_module.ModelRunner, "score"),
    "step_expand.write_compact": (step_expand, "write_compact"), "graphs.stage": (StepGraphs, "stage"),
    "graphs.replay": (StepGraphs, "replay"), "backend.graph_plan": (HSTUTritonBackend, "graph_plan"),
    "backend.graph_metadata": (HSTUTritonBackend, "graph_metadata"),
    "engine._output": (engine_module.GREngine, "_output"), "engine._add": (engine_module.GREngine, "_add"),
    "torch.Event.record": (torch.cuda.Event, "record"), "torch.CUDAGraph.replay": (torch.cuda.CUDAGraph, "replay"),
    "from_layout": (attention_base.PagedBatchMetadata, "from_layout"),
    "OnloadGraphs.replay": (OnloadGraphs, "replay"), "OnloadLauncher.__call__": (OnloadLauncher, "__call__"),
    "ChunkPacker.__call__": (ChunkPacker, "__call__"),
    "transfer._onload_by_kernel": (TransferEngine, "_onload_by_kernel"),
    "transfer._stage_by_dma": (TransferEngine, "_stage_by_dma"), "DmaStaging.copy": (DmaStaging, "copy"),
    "BatchedCopier.layers": (BatchedCopier, "layers"), "BatchedCopier._call": (BatchedCopier, "_call"),
    "OnloadLauncher.all_layers": (OnloadLauncher, "all_layers"), "CompiledKernels.launch": (CompiledKernels, "launch"),
    "transfer.job_slot_addresses": (transfer_module, "job_slot_addresses"),
    "dma_staging.job_slot_addresses": (dma_staging, "job_slot_addresses"),
}
# With --torch-calls: the torch and numpy calls the step path makes most (wrapping adds ~0.3 us to each).
TORCH_CALLS = {
    "torch.cuda.current_stream": (torch.cuda, "current_stream"), "torch.cuda.set_stream": (torch.cuda, "set_stream"),
    "Stream.wait_stream": (torch.cuda.Stream, "wait_stream"), "Stream.wait_event": (torch.cuda.Stream, "wait_event"),
    "Event.query": (torch.cuda.Event, "query"), "torch.empty": (torch, "empty"), "Tensor.to": (torch.Tensor, "to"),
    "Tensor.copy_": (torch.Tensor, "copy_"), "Tensor.record_stream": (torch.Tensor, "record_stream"),
    "Tensor.__getitem__": (torch.Tensor, "__getitem__"), "Tensor.data_ptr": (torch.Tensor, "data_ptr"),
    "np.concatenate": (np, "concatenate"), "np.repeat": (np, "repeat"), "np.take": (np, "take"),
}


def instrument(calls: dict[str, list[float]], wrapped_functions: dict[str, tuple[Any, str]]) -> None:
    """Wrap every function of ``wrapped_functions``; each call's seconds are appended to ``calls[name]``."""
    for name, (owner, attr) in wrapped_functions.items():
        raw = owner.__dict__[attr] if attr in getattr(owner, "__dict__", {}) else getattr(owner, attr)
        is_static = isinstance(raw, staticmethod)
        fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw

        def timed(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                calls[_name].append(time.perf_counter() - t)

        wrapped = functools.wraps(fn)(timed)
        if isinstance(raw, classmethod):
            wrapped = classmethod(wrapped)
        elif is_static:
            wrapped = staticmethod(wrapped)
        setattr(owner, attr, wrapped)


def main() -> None:
    parser = steady_state_parser(__doc__.splitlines()[0], batches=60)
    parser.add_argument("--torch-calls", action="store_true", help="also time the torch and numpy calls listed")
    args = parser.parse_args()
    settings = steady_state_settings(args)
    calls: dict[str, list[float]] = defaultdict(list)
    instrument(calls, {**WRAPPED, **(TORCH_CALLS if args.torch_calls else {})})
    result = {}
    for mode, run in steady_state_runs(settings, args.prime):
        calls.clear()
        report = run.window(8, 8 * args.batches, prime_batches=0)
        per_batch = {}
        for name, seconds in sorted(calls.items(), key=lambda kv: -sum(kv[1])):
            us = np.asarray(seconds) * 1e6
            per_batch[name] = {"mean_ms": round(us.sum() / args.batches / 1e3, 4),
                               "calls": round(len(us) / args.batches, 2), "median_us": round(float(np.median(us)), 1),
                               "p90_us": round(float(np.percentile(us, 90)), 1), "max_us": round(float(us.max()), 1)}
        result[mode] = {"median_ms": report["median_ms"], "phase_ms_per_batch": report["phase_ms_per_batch"],
                        "host_ms_per_batch": report["host_ms_per_batch"], "functions_ms_per_batch": per_batch}
        print(mode, json.dumps(result[mode], indent=1), flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python benchmarks/host_breakdown.py", *sys.argv[1:]]), "gpu": gpu,
                   "result": result}, f, indent=1)


if __name__ == "__main__":
    main()
