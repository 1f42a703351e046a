"""Host time of each engine phase for benchmark-sized requests, on the CPU, without a GPU.

    python benchmarks/host_overhead.py [--mode unlimited] [--batches 50] [--profile]

The engine runs on the CPU with the ``torch_ref`` backend and a model of the benchmark's depth and
vocabularies but tiny widths, so that the forward pass is cheap-ish and what remains is the host work that
also runs in front of a GPU: intake (validation, prefix hashes), schedule, prepare (cache lookup, page
tables), strip, score and commit. 32 users with 3,000-9,000-event histories return in batches of 8 with 8
new events and 100 candidates each; the heap is frozen after the first visits, as in the benchmark. Prints
the median batch's phase times (ms); ``--profile`` adds a cProfile of the whole loop. A dev-box probe for
intake, schedule, score and commit: the GPU machine's host runs the same Python about 3x slower, and there
prepare and strip build ``hstu_triton``'s plan and stage the step for CUDA graphs, which this CPU run does
not exercise (its prepare is ``torch_ref``'s metadata).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats

import numpy as np

from gr_engine import CacheConfig, EngineConfig, GREngine, ModelConfig, RankRequest, SchedulerConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="unlimited", choices=["gpu_only", "hierarchical", "unlimited"])
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    model = ModelConfig(num_items=1_000_000, num_actions=256, d_model=16, num_layers=8, num_heads=1, head_dim=16,
                        max_history_len=20_000, max_candidates=100, num_tasks=8, ranking_hidden=16, dtype="float32")
    config = EngineConfig(model=model, device="cpu", attention_backend="torch_ref",
                          cache=CacheConfig(mode=args.mode, num_gpu_pages=40_000, page_size=32,
                                            host_budget_bytes=2**30),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=163_840))
    engine = GREngine(config)
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
    host = [sum(v for k, v in p.items() if k not in ("forward", "score")) for p in per_batch]
    median = per_batch[int(np.argsort(host)[len(host) // 2])]
    print(f"{args.mode}, batches of 8: host phases (ms) of the median batch: "
          f"{ {k: round(v, 3) for k, v in median.items()} }, sum without forward and score "
          f"{np.median(host):.3f}")
    if args.profile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
