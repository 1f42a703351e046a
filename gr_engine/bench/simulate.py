"""Cache-policy simulation: the engine's scheduler and KV cache manager over a trace, without the model.

Hit ratios depend only on the policy (which users' KV is where), not on the KV values, so the same
``Scheduler`` and ``KVCacheManager`` code runs here with a one-value-per-token KV pool on the CPU. This
is how the trace is calibrated and how hit ratios over the whole trace are computed quickly; latencies
come from real runs on the GPU.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
from tqdm.auto import tqdm

from cache_engine import CacheConfig, KVCacheManager, page_prefix_hashes
from scheduler import RequestState, Scheduler, SchedulerConfig

from .trace import Trace, TraceConfig, generate_trace


@dataclass
class PolicyResult:
    """Token hit ratios of the steady state (first visits excluded) and cache counters."""

    gpu_hit_ratio: float
    total_hit_ratio: float
    steady_history_tokens: int
    evicted_users: int
    host_evicted_users: int
    lost_tokens: int
    tail_persisted_tokens: int


def simulate_policy(trace: Trace, cache: CacheConfig, max_num_seqs: int = 8, max_num_batched_tokens: int = 65_536,
                    use_tqdm: bool = False) -> PolicyResult:
    """Run ``trace`` through the scheduler and cache manager (no model) and measure hit ratios.

    Args:
        trace: the requests.
        cache: the cache configuration to evaluate; ``host_budget_bytes`` is interpreted for the
            benchmark model's KV size (8 layers, 4 heads x 128, bf16: 16 KiB per token).
        max_num_seqs, max_num_batched_tokens: the scheduler's limits.
    """
    real_token_bytes = 8 * 2 * 4 * 128 * 2
    sim_token_bytes = 1 * 2 * 1 * 1 * 2  # the simulated pool: 1 layer, 1 head, 1 dim, fp16
    sim_cache = msgspec.structs.replace(
        cache, host_budget_bytes=cache.host_budget_bytes // real_token_bytes * sim_token_bytes,
        host_segment_bytes=max(1, cache.host_segment_bytes // real_token_bytes * sim_token_bytes))
    kv = KVCacheManager(sim_cache, num_layers=1, num_heads=1, head_dim=1, dtype=torch.float16, device="cpu")
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens), kv)
    hashes = [page_prefix_hashes(u.item_ids, u.action_ids, u.timestamps, cache.page_size) for u in trace.users]
    for seq, r in enumerate(trace.requests):
        scheduler.add(RequestState(seq_id=seq, user_id=r.user, num_history=r.history_len,
                                   num_candidates=trace.config.num_candidates, reuse_limit=r.history_len,
                                   token_hashes=hashes[r.user][: r.history_len], payload=r.warmup))
    totals = np.zeros(3, dtype=np.int64)  # steady history tokens, GPU hits, host hits
    with tqdm(total=len(trace.requests), disable=not use_tqdm, desc="Simulating", unit="req") as bar:
        while scheduler.num_unfinished:
            kv.begin_step()
            plan = scheduler.schedule()
            for state in plan.admitted:
                if not state.payload:
                    totals += (state.num_history, state.num_gpu_hits, state.num_host_hits)
            kv.launch_onloads()
            bar.update(len(scheduler.complete(plan.chunks)))
            kv.end_step()
    kv.close()
    tokens = max(int(totals[0]), 1)
    s = kv.stats
    return PolicyResult(float(totals[1] / tokens), float((totals[1] + totals[2]) / tokens), int(totals[0]),
                        s.evicted_users, s.host_evicted_users, s.lost_tokens, s.tail_persisted_tokens)


def _simulated(trace: Trace, cache: CacheConfig) -> dict:
    r = simulate_policy(trace, cache)
    return {"gpu_hit_ratio": r.gpu_hit_ratio, "total_hit_ratio": r.total_hit_ratio, "lost_tokens": r.lost_tokens,
            "evicted_users": r.evicted_users, "host_evicted_users": r.host_evicted_users}


def _background_worker() -> None:
    """Simulation workers keep torch to one thread each."""
    torch.set_num_threads(1)


def _simulate_in_worker(trace_config: TraceConfig, cache: CacheConfig) -> dict:
    return _simulated(generate_trace(trace_config), cache)


class Simulations:
    """Whole-trace policy simulations (:func:`simulate_policy`) of several cache configurations, run in up to
    ``workers`` spawned processes (inline when ``workers`` is 0). The benchmark runs them after its measurements,
    so that they never share the CPU with a measured engine."""

    def __init__(self, trace: Trace, caches: list[CacheConfig], workers: int) -> None:
        self._results: dict[bytes, dict] = {}
        self._futures: dict[bytes, concurrent.futures.Future] = {}
        self._pool = None
        if workers:
            context = multiprocessing.get_context("spawn")  # a clean process: no CUDA state is inherited
            self._pool = concurrent.futures.ProcessPoolExecutor(min(workers, len(caches)), mp_context=context,
                                                                initializer=_background_worker)
            for cache in caches:
                self._futures[msgspec.json.encode(cache)] = self._pool.submit(_simulate_in_worker, trace.config, cache)
        else:
            for cache in caches:
                self._results[msgspec.json.encode(cache)] = _simulated(trace, cache)

    def get(self, cache: CacheConfig) -> dict:
        """The simulated hit ratios of ``cache`` (one of the configurations given at creation), waiting for them."""
        key = msgspec.json.encode(cache)
        if key not in self._results:
            self._results[key] = self._futures[key].result()
        return self._results[key]

    def close(self) -> None:
        """Stop the worker processes (after every :meth:`get`)."""
        if self._pool is not None:
            self._pool.shutdown()
