"""The bench's cold first visits alone (``gr-engine bench``'s ``cold_8192_ms`` and ``cold_8192_ms_gpu_only``): each
cache mode's engine, warmed up, ranks first visits of ``--history``-event users one at a time, from ``rank`` to the
scores on the host; the modes alternate for ``--rounds`` rounds.

    python benchmarks/cold_visits.py --out cold.json [--modes recompute,gpu_only] [--rounds 2] [--commit REV]

To compare two trees in one session, run it from each (``PYTHONPATH=<tree>``), alternating.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import torch

from gr_engine.bench.experiments import _cold_first_visits
from gr_engine.bench.runner import BenchSettings
from gr_engine.models import GRModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--modes", default="recompute,gpu_only")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--history", type=int, default=BenchSettings.cold_history)
    parser.add_argument("--visits", type=int, default=BenchSettings.cold_visits)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    settings = dataclasses.replace(BenchSettings(), cold_history=args.history, cold_visits=args.visits)
    model = GRModel(settings.model).to(device="cuda", dtype=settings.model.torch_dtype).eval()
    runs: dict[str, list[dict]] = {mode: [] for mode in args.modes.split(",")}
    for _ in range(args.rounds):
        for mode, results in runs.items():
            results.append(_cold_first_visits(settings, model, mode))
            print(f"{mode:10s} median {results[-1]['median_ms']:.3f} ms, p99 {results[-1]['p99_ms']:.3f}", flush=True)
    summary = {mode: float(np.median([v for r in results for v in r["latency_ms"]])) for mode, results in runs.items()}
    print("median over all rounds (ms):", {mode: round(ms, 3) for mode, ms in summary.items()})
    with open(args.out, "w") as f:
        json.dump({"commit": args.commit, "device": torch.cuda.get_device_name(), "history": args.history,
                   "median_ms": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
