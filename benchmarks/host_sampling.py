"""Sampled host profile, with native frames, of the benchmark's steady state (a diagnostic for ``gr-engine bench``).

    python benchmarks/host_sampling.py --out sampled.json --py-spy /path/to/py-spy --modes hierarchical [--batches 300]

Re-runs itself under ``py-spy record --native --format raw`` (a sampling profiler: it adds no cost to each call,
unlike cProfile or ``host_breakdown.py``'s wrappers), serving each mode's measured batches of 8 in a function named
``sampled_window`` so that only those samples are counted. Writes the raw stacks next to ``--out`` and a summary:

- ``regions``: samples under each engine function (inclusive), e.g. ``GREngine._add`` (intake and prefetch),
  ``GREngine._step`` (steps 1-7), ``ModelRunner.prepare``;
- ``where``: for each region's own samples (those not under a listed sub-region), where the CPU was: ``python``
  (the interpreter running our or the standard library's bytecode), ``numpy``, ``torch`` (dispatcher and ATen),
  ``cuda`` (driver and runtime), ``libc``, ``other``;
- ``innermost``: samples by the innermost Python function of our packages and the library below it.

It answers whether the host time of steps 1-7 on the GPU machine goes to the interpreter, to numpy, to torch's
dispatcher or to the CUDA driver.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gr_engine.bench.runner import BenchRun

MARK = "sampled_window"
OUR_PACKAGES = ("gr_engine/", "cache_engine/", "scheduler/", "attention_backends/")
REGIONS = ("GREngine._add", "GREngine._step", "KVCacheManager.prefetch", "Scheduler.schedule", "KVCacheManager.acquire",
           "HostTier.poll", "KVCacheManager.launch_onloads", "ModelRunner.prepare", "ModelRunner.strip",
           "ModelRunner.forward", "ModelRunner.score", "KVCacheManager.issue_deferred_offloads", "GREngine._output",
           "KVCacheManager.commit", "Scheduler.complete")


def library(frame: str) -> str:
    """The kind of code a raw-stack frame ``"name (file)"`` or ``"name (file:line)"`` runs."""
    location = frame.rsplit(" (", 1)[-1].rstrip(")")
    if location.endswith(".py") or ".py:" in location or location.startswith("<frozen"):
        return "python"
    if "numpy" in location or "_multiarray" in location:
        return "numpy"
    if "libcuda" in location or "libcudart" in location or "nvidia" in location:
        return "cuda"
    if "torch" in location or "libc10" in location or "libtorch" in location:
        return "torch"
    if "libc.so" in location or "libpthread" in location or "libm.so" in location or "ld-linux" in location:
        return "libc"
    return "other"


def function(frame: str) -> str:
    return frame.rsplit(" (", 1)[0]


def summarise(raw_lines: list[str]) -> dict:
    """Counts of the samples whose stack contains :data:`MARK`, from py-spy's raw format (``frame;frame;... count``
    per line, outermost frame first)."""
    total = 0
    regions: Counter[str] = Counter()
    where: dict[str, Counter[str]] = defaultdict(Counter)
    innermost: Counter[str] = Counter()
    for line in raw_lines:
        stack_text, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack_text or MARK not in stack_text:
            continue
        count = int(count_text)
        frames = stack_text.split(";")
        names = [function(f) for f in frames]
        total += count
        seen = [r for r in REGIONS if r in names]
        for region in seen:
            regions[region] += count
        # The region owning this sample: the innermost listed one.
        owner = max(seen, key=names.index) if seen else "(outside the engine)"
        where[owner][library(frames[-1])] += count
        ours = [i for i, f in enumerate(frames) if any(p in f for p in OUR_PACKAGES)]
        if ours:
            below = {library(f) for f in frames[ours[-1] + 1:]} or {"python"}
            kind = next(k for k in ("cuda", "torch", "numpy", "libc", "other", "python") if k in below)
            innermost[f"{names[ours[-1]]} -> {kind}"] += count
    return {"samples": total, "regions": dict(regions.most_common()),
            "where": {r: dict(c.most_common()) for r, c in sorted(where.items(), key=lambda kv: -sum(kv[1].values()))},
            "innermost": dict(innermost.most_common(80))}


def sampled_window(run: BenchRun, batches: int) -> dict:
    """Serve the measured batches; this function's name marks their samples."""
    return run.window(8, 8 * batches, prime_batches=0)


def serve(args: argparse.Namespace) -> None:
    from gr_engine.bench.experiments import steady_state_runs, steady_state_settings

    reports = {}
    for mode, run in steady_state_runs(steady_state_settings(args), args.prime):
        report = sampled_window(run, args.batches)
        reports[mode] = {"median_ms": report["median_ms"], "host_ms_per_batch": report["host_ms_per_batch"],
                         "phase_ms_per_batch": report["phase_ms_per_batch"]}
        print(mode, json.dumps(reports[mode]), flush=True)
    Path(args.out).with_suffix(".reports.json").write_text(json.dumps(reports, indent=1))


def main() -> None:
    from gr_engine.bench.experiments import steady_state_parser

    parser = steady_state_parser(__doc__.splitlines()[0], batches=300)
    parser.add_argument("--py-spy", help="the py-spy executable; without it, only serve (the sampled child's part)")
    parser.add_argument("--rate", type=int, default=500, help="samples per second")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.py_spy:
        serve(args)
        return
    raw = out.with_suffix(".raw.txt")
    child = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    at = child.index("--py-spy")
    del child[at:at + 2]
    subprocess.run([args.py_spy, "record", "--native", "--format", "raw", "--rate", str(args.rate), "-o", str(raw),
                    "--", *child], check=True)
    summary = summarise(raw.read_text().splitlines())
    reports_path = out.with_suffix(".reports.json")
    reports = json.loads(reports_path.read_text()) if reports_path.exists() else {}
    out.write_text(json.dumps({"command": " ".join(["python benchmarks/host_sampling.py", *sys.argv[1:]]),
                               "reports": reports, **summary}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
