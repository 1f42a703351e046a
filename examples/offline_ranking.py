"""Offline ranking of returning users with a persistent per-user KV cache.

Run: python examples/offline_ranking.py
Two "days" of traffic from the same users: on day 2 only the events added since day 1 are encoded;
the scores equal a cache-less engine's.
"""

from __future__ import annotations

import numpy as np

from gr_engine import CacheConfig, EngineConfig, GREngine, ModelConfig, RankRequest

config = EngineConfig(
    model=ModelConfig(num_items=10_000, num_actions=16, d_model=64, num_layers=2, num_heads=2, head_dim=32,
                      max_history_len=2048, max_candidates=100),
    cache=CacheConfig(mode="gpu_only", page_size=32, num_gpu_pages=2048),
)
engine = GREngine(config)
rng = np.random.default_rng(0)
users = {u: rng.integers(0, 10_000, 1200) for u in range(16)}  # each user's full event stream


def day(visible: int, tag: str) -> list[RankRequest]:
    return [RankRequest(request_id=f"{tag}-{u}", user_id=u, item_ids=events[:visible].tolist(),
                        action_ids=(events[:visible] % 16).tolist(), timestamps=list(range(visible)),
                        candidate_item_ids=rng.integers(0, 10_000, 100).tolist())
            for u, events in users.items()]


engine.rank(day(1000, "day1"))
day2 = day(1040, "day2")
outputs = engine.rank(day2)
cached = sum(o.num_gpu_cached_tokens for o in outputs)
computed = sum(o.num_computed_tokens for o in outputs)
print(f"day 2: {cached} history tokens from cache, {computed} encoded")
print(f"user 0, best candidate for task 0: {int(np.argmax(np.asarray(outputs[0].scores)[:, 0]))}")

reference = GREngine(EngineConfig(model=config.model, cache=CacheConfig(mode="recompute"))).rank(day2, use_tqdm=False)
diff = max(np.abs(np.asarray(a.scores) - np.asarray(b.scores)).max() for a, b in zip(outputs, reference))
print(f"max |cached - recomputed| score difference: {diff:.1e}")
