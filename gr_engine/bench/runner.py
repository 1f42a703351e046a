"""How ``gr-engine bench`` measures one engine over a trace (docs/design.md section 8, "Method"): its settings and
:class:`BenchRun`.

Fast-forwarded requests never compute K/V, so the windows' scores are meaningless; their timings do not depend on
values. Long-lived objects are ``gc.freeze()``-d before measured batches, so that no full collection lands inside
one; the collector's pauses there are still timed (``gc_ms_per_batch``).
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import astuple, dataclass, field

import msgspec
import numpy as np
import torch

from cache_engine import CacheConfig, page_prefix_hashes
from scheduler import RequestState

from ..config import EngineConfig, ModelConfig, SchedulerConfig
from ..engine import GREngine
from ..metrics import HOST_PHASES
from ..models import GRModel
from ..request import RankRequest
from .flops import step_flops
from .trace import Trace, TraceConfig

PAPER_MODEL = ModelConfig(num_items=1_000_000, num_actions=256, d_model=512, num_layers=8, num_heads=4, head_dim=128,
                          max_history_len=20_000, max_candidates=100, num_tasks=8, ranking_hidden=512,
                          scaling_seqlen=20_000, dtype="bfloat16")

#: Cache fields the benchmark sets itself, which ``--cache`` may not set: why, for each.
BENCH_CACHE_FIELDS = {
    "mode": "the bench runs every cache mode itself and labels its results by mode",
    "num_gpu_pages": "the bench sets each engine's GPU pages (unlimited mode and the GPU budget sweep their own)",
    "chunk_tokens": "the bench sets each engine's chunk size (the chunk size sweep its own)",
    "page_size": "the bench's page size is its own setting (the trace's page hashes are built with it)",
    "host_budget_bytes": "use --host-budget-gib (the score drift sets its own)",
    "host_dtype": "use --host-dtype (the score drift measures both host dtypes)",
}


@dataclass(frozen=True)
class BenchSettings:
    """What ``gr-engine bench`` runs (defaults: the full benchmark on one H200). Raises ``ValueError`` for sizes it
    cannot run and for ``cache`` fields it sets itself (:data:`BENCH_CACHE_FIELDS`)."""

    model: ModelConfig = PAPER_MODEL
    trace: TraceConfig = field(default_factory=TraceConfig)
    device: str = "cuda"
    backend: str = "auto"
    modes: tuple[str, ...] = ("recompute", "gpu_only", "hierarchical", "unlimited")
    tables_only: bool = False  # only Tables 1-2 of ``modes`` (``--modes``): no sweeps, length scan, drift, simulation
    batch_sizes: tuple[int, ...] = (1, 4, 8)
    gpu_pages: int = 40_960
    page_size: int = 32
    chunk_tokens: int = 1024
    host_budget_bytes: int = 64 * 2**30
    host_dtype: str = "float8_e4m3fn"  # half the PCIe bytes; the score drift it causes is measured
    cache: tuple[tuple[str, object], ...] = ()  # other cache fields, set for every engine (``--cache KEY=VALUE``)
    max_batched_tokens: int = 163_840  # a batch of 8 whole histories (up to 20,000 events) in one step
    window_requests: int = 480  # 60 batches of 8: fewer leave the heavy-tailed latencies' median unsteady
    window_strata: int = 10
    chunk_sweep: tuple[int, ...] = (512, 1024, 2048, 4096)
    budget_sweep: tuple[int, ...] = (20_480, 30_720, 40_960, 51_200, 61_440)
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16_384)
    new_events: int = 8
    drift_history: int = 4096
    cold_history: int = 8192  # a first visit's history (events) for the cold-latency measurement
    cold_visits: int = 20  # measured first visits of that length, each alone (BS=1), after two unmeasured
    simulation_workers: int = 16
    prime_batches: int = 3

    def __post_init__(self) -> None:
        if self.trace.num_users < 1:
            raise ValueError(f"the trace needs at least one user (--users), got {self.trace.num_users}")
        unknown = [m for m in self.modes if m not in ("recompute", "gpu_only", "hierarchical", "unlimited")]
        if unknown or not self.modes:
            raise ValueError(f"modes must be some of recompute, gpu_only, hierarchical, unlimited, got {self.modes}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be positive, got {self.batch_sizes}")
        for name, option in (("gpu_pages", ""), ("page_size", ""), ("chunk_tokens", ""), ("window_strata", ""),
                             ("host_budget_bytes", " (--host-budget-gib)"), ("max_batched_tokens", "")):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}{option} must be positive, got {getattr(self, name)}")
        if self.prime_batches < 0 or self.simulation_workers < 0:
            raise ValueError("prime_batches and simulation_workers must not be negative")
        unit = self.window_strata * math.lcm(*self.batch_sizes)
        if self.window_requests < 1 or self.window_requests % unit:
            raise ValueError(f"window_requests (--window) must be a positive multiple of {unit} ({self.window_strata} "
                             f"strata x every batch size of {self.batch_sizes}), got {self.window_requests}")
        for key, _ in self.cache:
            if key in BENCH_CACHE_FIELDS:
                raise ValueError(f"the cache field {key!r} cannot be set for every engine: {BENCH_CACHE_FIELDS[key]}")

    def check_trace(self, trace: Trace) -> None:
        """Raise ``ValueError`` if ``trace`` is too short for the main run's windows."""
        steady = len(trace.steady)
        if not self.windows_fit(steady, [*self.batch_sizes, max(self.batch_sizes)]):
            raise ValueError(f"the trace's {steady} steady-state requests ({self.trace.num_users} users) are too few "
                             f"for the measured windows ({self.window_requests} requests per batch size over "
                             f"{self.window_strata} stretches, plus priming): use more --users or a smaller --window")

    def windows_fit(self, steady: int, sizes: list[int], cursor: int = 0) -> bool:
        """Whether :meth:`BenchRun.windows` at batch ``sizes``, from steady request ``cursor`` on, fits in ``steady``
        steady-state requests: each stratum's windows (and the first's priming batches) end before the next starts."""
        per = self.window_requests // self.window_strata
        for k in range(self.window_strata):
            start = k * steady // self.window_strata
            if start < cursor:
                return False
            cursor = start + len(sizes) * per + (self.prime_batches * sum(sizes) if k == 0 else 0)
        return cursor <= steady


