"""Host time of each engine phase for benchmark-sized requests, on the CPU, without a GPU.

    python benchmarks/host_overhead.py [--mode unlimited] [--batches 50] [--profile] [--graph-path]
    python benchmarks/host_overhead.py --bench-trace [--mode hierarchical] [--profile]

The engine runs on the CPU with a model of the benchmark's depth and vocabularies but tiny widths. 32 users
with 3,000-9,000-event histories return in batches of 8 with 8 new events and 100 candidates each; the heap
is frozen after the first visits, as in the benchmark. Prints the median batch's phase times (ms);
``--profile`` adds a cProfile of the whole loop.

By default the forward runs eagerly with the ``torch_ref`` backend (cheap-ish at these widths), so prepare is
``torch_ref``'s metadata, and host chunks are copied for real (synchronously, on the CPU). ``--graph-path`` runs
the host work of the GPU engine's path instead: the ``hstu_triton`` backend (imported under Triton's interpreter,
never launched) and :class:`~gr_engine.step_graphs.StepGraphs` stage each step as for CUDA graphs, while the device
work is skipped; what remains is intake, schedule, prepare, strip (staging; the tile plan of keys planned on the
host), score and commit as the GPU machine's host runs them, minus the CUDA calls. That host runs the same Python
about 3x slower than a dev box. The device work is left out through the engine's public seams only:

- the model (``GREngine(config, model=...)``) has layers that return their input without attending, so an eager
  step (longer than a graph holds) launches no attention kernel and writes no K/V;
- ``engine.runner.graphs`` is a :class:`~gr_engine.step_graphs.StepGraphs` whose ``replay`` returns zero states
  and logits (the staging before it is the real one);
- ``engine.runner.layout`` is a :class:`~gr_engine.eager_layout.DeviceLayout` (as a CUDA engine's) whose ``expand``
  launches nothing and returns a zero buffer (the compact step before it is staged for real), so eager steps are
  laid out the GPU's way;
- ``engine.backend.uncut_plan`` (``hstu_triton``'s writer of large eager steps' tile plans on the device) is an
  :class:`~attention_backends.hstu_triton_uncut.UncutPlanWriter` whose ``write`` allocates the plan's buffer and
  launches nothing (the host's decision and sizes before it are the real ones);
- the host tier's transfer engine (``engine.kv.host.transfer``) is a :class:`~cache_engine.TransferEngine` whose
  ``offload`` and ``onload`` copy nothing and complete at once, as a CPU copy returns: the host tier's bookkeeping
  (which chunks to persist or load, slots, evictions) runs as usual; the transfer engine's own host work (index
  arrays, launches) is not counted.

``--cold-history N`` (implies ``--graph-path``) serves first visits of N-event users alone (``recompute`` unless
``--mode`` says otherwise: a caching mode also hashes and keeps each history; one request a step, steps up to
16,384 rows staged for graphs), as the bench's ``cold_{N}_ms``, with the bench model's attention shape (4 heads x
128, bf16) and an H200's 132 SMs, so that each step gets the GPU's tile plan (on the device); prints
the median visit's wall time and phases: the host's part of a cold visit, less its CUDA calls.

``--bench-trace`` (implies ``--graph-path``) serves the benchmark's own trace and windows instead
(:meth:`~gr_engine.bench.runner.BenchRun.windows` at batch size 8: 1,000 users, ten strata, the GPU budget of
``gr-engine bench`` and as many host slots as its 64 GiB of FP8 chunks) and prints the median and mean host time of
steps 1-7 per batch, the statistics of ``overhead_ms_bs8``: a CPU proxy of that number for comparing changes
without a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time
from typing import Any

import msgspec
import numpy as np

# Before anything imports Triton: its interpreter serves hstu_triton on the CPU.
if {"--graph-path", "--bench-trace", "--cold-history"} & set(sys.argv):
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from attention_backends import PagedBatchMetadata
from attention_backends.hstu_triton_plan import TileConfig
from attention_backends.hstu_triton_uncut import UncutPlanWriter
from cache_engine import TransferEngine
from cache_engine.jobs import OffloadJob, OnloadJob
from gr_engine import CacheConfig, EngineConfig, GREngine, ModelConfig, RankRequest, SchedulerConfig
from gr_engine.eager_layout import DeviceLayout
from gr_engine.models import GRModel
from gr_engine.step_graphs import StagedStep, StepGraphs


class HostOnlyGraphs(StepGraphs):
    """Stages each step exactly as for CUDA graphs but replays nothing: zero states and logits stand in for the
    device's results (this probe measures the host's work). ``num_tasks``: the logits' width."""

    def __init__(self, num_tasks: int, *args: Any) -> None:
        super().__init__(*args)
        self.num_tasks = num_tasks

    def replay(self, step: StagedStep, segments: Any, head: Any,
               layer_ready: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        self.num_replays += 1
        return torch.zeros(step.rows, 1), torch.zeros(step.lengths["candidates"], self.num_tasks)


class HostOnlyLayout(DeviceLayout):
    """Stages each eager step in compact form as a CUDA engine does but expands nothing: a zero buffer (valid rows
    and token ids for the rest of the host-only step), kept and grown, stands in for the expansion's."""

    _zeros = torch.zeros(0, dtype=torch.int32)

    def expand(self, compact: torch.Tensor, rows: int, size: int) -> torch.Tensor:
        if len(self._zeros) < size:
            self._zeros = torch.zeros(2 * size, dtype=torch.int32)
        return self._zeros[:size]


class HostOnlyUncutPlan(UncutPlanWriter):
    """Allocates a large eager step's tile plan as a CUDA engine does but writes nothing into it (no attention reads
    it here)."""

    def write(self, common: PagedBatchMetadata, tiles: TileConfig, num_tiles: int, num_items: int) -> torch.Tensor:
        return torch.empty(5 * num_tiles + 2 * num_items, dtype=torch.int32)


class NoCopyTransfer(TransferEngine):
    """Offloads and onloads that copy nothing and are complete at once (as a CPU copy is on return): the host tier's
    bookkeeping runs as usual while KV contents go stale."""

    def offload(self, kv: torch.Tensor, jobs: list[OffloadJob]) -> None:
        return None

    def onload(self, kv: torch.Tensor, jobs: list[OnloadJob]) -> list[torch.cuda.Event | None]:
        return [None] * kv.shape[0]


class SkipAttention(torch.nn.Module):
    """A model layer that returns its input: no attention launched, no K/V written."""

    def forward(self, x: torch.Tensor, attend: Any) -> torch.Tensor:
        return x


def host_only_model(config: ModelConfig) -> GRModel:
    """A model of ``config`` whose layers skip the device work (:class:`SkipAttention`)."""
    model = GRModel(config)
    model.layers = torch.nn.ModuleList(SkipAttention() for _ in model.layers)
    return model


def use_graph_path(engine: GREngine) -> HostOnlyGraphs:
    """Serve ``engine``'s steps the GPU path's way on the host, device work skipped (see the module docstring):
    ``engine`` must have been built with :func:`host_only_model`'s model."""
    if not all(isinstance(layer, SkipAttention) for layer in engine.model.layers):
        raise ValueError("the graph path needs the engine built with host_only_model()'s model")
    config = engine.config
    graphs = HostOnlyGraphs(config.model.num_tasks, engine.backend, engine.device, config.cache.page_size,
                            config.cuda_graph_max_rows, config.scheduler.max_num_seqs, config.cache.num_gpu_pages)
    engine.runner.graphs = graphs
    engine.runner.layout = HostOnlyLayout(engine.device, config.cache.page_size, config.scheduler.max_num_seqs)
    engine.backend.uncut_plan = HostOnlyUncutPlan()
    if engine.kv.host is not None:
        engine.kv.host.poll(wait=True)  # nothing in flight is left to the old engine
        engine.kv.host.transfer = NoCopyTransfer(engine.device)
    return graphs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["recompute", "gpu_only", "hierarchical", "unlimited"],
                        help="cache mode (default: unlimited; recompute with --cold-history)")
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--graph-path", action="store_true", help="the GPU path's host work (see above)")
    parser.add_argument("--bench-trace", action="store_true", help="the benchmark's trace and windows (see above)")
    parser.add_argument("--cold-history", type=int, default=0, metavar="N",
                        help="first visits of N-event users, one a step (see above)")
    parser.add_argument("--gpu-pages", type=int, default=None,
                        help="KV pages (default: all histories fit for unlimited; about 60%% of them otherwise, "
                             "like the benchmark's GPU hit ratio, so users are evicted and onloaded)")
    args = parser.parse_args()
    args.mode = args.mode or ("recompute" if args.cold_history else "unlimited")
    model = ModelConfig(num_items=1_000_000, num_actions=256, d_model=16, num_layers=8, num_heads=1, head_dim=16,
                        max_history_len=20_000, max_candidates=100, num_tasks=8, ranking_hidden=16, dtype="float32")
    if args.bench_trace:
        bench_trace(model, args.mode, args.profile)
        return
    if args.cold_history:
        cold_visits(msgspec.structs.replace(model, num_heads=4, head_dim=128, dtype="bfloat16"), args.mode,
                    args.cold_history, args.batches, args.profile)
        return
    backend = "hstu_triton" if args.graph_path else "torch_ref"
    pages = args.gpu_pages or (40_000 if args.mode == "unlimited" else 3_600)
    config = EngineConfig(model=model, device="cpu", attention_backend=backend,
                          cache=CacheConfig(mode=args.mode, page_size=32, num_gpu_pages=pages, host_budget_bytes=2**30),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=163_840))
    engine = GREngine(config, model=host_only_model(model) if args.graph_path else None)
    graphs = use_graph_path(engine) if args.graph_path else None
    rng = np.random.default_rng(0)
    users = 32
    events = {u: (rng.integers(0, 1_000_000, 20_000), rng.integers(0, 256, 20_000),
                  np.cumsum(rng.integers(0, 100, 20_000))) for u in range(users)}
    lengths = {u: int(rng.integers(3000, 9000)) for u in range(users)}
    count = iter(range(10**9))

    def request(user: int) -> RankRequest:
        items, actions, times = (a[: lengths[user]] for a in events[user])
        return RankRequest(request_id=str(next(count)), user_id=user, item_ids=items, action_ids=actions,
                           timestamps=times, candidate_item_ids=rng.integers(0, 1_000_000, 100))

    engine.rank([request(u) for u in range(users)], use_tqdm=False)
    gc.collect()
    gc.freeze()  # as the benchmark does before measuring: long-lived objects leave the collector's view
    profiler = cProfile.Profile()
    per_batch: list[dict[str, float]] = []
    for b in range(args.batches + 5):
        batch = []
        for user in rng.choice(users, 8, replace=False).tolist():
            lengths[user] += 8
            batch.append(request(user))
        before = dict(engine.stats.phase_seconds)
        measured = b >= 5 and args.profile
        if measured:
            profiler.enable()
        engine.rank(batch, use_tqdm=False)
        if measured:
            profiler.disable()
        if b >= 5:
            per_batch.append({k: (v - before.get(k, 0.0)) * 1e3 for k, v in engine.stats.phase_seconds.items()})
    # Steps 1-7's host time, as the benchmark's overhead_ms_bs8: without intake and the device waits.
    host = [sum(v for k, v in p.items() if k not in ("intake", "forward", "score")) for p in per_batch]
    median = per_batch[int(np.argsort(host)[len(host) // 2])]
    print(f"{args.mode}, batches of 8: host phases (ms) of the median batch: "
          f"{ {k: round(v, 3) for k, v in median.items()} }; steps 1-7 without forward and score "
          f"{np.median(host):.3f}, intake {np.median([p['intake'] for p in per_batch]):.3f}"
          + (f"; {graphs.num_replays} steps staged for graphs" if graphs is not None else ""))
    if args.profile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def cold_visits(model: ModelConfig, mode: str, history: int, visits: int, profile: bool) -> None:
    """``--cold-history``: ``visits`` first visits of ``history``-event users with 100 candidates, each alone, on the
    GPU path's host work (5 more first, unmeasured), in cache ``mode`` (a caching mode also hashes each history)."""
    config = EngineConfig(model=model, device="cpu", attention_backend="hstu_triton", cuda_graph_max_rows=16_384,
                          cache=CacheConfig(mode=mode, page_size=32, num_gpu_pages=-(-(history + 100) // 16),
                                            host_budget_bytes=2**26),
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=163_840))
    engine = GREngine(config, model=host_only_model(model))
    engine.backend.num_sms = 132  # an H200's: the tile plan's capacities as on the GPU (planned on the device)
    graphs = use_graph_path(engine)
    rng = np.random.default_rng(0)
    requests = [RankRequest(request_id=str(i), user_id=i, item_ids=rng.integers(0, model.num_items, history),
                            action_ids=rng.integers(0, model.num_actions, history),
                            timestamps=np.cumsum(rng.integers(0, 100, history)),
                            candidate_item_ids=rng.integers(0, model.num_items, 100)) for i in range(visits + 5)]
    for request in requests[:5]:
        engine.rank([request], use_tqdm=False)
    gc.collect()
    gc.freeze()
    profiler = cProfile.Profile()
    walls, phases = [], []
    for request in requests[5:]:
        before = dict(engine.stats.phase_seconds)
        if profile:
            profiler.enable()
        t0 = time.perf_counter()
        engine.rank([request], use_tqdm=False)
        walls.append((time.perf_counter() - t0) * 1e3)
        if profile:
            profiler.disable()
        phases.append({k: (v - before.get(k, 0.0)) * 1e3 for k, v in engine.stats.phase_seconds.items()})
    median = phases[int(np.argsort(walls)[len(walls) // 2])]
    print(f"{mode}, cold first visits of {history} events, one a step ({len(walls)} measured, "
          f"{graphs.num_replays} steps staged for graphs): wall per visit median {np.median(walls):.3f} ms; "
          f"phases (ms) of the median visit: { {k: round(v, 3) for k, v in median.items()} }")
    if profile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def bench_trace(model: ModelConfig, mode: str, profile: bool) -> None:
    """``--bench-trace``: the benchmark's windows at batch size 8 on the GPU path's host work (see above)."""
    from gr_engine.bench.runner import BenchRun, BenchSettings, cache_config, unlimited_pages
    from gr_engine.bench.trace import generate_trace

    settings = BenchSettings(model=model, device="cpu", backend="hstu_triton", modes=(mode,), simulation_workers=0)
    slots = settings.host_budget_bytes // (settings.chunk_tokens * 8 * 2 * 512)  # the benchmark's FP8 slots
    trace = generate_trace(settings.trace)
    pages = unlimited_pages(settings, trace) if mode == "unlimited" else settings.gpu_pages
    slot_bytes = settings.chunk_tokens * model.num_layers * 2 * model.num_heads * model.head_dim  # FP8 here too
    cache = cache_config(settings, mode, num_gpu_pages=pages, host_budget_bytes=slots * slot_bytes)
    run = BenchRun(settings, trace, cache, 8, model=host_only_model(model))
    use_graph_path(run.engine)
    run.warmup()
    profiler = cProfile.Profile()
    if profile:
        profiler.enable()
    report = run.windows([(8, False)])[0]
    if profile:
        profiler.disable()
    host, phases = report["host_ms_per_batch"], report["phase_ms_per_batch"]
    print(f"{mode}, the benchmark's windows at batch size 8 ({report['batches']} batches; total hit ratio "
          f"{report['total_hit_ratio']:.4f}): steps 1-7 per batch median {host['median']:.3f} ms, mean "
          f"{host['mean']:.3f}, p90 {host['p90']:.3f}; phase means {({k: round(v, 3) for k, v in phases.items()})}")
    if profile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    run.close()


if __name__ == "__main__":
    main()
