"""Cache-policy simulation: the engine's scheduler and KV cache manager over a trace, without the model.

Hit ratios depend only on the policy (which users' KV is where), not on the KV values, so the same
``Scheduler`` and ``KVCacheManager`` code runs here with a one-value-per-token KV pool on the CPU. This
is how the trace is calibrated and how hit ratios over the whole trace are computed quickly; latencies
come from real runs on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import torch
from tqdm.auto import tqdm

from cache_engine import CacheConfig, KVCacheManager, page_prefix_hashes
from scheduler import RequestState, Scheduler, SchedulerConfig

from .trace import Trace


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
