"""Device timelines of the benchmark's batches of 8 (a diagnostic for ``gr-engine bench``'s ``hier_over_bound_bs8``).

    python benchmarks/batch_timeline.py --out timeline_dir [--modes hierarchical unlimited] [--batches 30]

For each mode, the benchmark's engine in its steady state (the set-up of ``bench_profile.py``: warm-up,
fast-forward to the middle of the trace, ``--prime`` unmeasured batches), then ``--batches`` batches of 8 under
``torch.profiler`` (host and CUDA activity), each batch annotated ``batch``. Writes the Chrome trace
(``trace_<mode>.json.gz``) and, per batch, when the offload, onload and forward kernels ran, how busy they kept the
GPU and how long onloads and the forward overlapped (``timeline_<mode>.json``, from
:func:`gr_engine.bench.timeline.batch_timelines`); prints the medians.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import torch

from gr_engine.bench.experiments import steady_state_parser, steady_state_runs, steady_state_settings
from gr_engine.bench.timeline import batch_timelines


def main() -> None:
    args = steady_state_parser(__doc__.splitlines()[0], batches=30).parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = steady_state_settings(args)
    for mode, run in steady_state_runs(settings, args.prime):  # compiled and captured before the profile
        engine, rank, onloaded = run.engine, run.engine.rank, []

        def annotated_rank(*a, engine=engine, rank=rank, onloaded=onloaded, **k):
            before = engine.kv.stats.onloaded_bytes
            with torch.profiler.record_function("batch"):
                result = rank(*a, **k)
            onloaded.append(engine.kv.stats.onloaded_bytes - before)
            return result

        engine.rank = annotated_rank
        activities = [torch.profiler.ProfilerActivity.CPU]
        if engine.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profiler:
            report = run.window(8, 8 * args.batches, prime_batches=0)
        trace_path = out / f"trace_{mode}.json"
        profiler.export_chrome_trace(str(trace_path))
        text = trace_path.read_text()
        rows = batch_timelines(json.loads(text), onloaded)
        with gzip.open(out / f"trace_{mode}.json.gz", "wt") as f:  # tens of MB of host events: kept compressed
            f.write(text)
        trace_path.unlink()
        medians = {key: float(np.median([r[key] for r in rows if r.get(key) is not None]))
                   for key in rows[0] if any(r.get(key) is not None for r in rows)}
        (out / f"timeline_{mode}.json").write_text(json.dumps(
            {"mode": mode, "batches": len(rows), "median_ms_under_profiler": report["median_ms"],
             "medians": medians, "rows": rows}, indent=1))
        print(f"{mode}: {len(rows)} batches, median {report['median_ms']:.2f} ms under the profiler; medians "
              f"{ {k: round(v, 3) for k, v in medians.items()} }", flush=True)


if __name__ == "__main__":
    main()
