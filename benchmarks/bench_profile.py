"""Where the benchmark's engines spend host time at batch size 8 (a diagnostic for ``gr-engine bench``).

    python benchmarks/bench_profile.py --out profile_dir [--modes hierarchical unlimited] [--batches 30]

For each mode, builds the benchmark's engine on its trace (FP8 host chunks, the kernel onload engine,
a smaller host pool than the benchmark's to keep start-up short), serves the warm-up and fast-forwards to
the measured point like ``gr-engine bench``, then serves ``--batches`` batches of 8 under cProfile.
Writes ``host_<mode>.txt`` (top functions by own time, then by cumulative time) into ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from pathlib import Path

from gr_engine.bench.runner import BenchSettings, steady_state_runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--modes", nargs="+", default=["hierarchical", "unlimited"])
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--host-budget-gib", type=int, default=24)
    parser.add_argument("--prime", type=int, default=40, help="unprofiled batches first (compilation, graph capture)")
    parser.add_argument("--rows", type=int, default=150, help="functions listed per ordering")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = BenchSettings(simulation_workers=0, host_dtype="float8_e4m3fn", onload_engine="kernel",
                             host_budget_bytes=args.host_budget_gib * 2**30, modes=tuple(args.modes))
    for mode, run in steady_state_runs(settings, args.prime):  # compiled and captured outside the profile
        profiler = cProfile.Profile()
        profiler.enable()
        report = run.window(8, 8 * args.batches, prime_batches=0)
        profiler.disable()
        text = io.StringIO()
        text.write(f"# {mode}, bs=8, {args.batches} batches: median {report['median_ms']:.2f} ms (under cProfile), "
                   f"phases ms/batch {({k: round(v, 3) for k, v in report['phase_ms_per_batch'].items()})}\n")
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(args.rows)
        stats.sort_stats("cumulative").print_stats(args.rows)
        (out / f"host_{mode}.txt").write_text(text.getvalue())
        print(text.getvalue().splitlines()[0], flush=True)


if __name__ == "__main__":
    main()