def quick_settings() -> BenchSettings:
    """A CPU-sized run (tiny float32 model, few users): exercises every part in seconds."""
    model = ModelConfig(num_items=5000, num_actions=16, d_model=32, num_layers=2, num_heads=2, head_dim=16,
                        max_history_len=2048, max_candidates=16, num_tasks=3, dtype="float32")
    trace = TraceConfig(num_users=16, mean_log_len=4.5, sigma_log_len=0.4, max_history_len=2048, num_candidates=8,
                        num_items=5000, num_actions=16, horizon_s=600, new_fraction=(0.3, 0.5))
    # Each sweep includes the default, so that the default configuration's windows are pooled.
    return BenchSettings(model=model, trace=trace, device="cpu", backend="torch_ref", gpu_pages=40, page_size=8,
                         chunk_tokens=32, host_budget_bytes=2**26, max_batched_tokens=1024, window_requests=16,
                         window_strata=2, chunk_sweep=(16, 32), budget_sweep=(24, 40), lengths=(32, 128),
                         new_events=4, drift_history=100, cold_history=100, cold_visits=4,
                         simulation_workers=0, prime_batches=1)


def engine_config(settings: BenchSettings, cache: CacheConfig, max_batch: int) -> EngineConfig:
    """The engine configuration of a benchmark engine with ``cache``, serving batches of up to ``max_batch``."""
    return EngineConfig(model=settings.model, cache=cache, device=settings.device, attention_backend=settings.backend,
                        scheduler=SchedulerConfig(max_num_seqs=max_batch,
                                                  max_num_batched_tokens=settings.max_batched_tokens))


def cache_config(settings: BenchSettings, mode: str, **changes: object) -> CacheConfig:
    """The cache configuration of ``mode``: ``settings``' pages, chunks, host budget and dtype, then its ``cache``
    fields (``--cache KEY=VALUE``), then ``changes`` (a sweep's value)."""
    fields = dict(mode=mode, page_size=settings.page_size, num_gpu_pages=settings.gpu_pages,
                  chunk_tokens=settings.chunk_tokens, host_budget_bytes=settings.host_budget_bytes,
                  host_dtype=settings.host_dtype)
    return CacheConfig(**(fields | dict(settings.cache) | changes))


