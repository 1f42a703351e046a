"""Engine latency smoke test on the benchmark model (8 layers, d 512, 4 heads x 128, bf16, hstu_triton).

    python benchmarks/engine_smoke.py --out engine_smoke.json

8 users with ~6,375-event histories; after their first visit, each batch of 8 returning requests adds
4 events per user. Reports the median batch latency of recompute vs unlimited (every history token a
GPU hit; with CUDA graphs, the default, and without) and the per-phase host times, measured in the same
run. A quick probe, not the full benchmark.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from gr_engine import CacheConfig, EngineConfig, GREngine, ModelConfig, RankRequest, SchedulerConfig


def requests(rng, lengths, extra, tag):
    """Each user's first ``length + extra`` events of a fixed stream, plus 100 fresh candidates."""
    out = []
    for u, n in enumerate(lengths):
        m = n + extra
        g = np.random.default_rng(u)
        items, actions = g.integers(0, 100_000, 30_000), g.integers(0, 256, 30_000)
        out.append(RankRequest(request_id=f"{tag}-{u}", user_id=u, item_ids=items[:m], action_ids=actions[:m],
                               timestamps=np.arange(m), candidate_item_ids=rng.integers(0, 100_000, 100)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="hstu_triton")
    parser.add_argument("--commit", default=None, help="commit id to record (the device copy has no .git)")
    args = parser.parse_args()
    model = ModelConfig(num_items=100_000, num_actions=256, d_model=512, num_layers=8, num_heads=4, head_dim=128,
                        max_history_len=20_000, max_candidates=100, num_tasks=8, ranking_hidden=512, dtype="bfloat16")
    rng = np.random.default_rng(0)
    lengths = rng.integers(5000, 7800, 8)
    result = {"gpu": torch.cuda.get_device_name(), "commit": args.commit or "unknown",
              "command": "python benchmarks/engine_smoke.py --out " + args.out, "lengths": lengths.tolist()}
    for name, mode, graph_rows in (("recompute", "recompute", 4096), ("unlimited", "unlimited", 4096),
                                   ("unlimited_eager", "unlimited", 0)):
        config = EngineConfig(model=model, device="cuda", attention_backend=args.backend,
                              cuda_graph_max_rows=graph_rows,
                              cache=CacheConfig(mode=mode, num_gpu_pages=4096),
                              scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=65_536,
                                                        max_chunk_tokens=20_000))
        engine = GREngine(config)
        engine.rank(requests(rng, lengths, 0, "warm"), use_tqdm=False)
        times = []
        for step in range(1, 16):
            batch = requests(rng, lengths, 4 * step, f"s{step}")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = engine.rank(batch, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            assert all(o.error is None for o in outs), outs[0].error
        n = engine.stats.num_steps
        graphs = engine.runner.graphs
        result[name] = {"median_batch_ms": float(np.median(times[3:]) * 1e3),
                        "phase_ms_per_step": {k: v / n * 1e3 for k, v in engine.stats.phase_seconds.items()},
                        "gpu_hit_ratio": engine.stats.gpu_hit_ratio,
                        "graph_replays": graphs.num_replays if graphs else 0, "steps": n}
        print(name, json.dumps(result[name]), flush=True)
        del engine
        torch.cuda.empty_cache()
    result["speedup"] = result["recompute"]["median_batch_ms"] / result["unlimited"]["median_batch_ms"]
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
