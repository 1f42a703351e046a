"""Cache-policy simulation: the engine's scheduler and KV cache manager over a trace, without the model.

Hit ratios depend only on the policy, not on K/V values, so the same code runs with a one-value-per-token KV pool on
the CPU: it calibrates the trace and gives whole-trace hit ratios quickly.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing

import msgspec
import numpy as np
import torch

from cache_engine import CacheConfig, KVCacheManager, page_prefix_hashes
from scheduler import RequestState, Scheduler, SchedulerConfig

from .trace import Trace, TraceConfig, generate_trace


@dataclasses.dataclass
class PolicyResult:
    """Token hit ratios of the steady state (first visits excluded) and cache counters."""

    gpu_hit_ratio: float
    total_hit_ratio: float
    lost_tokens: int
    evicted_users: int
    host_evicted_users: int


def simulate_policy(trace: Trace, cache: CacheConfig, per_request: np.ndarray | None = None) -> PolicyResult:
    """Hit ratios of ``trace`` through the scheduler (batches of up to 8 requests, 65,536 tokens) and cache manager.
    ``cache.host_budget_bytes`` counts the benchmark model's KV (8 layers, 4 heads x 128, bf16: 16 KiB per token).
    ``per_request``, if given (int64 ``[len(trace.requests), 3]``), receives each request's history tokens, GPU hits
    and host hits (tokens), first visits included."""
    real_token_bytes = 8 * 2 * 4 * 128 * 2
    sim_token_bytes = 1 * 2 * 1 * 1 * 2  # the simulated pool: 1 layer, 1 head, 1 dim, fp16
    sim_cache = msgspec.structs.replace(
        cache, host_budget_bytes=cache.host_budget_bytes // real_token_bytes * sim_token_bytes,
        host_segment_bytes=max(1, cache.host_segment_bytes // real_token_bytes * sim_token_bytes))
    kv = KVCacheManager(sim_cache, num_layers=1, num_heads=1, head_dim=1, dtype=torch.float16, device="cpu")
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=65_536), kv)
    hashes = [page_prefix_hashes(u.item_ids, u.action_ids, u.timestamps, cache.page_size) for u in trace.users]
    for seq, r in enumerate(trace.requests):
        scheduler.add(RequestState(seq_id=seq, user_id=r.user, num_history=r.history_len,
                                   num_candidates=trace.config.num_candidates, reuse_limit=r.history_len,
                                   token_hashes=hashes[r.user][: r.history_len], payload=r.warmup))
    totals = np.zeros(3, dtype=np.int64)  # steady history tokens, GPU hits, host hits
    while scheduler.num_unfinished:
        kv.begin_step()
        plan = scheduler.schedule()
        for state in plan.admitted:
            if per_request is not None:
                per_request[state.seq_id] = (state.num_history, state.num_gpu_hits, state.num_host_hits)
            if not state.payload:
                totals += (state.num_history, state.num_gpu_hits, state.num_host_hits)
        kv.launch_onloads()
        scheduler.complete(plan.chunks)
        kv.end_step()
    kv.close()
    tokens = max(int(totals[0]), 1)
    return PolicyResult(float(totals[1] / tokens), float((totals[1] + totals[2]) / tokens), kv.stats.lost_tokens,
                        kv.stats.evicted_users, kv.stats.host_evicted_users)


def _simulated(trace: Trace, cache: CacheConfig) -> dict:
    return dataclasses.asdict(simulate_policy(trace, cache))


def _simulate_in_worker(trace_config: TraceConfig, cache: CacheConfig) -> dict:
    torch.set_num_threads(1)  # one thread per worker process
    return _simulated(generate_trace(trace_config), cache)


class Simulations:
    """Whole-trace policy simulations (:func:`simulate_policy`) of several cache configurations, in up to ``workers``
    spawned processes (inline when 0)."""

    def __init__(self, trace: Trace, caches: list[CacheConfig], workers: int) -> None:
        self._pool = None
        if workers:
            context = multiprocessing.get_context("spawn")  # a clean process: no CUDA state is inherited
            self._pool = concurrent.futures.ProcessPoolExecutor(min(workers, len(caches)), mp_context=context)
            self._results = {_key(c): self._pool.submit(_simulate_in_worker, trace.config, c) for c in caches}
        else:
            self._results = {_key(c): _simulated(trace, c) for c in caches}

    def get(self, cache: CacheConfig) -> dict:
        """The simulated hit ratios of ``cache`` (one of the configurations given at creation), waiting for them."""
        result = self._results[_key(cache)]
        return result.result() if isinstance(result, concurrent.futures.Future) else result

    def close(self) -> None:
        """Stop the worker processes (after every :meth:`get`)."""
        if self._pool is not None:
            self._pool.shutdown()


def _key(cache: CacheConfig) -> bytes:
    return msgspec.json.encode(cache)
