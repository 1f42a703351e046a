"""Hierarchical batches against their bound, batch by batch (a diagnostic for ``gr-engine bench``'s
``hier_over_bound_bs8``).

    python benchmarks/bound_probe.py [--batch 8] [--variant prefetch=false] [--out probe.json] [--quick]

Runs the benchmark's hierarchical and unlimited engines over the benchmark's own measured windows at one batch
size (the same batches in both, in the same order) and prints, for each batch: its latency in both modes, the
bytes it onloaded and its latency over its own bound (:func:`~gr_engine.bench.report.batch_bound_ratios`, with the
pinned copy peak measured here first). ``--variant`` measures the hierarchical engine again with some cache fields
changed, in the same process (an A/B on one machine), and prints the median of the per-batch differences. To
compare commits on one machine, run it from each checkout (both must report per-batch latencies).

One run per arm resolves little: two runs of one configuration can differ by a few tenths of a ms a batch on the
H200 (the A/A runs in ``benchmarks/results/README.md``). ``--repeats N`` runs every arm N times, interleaved
(A B A B ...), and prints each arm's per-batch medians over its runs, the difference to the default pooled over
the runs, and the default's own spread between runs (A/A) to compare it with.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from gr_engine.bench.experiments import host_arena, peak_h2d_GBps
from gr_engine.bench.report import batch_bound_ratios, latency_fit
from gr_engine.bench.runner import BenchRun, BenchSettings, cache_config, quick_settings, unlimited_pages
from gr_engine.bench.trace import generate_trace
from gr_engine.config import apply_overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="also measure hierarchical batches with these cache fields changed (repeatable)")
    parser.add_argument("--out", help="write the window reports here (JSON)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every arm, interleaved (A B A B ...)")
    parser.add_argument("--quick", action="store_true", help="the tests' CPU-sized settings (no bound off CUDA)")
    args = parser.parse_args()
    settings = quick_settings() if args.quick else BenchSettings(simulation_workers=0)
    trace = generate_trace(settings.trace)
    peak = peak_h2d_GBps(settings.device)  # before the host arena and the engines: nothing else on the machine
    # Off CUDA there is no copy peak: every batch's bound is then its unlimited latency.
    bound_peak = peak if peak is not None else float("inf")
    arena = host_arena(settings)
    variants = [(v, "hierarchical", apply_overrides({}, v.split(","))) for v in args.variant]
    runs = [("hierarchical", "hierarchical", {}), *variants]
    repeats: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
    unlimited_arm = ("unlimited", "unlimited", {"num_gpu_pages": unlimited_pages(settings, trace)})
    arms = [*runs * max(1, args.repeats), unlimited_arm]
    for name, mode, changes in arms:
        run = BenchRun(settings, trace, cache_config(settings, mode, **changes), args.batch, arena)
        run.warmup()
        report, = run.windows([(args.batch, False)])
        repeats.setdefault(name, []).append(report)
        run.close()
    reports = {name: combined(runs_of) for name, runs_of in repeats.items()}
    unlimited = reports["unlimited"]
    default_runs = [r["batch_latency_ms"] for r in repeats["hierarchical"]]
    for name, _, _ in runs:
        report = reports[name]
        hier, onloaded = report["batch_latency_ms"], report["batch_onloaded_bytes"]
        ratios = batch_bound_ratios(report, unlimited, bound_peak)
        print(f"{name}: peak {bound_peak:.1f} GB/s; batch: hierarchical ms, unlimited ms, onloaded MB, latency / bound"
              + (f" (medians of {len(repeats[name])} runs)" if len(repeats[name]) > 1 else ""))
        for i, row in enumerate(zip(hier, unlimited["batch_latency_ms"], onloaded, ratios, strict=True)):
            print(f"{i:3d} {row[0]:7.2f} {row[1]:6.2f} {row[2] / 1e6:8.1f} {row[3]:5.2f}")
        print(f"{name} medians: hierarchical {report['median_ms']:.2f} ms, unlimited {unlimited['median_ms']:.2f} ms; "
              f"latency / bound batch by batch: median {np.median(ratios):.2f}, p90 {np.percentile(ratios, 90):.2f}; "
              f"GPU hit ratio {report['gpu_hit_ratio']:.2%}, total {report['total_hit_ratio']:.2%}")
        fit = latency_fit(report)
        if fit is not None:
            print(f"{name}: latency ~ {fit[0]:.2f} ms + bytes / {fit[1]:.1f} GB/s (batches onloading >= 20 MB)")
        if name != "hierarchical":
            differences = [np.subtract(r["batch_latency_ms"], base)
                           for r, base in zip(repeats[name], default_runs, strict=True)]
            print(f"{name} against hierarchical: median of the batch differences "
                  f"{np.median(np.concatenate(differences)):+.3f} ms over {len(differences)} run(s) each")
    if len(default_runs) > 1:
        spread = [np.subtract(run, default_runs[0]) for run in default_runs[1:]]
        print(f"hierarchical against itself (A/A, its later runs against its first): median of the batch differences "
              f"{np.median(np.concatenate(spread)):+.3f} ms, p90 of their size "
              f"{np.percentile(np.abs(np.concatenate(spread)), 90):.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"peak_GBps": peak, **reports, "runs": repeats}, f, indent=1)


def combined(runs: list[dict]) -> dict:
    """One arm's window report over its runs (the same batches in each): the first run's report with each batch's
    latency the median over the runs, and the medians and hit ratios recomputed or averaged over the runs."""
    if len(runs) == 1:
        return runs[0]
    latency = np.median([r["batch_latency_ms"] for r in runs], axis=0)
    onloaded = np.median([r["batch_onloaded_bytes"] for r in runs], axis=0)
    return {**runs[0], "batch_latency_ms": latency.tolist(), "batch_onloaded_bytes": onloaded.tolist(),
            "median_ms": float(np.median(latency)), "mean_ms": float(latency.mean()),
            "p90_ms": float(np.percentile(latency, 90)), "p99_ms": float(np.percentile(latency, 99)),
            "onloaded_bytes_per_batch": float(onloaded.mean()),
            **{key: float(np.mean([r[key] for r in runs])) for key in ("gpu_hit_ratio", "total_hit_ratio")}}


if __name__ == "__main__":
    main()
