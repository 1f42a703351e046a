"""Retrieval: the items each user is most likely to engage with next.

Run: python examples/generate.py
"""

from __future__ import annotations

import numpy as np

from gr_engine import EngineConfig, GenerateParams, GenerateRequest, GREngine, ModelConfig

engine = GREngine(EngineConfig(model=ModelConfig(num_items=5_000, max_history_len=1024)))
rng = np.random.default_rng(1)
requests = []
for user in range(4):
    n = int(rng.integers(50, 500))
    requests.append(GenerateRequest(request_id=f"user-{user}", user_id=user,
                                    item_ids=rng.integers(0, 5_000, n).tolist(),
                                    action_ids=rng.integers(0, 16, n).tolist(), timestamps=list(range(n))))

for output in engine.generate(requests, GenerateParams(top_k=5, exclude_history=True), use_tqdm=False):
    items = ", ".join(f"{i} ({s:.2f})" for i, s in zip(output.item_ids, output.scores))
    print(f"{output.request_id}: {items}")

# A second visit with a few new events reuses the cached history: only the new events are encoded.
again = [GenerateRequest(request_id=r.request_id + "-again", user_id=r.user_id, item_ids=r.item_ids + [7, 8],
                         action_ids=r.action_ids + [1, 1], timestamps=r.timestamps + [10**6, 10**6])
         for r in requests]
for output in engine.generate(again, GenerateParams(top_k=5), use_tqdm=False):
    print(f"{output.request_id}: {output.num_gpu_cached_tokens} cached, {output.num_computed_tokens} encoded, "
          f"top item {output.item_ids[0]}")
