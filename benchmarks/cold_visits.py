"""The bench's cold first visits alone (``gr-engine bench``'s ``cold_8192_ms`` and ``cold_8192_ms_gpu_only``): each
cache mode's engine, warmed up, ranks first visits of ``--history``-event users one at a time, from ``rank`` to the
scores on the host; the modes alternate for ``--rounds`` rounds.

    python benchmarks/cold_visits.py --out cold.json [--modes recompute,gpu_only] [--rounds 2] [--commit REV] [--quick]

``--quick``: the bench's CPU-sized settings (seconds; checks the script, measures nothing).

To compare two trees in one session, run it from each (``PYTHONPATH=<tree>``), alternating.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import torch

from gr_engine.bench.experiments import cold_first_visits
from gr_engine.bench.runner import BenchSettings, quick_settings
from gr_engine.engine import resolve_device
from gr_engine.models import GRModel


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--modes", default="recompute,gpu_only")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--history", type=int, default=BenchSettings.cold_history)
    parser.add_argument("--visits", type=int, default=BenchSettings.cold_visits)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    base = quick_settings() if args.quick else BenchSettings()
    settings = dataclasses.replace(base, cold_history=base.cold_history if args.quick else args.history,
                                   cold_visits=base.cold_visits if args.quick else args.visits)
    device = resolve_device(settings.device)
    model = GRModel(settings.model).to(device=device, dtype=settings.model.torch_dtype).eval()
    runs: dict[str, list[dict]] = {mode: [] for mode in args.modes.split(",")}
    for _ in range(args.rounds):
        for mode, results in runs.items():
            results.append(cold_first_visits(settings, model, mode))
            print(f"{mode:10s} median {results[-1]['median_ms']:.3f} ms, p99 {results[-1]['p99_ms']:.3f}", flush=True)
    summary = {mode: float(np.median([v for r in results for v in r["latency_ms"]])) for mode, results in runs.items()}
    print("median over all rounds (ms):", {mode: round(ms, 3) for mode, ms in summary.items()})
    with open(args.out, "w") as f:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        json.dump({"commit": args.commit, "device": name, "history": settings.cold_history,
                   "median_ms": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
