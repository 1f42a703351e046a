"""Per-batch timings of the benchmark's own engines on its own trace (a diagnostic for ``gr-engine bench``).

    python benchmarks/bench_probe.py [--batches 12]

For recompute at batch sizes 1 and 8, with CUDA graphs and without, prints each batch's latency, its steps,
rows and the device-synchronised time of every phase, and the graphs captured so far.
"""

from __future__ import annotations

import argparse
import time

import torch

from gr_engine.bench.runner import BenchRun, BenchSettings, cache_config
from gr_engine.bench.trace import generate_trace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=12)
    args = parser.parse_args()
    settings = BenchSettings(simulation_workers=0)
    trace = generate_trace(settings.trace)
    skip = len(trace.steady) // 2
    for graphs in (True, False):
        run = BenchRun(settings, trace, cache_config(settings, "recompute"), 8)
        run.cursor = skip
        if not graphs:
            run.engine.runner.graphs = None
        run.set_sync_phases(True)
        engine = run.engine
        for bs in (1, 8):
            for _ in range(args.batches):
                batch = [trace.rank_request(i) for i in run.steady[run.cursor:run.cursor + bs]]
                run.cursor += bs
                steps, phases = engine.stats.num_steps, dict(engine.stats.phase_seconds)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.rank(batch, use_tqdm=False)
                torch.cuda.synchronize()
                ms = (time.perf_counter() - t0) * 1e3
                deltas = {k: round((v - phases.get(k, 0.0)) * 1e3, 2) for k, v in engine.stats.phase_seconds.items()}
                g = engine.runner.graphs
                print(f"graphs={graphs} bs={bs} {ms:.1f} ms steps={engine.stats.num_steps - steps} "
                      f"hist={[len(r.item_ids) for r in batch]} phases={deltas} "
                      f"captured={g.num_graphs if g else '-'}", flush=True)
        run.close()


if __name__ == "__main__":
    main()
