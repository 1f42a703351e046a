"""``gr-engine demo``: returning users served by each cache mode, on CPU, with a tiny random model.

The same request stream runs under ``recompute``, ``gpu_only`` (a GPU pool too small for everyone, so users are
evicted and recomputed), ``hierarchical`` (the same GPU pool, plus host chunks that keep evicted users) and
``unlimited``; the table shows time per request, speedup over recompute, the history-token hit ratio and the largest
score difference from recompute (caching must not change scores).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from .config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from .engine import GREngine, build_engine
from .synthetic import synthetic_requests


@dataclass
class ModeResult:
    """One mode's run: wall seconds, ms per request, hit ratio, evictions, max |score - recompute|."""

    mode: str
    seconds: float
    ms_per_request: float
    hit_ratio: float
    evicted_users: int
    max_abs_diff: float


def demo_config() -> EngineConfig:
    """A tiny float32 model on CPU (width 64, 2 layers); :func:`run_demo` sizes each mode's GPU pool."""
    model = ModelConfig(num_items=5000, num_actions=16, d_model=64, num_layers=2, num_heads=2, head_dim=32,
                        max_history_len=2048, max_candidates=64, num_tasks=3, seed=0)
    return EngineConfig(model=model, cache=CacheConfig(page_size=32, num_gpu_pages=4096, host_budget_bytes=2**29),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048), device="cpu")


def run_demo(config: EngineConfig | None = None, num_users: int = 32, visits_per_user: int = 6,
             seed: int = 0, gpu_only_pages: int | None = None,
             echo: Callable[[str], None] = print) -> list[ModeResult]:
    """Run the demo stream under every mode and print a table.

    Args:
        config: base configuration (default :func:`demo_config`); its cache mode is overridden.
        num_users, visits_per_user, seed: the synthetic stream (:func:`synthetic_requests`).
        gpu_only_pages: GPU pool pages in ``gpu_only`` and ``hierarchical`` modes; default: room for about
            half the users.
        echo: where lines are printed.

    Raises:
        ValueError: an engine cannot be built on this machine, or a mode's engine fails a request (the stream fits
            the model: the configuration cannot serve it, e.g. a GPU pool smaller than a history).
    """
    config = config or demo_config()
    requests = synthetic_requests(config.model, num_users, visits_per_user, first_history=(200, 1200),
                                  new_events=(4, 24), num_candidates=(16, 64), seed=seed)
    longest = max(len(r.item_ids) for r in requests)
    pages_per_user = -(-longest // config.cache.page_size)
    if gpu_only_pages is None:
        gpu_only_pages = max(pages_per_user * config.scheduler.max_num_seqs, pages_per_user * num_users // 2)
    pools = {"recompute": config.cache.num_gpu_pages, "gpu_only": gpu_only_pages, "hierarchical": gpu_only_pages,
             "unlimited": max(config.cache.num_gpu_pages, pages_per_user * (num_users + 1))}
    echo(f"demo: {num_users} users x {visits_per_user} visits = {len(requests)} requests, "
         f"model d={config.model.d_model} L={config.model.num_layers}, device={config.device}")
    results, reference = [], None
    for mode, pages in pools.items():
        cfg = msgspec.structs.replace(config, cache=msgspec.structs.replace(
            config.cache, mode=mode, num_gpu_pages=pages))
        engine = build_engine(cfg)
        engine.rank(requests[: config.scheduler.max_num_seqs], use_tqdm=False)  # warm-up
        engine = GREngine(cfg)
        t0 = time.perf_counter()
        outputs = engine.rank(requests, use_tqdm=False)
        seconds = time.perf_counter() - t0
        errors = [o.error for o in outputs if o.error]
        if errors:  # the demo's requests fit its model: the configuration cannot serve them
            raise ValueError(f"demo requests failed in {mode} mode: {errors[0]}")
        scores = np.concatenate([np.asarray(o.scores) for o in outputs])
        reference = scores if reference is None else reference
        results.append(ModeResult(mode, seconds, 1e3 * seconds / len(requests), engine.stats.total_hit_ratio,
                                  engine.kv.stats.evicted_users, float(np.abs(scores - reference).max())))
    base = results[0].seconds
    echo(f"{'mode':<12} {'pages':>6} {'ms/request':>11} {'speedup':>8} {'token hit':>10} {'evicted':>8} "
         f"{'max|diff|':>10}")
    for r in results:
        echo(f"{r.mode:<12} {pools[r.mode]:>6} {r.ms_per_request:>11.2f} {base / r.seconds:>7.2f}x "
             f"{r.hit_ratio:>9.1%} {r.evicted_users:>8} {r.max_abs_diff:>10.1e}")
    return results