def unlimited_pages(settings: BenchSettings, trace: Trace) -> int:
    """Pages for every user's whole history, plus room for one batch of scratch."""
    per_user = [-(-len(u.item_ids) // settings.page_size) for u in trace.users]
    return sum(per_user) + max(settings.batch_sizes) * max(per_user)


def _spread(values: np.ndarray, suffix: str = "", percentiles: tuple[int, ...] = (90,)) -> dict[str, float | None]:
    """Median, mean, ``percentiles`` (``p90``, ...) and max of ``values``, keys suffixed ``suffix``; ``None``s if
    empty."""
    stats = ({"median": np.median, "mean": np.mean} | {f"p{q}": lambda v, q=q: np.percentile(v, q) for q in percentiles}
             | {"max": np.max})
    return {name + suffix: float(f(values)) if len(values) else None for name, f in stats.items()}


@dataclass
class Phase:
    """Timing of a group of batches: per-batch latencies (s), cache counters accumulated over them."""

    latencies: list[float] = field(default_factory=list)
    history_tokens: int = 0
    gpu_hits: int = 0
    host_hits: int = 0
    onloaded_bytes: list[int] = field(default_factory=list)  # per batch
    phase_seconds: dict[str, float] = field(default_factory=dict)
    host_seconds: list[float] = field(default_factory=list)  # per batch, the host time of its HOST_PHASES
    steps: int = 0
    gc_seconds: float = 0.0
    stalls: int = 0  # kernel compilations and cache loads, graph captures (GREngine.stalls): 0 after warm-up
    flops: float = 0.0  # model FLOPs of the computed tokens (flops.step_flops)

    def report(self) -> dict:
        """The phase's summary: batch latency spread (ms), per-step phase times, hit ratios, bytes moved, FLOPs."""
        lat = np.asarray(self.latencies) * 1e3
        batches, steps, tokens = max(len(lat), 1), max(self.steps, 1), max(self.history_tokens, 1)
        # Heavy-tailed: mean and p99 beside the median; per batch latency and bytes, in order (same batches per mode)
        return {"batches": len(lat), **_spread(lat, "_ms", (90, 99)),
                "gpu_hit_ratio": self.gpu_hits / tokens, "total_hit_ratio": (self.gpu_hits + self.host_hits) / tokens,
                "onloaded_bytes_per_batch": sum(self.onloaded_bytes) / batches,
                "steps_per_batch": self.steps / batches, "gc_ms_per_batch": self.gc_seconds / batches * 1e3,
                "stalls": self.stalls, "model_tflop_per_batch": self.flops / batches / 1e12,
                "phase_ms_per_step": {k: v / steps * 1e3 for k, v in self.phase_seconds.items()},
                "phase_ms_per_batch": {k: v / batches * 1e3 for k, v in self.phase_seconds.items()},
                "host_ms_per_batch": _spread(np.asarray(self.host_seconds) * 1e3),
                "batch_latency_ms": [round(float(v), 4) for v in lat],
                "batch_onloaded_bytes": list(self.onloaded_bytes)}


class BenchRun:
    """One engine over one trace: warm-up, fast-forward, measured windows."""

    def __init__(self, settings: BenchSettings, trace: Trace, cache: CacheConfig, max_batch: int,
                 host_memory: torch.Tensor | None = None, model: GRModel | None = None) -> None:
        self.settings, self.trace = settings, trace
        config = engine_config(settings, cache, max_batch)
        t0 = time.perf_counter()
        self.engine = GREngine(config, host_memory=host_memory, model=model)
        if self.engine.kv.host is not None:
            self.engine.kv.host.store.wait_until_allocated()
        self.engine.warmup(use_tqdm=False)
        self.startup_s = time.perf_counter() - t0
        self.steady, self.cursor = trace.steady, 0
        self._hashes: dict[int, np.ndarray] = {}

    def warmup(self) -> dict:
        """Serve every user's first visit, 8 at a time."""
        phase = self._serve([self.trace.rank_request(i) for i in self.trace.warmup], 8)
        return {**phase.report(), "seconds": float(sum(phase.latencies)), "history_tokens": phase.history_tokens}

    def fast_forward(self, count: int) -> None:
        """Move the cache state over the next ``count`` steady requests through the scheduler and cache manager,
        without the model; the intake then knows each user's last history, as after serving them."""
        engine, trace = self.engine, self.trace
        indices = self.steady[self.cursor:self.cursor + count]
        for i in indices:
            r = trace.requests[i]
            engine.scheduler.add(RequestState(seq_id=i, user_id=r.user, num_history=r.history_len,
                                              num_candidates=trace.config.num_candidates, reuse_limit=r.history_len,
                                              token_hashes=self._user_hashes(r.user)[: r.history_len]))
        host = engine.kv.host
        while engine.scheduler.num_unfinished:
            if host is not None:  # with no forward to pace it, this loop must not outrun the copies
                host.poll(wait=True)
            plan = engine.scheduler.schedule()
            engine.kv.launch_onloads()
            engine.scheduler.complete(plan.chunks)
            engine.kv.end_step()
        last = {trace.requests[i].user: trace.requests[i] for i in indices}
        for r in last.values():  # each user's last: the intake reuses its hashes next time
            e, n = trace.users[r.user], r.history_len
            engine.intake.hasher.remember(r.user, e.item_ids[:n], e.action_ids[:n], e.timestamps[:n],
                                          self._user_hashes(r.user)[:n])
        if host is not None:
            host.poll(wait=True)
        self.cursor += count

    def windows(self, plan: list[tuple[int, bool]]) -> list[dict]:
        """The measured windows (docs/design.md section 8): at each of ``window_strata`` evenly spaced points of the
        steady requests (fast-forwarded there; recompute skips), for each ``(batch_size, sync_phases)`` of ``plan``,
        ``window_requests / window_strata`` requests in closed-loop batches (device-synchronised phase times if
        ``sync_phases``), after ``prime_batches`` unmeasured batches at the first point. Returns a report per entry."""
        settings, steady = self.settings, self.steady
        per = settings.window_requests // settings.window_strata
        if any(per % bs for bs, _ in plan) or per == 0:
            raise ValueError(f"window_requests / window_strata = {per} is not a multiple of every batch size")
        if not settings.windows_fit(len(steady), [bs for bs, _ in plan], self.cursor):
            raise ValueError("the trace has too few steady-state requests for the windows")
        phases = [Phase() for _ in plan]
        for k in range(settings.window_strata):
            start = k * len(steady) // settings.window_strata
            if self.engine.config.cache.mode == "recompute":
                self.cursor = start
            else:
                self.fast_forward(start - self.cursor)
            for (bs, sync), phase in zip(plan, phases, strict=True):
                prime = settings.prime_batches * bs if k == 0 else 0
                indices = steady[self.cursor:self.cursor + prime + per]
                self.cursor += len(indices)
                self.engine.config = msgspec.structs.replace(self.engine.config, sync_phases=sync)
                self._serve([self.trace.rank_request(i) for i in indices[:prime]], bs)
                requests = [self.trace.rank_request(i) for i in indices[prime:]]
                gc.collect()
                gc.freeze()  # every object alive now is exempt from later collections (until close)
                self._serve(requests, bs, phase)
        self.engine.config = msgspec.structs.replace(self.engine.config, sync_phases=False)
        return [phase.report() for phase in phases]

    def _serve(self, requests: list[RankRequest], batch_size: int, phase: Phase | None = None) -> Phase:
        """Serve ``requests`` in closed-loop batches; their timings and counters are added to ``phase``."""
        engine, phase = self.engine, phase if phase is not None else Phase()
        engine.scheduler.config = msgspec.structs.replace(engine.scheduler.config, max_num_seqs=batch_size)
        clock = _GcClock()
        gc.callbacks.append(clock)
        try:
            for start in range(0, len(requests), batch_size):
                batch = requests[start:start + batch_size]
                steps, onloaded, stalls = engine.stats.num_steps, engine.kv.stats.onloaded_bytes, engine.stalls()
                phases = dict(engine.stats.phase_seconds)
                _sync(engine)
                gc_before, t0 = clock.seconds, time.perf_counter()
                outputs = engine.rank(batch, use_tqdm=False)
                _sync(engine)
                phase.latencies.append(time.perf_counter() - t0)
                phase.gc_seconds += clock.seconds - gc_before
                failed = [o.error for o in outputs if o.error]
                if failed:
                    raise RuntimeError(f"benchmark request failed: {failed[0]}")
                phase.history_tokens += sum(len(r.item_ids) for r in batch)
                phase.flops += step_flops(engine.config.model,
                                          [o.num_gpu_cached_tokens + o.num_host_cached_tokens for o in outputs],
                                          [len(r.item_ids) for r in batch], [len(r.candidate_item_ids) for r in batch])
                phase.gpu_hits += sum(o.num_gpu_cached_tokens for o in outputs)
                phase.host_hits += sum(o.num_host_cached_tokens for o in outputs)
                phase.onloaded_bytes.append(engine.kv.stats.onloaded_bytes - onloaded)
                phase.steps += engine.stats.num_steps - steps
                phase.stalls += sum(astuple(engine.stalls())) - sum(astuple(stalls))
                host = 0.0
                for name, seconds in engine.stats.phase_seconds.items():
                    spent = seconds - phases.get(name, 0.0)
                    phase.phase_seconds[name] = phase.phase_seconds.get(name, 0.0) + spent
                    host += spent if name in HOST_PHASES else 0.0
                phase.host_seconds.append(host)
        finally:
            gc.callbacks.remove(clock)
        return phase

    def _user_hashes(self, user: int) -> np.ndarray:
        if user not in self._hashes:
            e = self.trace.users[user]
            self._hashes[user] = page_prefix_hashes(e.item_ids, e.action_ids, e.timestamps, self.settings.page_size)
        return self._hashes[user]

    def close(self) -> None:
        """Finish transfers and give the engine's device memory back (the next run may need all of it)."""
        self.engine.close()
        device = self.engine.device
        del self.engine
        gc.unfreeze()  # what the windows froze may now be garbage
        gc.collect()  # reference cycles (graphs, closures) would otherwise keep the pool alive a while
        if device.type == "cuda":
            torch.cuda.empty_cache()


class _GcClock:
    """A ``gc.callbacks`` entry that adds up the cyclic garbage collector's pauses (``seconds``)."""

    def __init__(self) -> None:
        self.seconds = self._start = 0.0

    def __call__(self, stage: str, info: dict) -> None:
        if stage == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


def _sync(engine: GREngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
