"""Where a batch of 8 returning users spends its time on the GPU machine: host (cProfile) and device
(torch.profiler kernel table), for the engine probe's setup (:mod:`engine_smoke`).

    python benchmarks/profile_step.py --out profile_dir [--mode unlimited]

Writes ``host_<mode>.txt`` (cProfile, top functions by own time), ``device_<mode>.txt`` (kernels by total
device time) and ``timeline_<mode>.json`` (a Chrome trace) into ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import numpy as np
import torch
from engine_smoke import requests

from gr_engine import CacheConfig, EngineConfig, GREngine, ModelConfig, SchedulerConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", default="unlimited")
    parser.add_argument("--graph-rows", type=int, default=4096)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = ModelConfig(num_items=100_000, num_actions=256, d_model=512, num_layers=8, num_heads=4, head_dim=128,
                        max_history_len=20_000, max_candidates=100, num_tasks=8, ranking_hidden=512, dtype="bfloat16")
    config = EngineConfig(model=model, device="cuda", attention_backend="hstu_triton",
                          cuda_graph_max_rows=args.graph_rows, cache=CacheConfig(mode=args.mode, num_gpu_pages=4096),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=65_536,
                                                    max_chunk_tokens=20_000))
    rng = np.random.default_rng(0)
    lengths = rng.integers(5000, 7800, 8)
    engine = GREngine(config)
    engine.rank(requests(rng, lengths, 0, "warm"), use_tqdm=False)
    step = 0

    def batch():
        nonlocal step
        step += 1
        return requests(rng, lengths, 4 * step, f"s{step}")

    for _ in range(4):
        engine.rank(batch(), use_tqdm=False)
    batches = [batch() for _ in range(20)]
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for b in batches:
        engine.rank(b, use_tqdm=False)
    profiler.disable()
    torch.cuda.synchronize()
    print(f"{args.mode}: {(time.perf_counter() - t0) / len(batches) * 1e3:.2f} ms per batch under cProfile")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(45)
    (out / f"host_{args.mode}.txt").write_text(text.getvalue())
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            engine.rank(batch(), use_tqdm=False)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    (out / f"device_{args.mode}.txt").write_text(table)
    prof.export_chrome_trace(str(out / f"timeline_{args.mode}.json"))
    print(table[:6000])


if __name__ == "__main__":
    main()
