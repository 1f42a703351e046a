"""Where the benchmark's engines spend host time at batch size 8 (a diagnostic for ``gr-engine bench``).

    python benchmarks/bench_profile.py --out profile_dir [--modes hierarchical unlimited] [--batches 30]

For each mode, builds the benchmark's engine on its trace (FP8 host chunks, the kernel onload engine,
a smaller host pool than the benchmark's to keep start-up short), serves the warm-up and fast-forwards to
the measured point like ``gr-engine bench``, then serves ``--batches`` batches of 8 under cProfile.
Writes ``host_<mode>.txt`` (top functions by own time, then by cumulative time) into ``--out``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from pathlib import Path

from gr_engine.bench.experiments import steady_state_parser, steady_state_runs, steady_state_settings


def main() -> None:
    parser = steady_state_parser(__doc__.splitlines()[0], batches=30)
    parser.add_argument("--rows", type=int, default=150, help="functions listed per ordering")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = steady_state_settings(args)
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
