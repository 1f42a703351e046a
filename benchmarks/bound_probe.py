"""Hierarchical batches against their bound, batch by batch (a diagnostic for ``gr-engine bench``'s
``hier_over_bound_bs8``).

    python benchmarks/bound_probe.py [--batch 8] [--variant prioritise_onloads=false] [--out probe.json]

Runs the benchmark's hierarchical and unlimited engines over the benchmark's own measured windows at one batch
size (the same batches in both, in the same order) and prints, for each batch: its latency in both modes, the
bytes it onloaded, its bound (the larger of the unlimited latency and the bytes at the pinned copy peak measured
here) and the ratio. It only drives ``BenchRun`` and ``engine.rank`` from outside, so the same script measures
older checkouts too (run it with another tree first on ``PYTHONPATH`` to compare commits on one machine).
``--variant`` measures the hierarchical engine again with some cache fields changed, in the same process (an A/B on
one machine), and prints the median of the per-batch differences.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from gr_engine.bench.runner import BenchRun, BenchSettings, cache_config, unlimited_pages

try:
    from gr_engine.bench.experiments import host_arena, peak_h2d_GBps
except ImportError:  # a checkout from before gr_engine.bench.experiments
    from gr_engine.bench.runner import _host_arena as host_arena
    from gr_engine.bench.runner import _peak_h2d as peak_h2d_GBps
from gr_engine.bench.trace import generate_trace


def per_batch(run: BenchRun, batch_size: int) -> tuple[list[float], list[int]]:
    """Each measured batch's latency (ms) and onloaded bytes over ``run``'s windows at ``batch_size``."""
    engine, latencies, onloaded = run.engine, [], []
    rank = engine.rank

    def timed_rank(batch, **kwargs):
        before = engine.kv.stats.onloaded_bytes
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outputs = rank(batch, **kwargs)
        torch.cuda.synchronize()
        latencies.append((time.perf_counter() - t0) * 1e3)
        onloaded.append(engine.kv.stats.onloaded_bytes - before)
        return outputs

    engine.rank = timed_rank
    report, = run.windows([(batch_size, False)])
    primed = len(latencies) - report["batches"]  # the first stratum's priming batches come first
    return latencies[primed:], onloaded[primed:]


def cache_changes(text: str) -> dict[str, object]:
    """``"key=value,key=value"`` (``--variant``'s cache fields; values as JSON, else strings) as a dict."""
    changes: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            changes[key] = json.loads(value)
        except json.JSONDecodeError:
            changes[key] = value
    return changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="also measure hierarchical batches with these cache fields changed (repeatable)")
    parser.add_argument("--out", help="write the per-batch numbers here (JSON)")
    args = parser.parse_args()
    settings = BenchSettings(simulation_workers=0)
    trace = generate_trace(settings.trace)
    peak = peak_h2d_GBps(settings.device)  # before the host arena and the engines: nothing else on the machine
    arena = host_arena(settings)
    measured = {}
    runs = [("hierarchical", "hierarchical", {})] + [(v, "hierarchical", cache_changes(v)) for v in args.variant]
    for name, mode, changes in [*runs, ("unlimited", "unlimited", {"num_gpu_pages": unlimited_pages(settings, trace)})]:
        run = BenchRun(settings, trace, cache_config(settings, mode, **changes), args.batch, arena)
        run.warmup()
        measured[name] = per_batch(run, args.batch)
        run.close()
    unl = measured["unlimited"][0]
    report = {"peak_GBps": peak, "unlimited_ms": unl}
    for name, _, _ in runs:
        hier, onloaded = measured[name]
        bounds = [max(u, b / (peak * 1e9) * 1e3) for u, b in zip(unl, onloaded, strict=True)]
        ratios = [h / b for h, b in zip(hier, bounds, strict=True)]
        print(f"{name}: peak {peak:.1f} GB/s; batch: hierarchical ms, unlimited ms, onloaded MB, bound ms, ratio")
        for i, row in enumerate(zip(hier, unl, onloaded, bounds, ratios, strict=True)):
            print(f"{i:3d} {row[0]:7.2f} {row[1]:6.2f} {row[2] / 1e6:8.1f} {row[3]:7.2f} {row[4]:5.2f}")
        mean_bytes = float(np.mean(onloaded))
        print(f"{name} medians: hierarchical {np.median(hier):.2f} ms, unlimited {np.median(unl):.2f} ms; "
              f"bench's ratio {np.median(hier) / max(np.median(unl), mean_bytes / (peak * 1e9) * 1e3):.2f}; "
              f"batch by batch: median {np.median(ratios):.2f}, p90 {np.percentile(ratios, 90):.2f}")
        if name != "hierarchical":
            print(f"{name} against hierarchical: median of the batch differences "
                  f"{np.median(np.subtract(hier, measured['hierarchical'][0])):+.3f} ms")
        report[name] = {"hierarchical_ms": hier, "onloaded_bytes": onloaded}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
