"""Sampled host profile, with native frames, of the benchmark's steady state (a diagnostic for ``gr-engine bench``).

    python benchmarks/host_sampling.py --out sampled.json --py-spy /path/to/py-spy --modes hierarchical [--batches 300]

Attaches ``py-spy record --native --format raw`` (a sampling profiler: it adds no cost to each call, unlike
cProfile or ``host_breakdown.py``'s wrappers) to itself while it serves each mode's measured batches of 8 (set-up,
warm-up, priming and the capture of every step graph, ``GREngine.warmup``, are not sampled), in a function named
``sampled_window`` whose samples alone are counted.
Writes the raw stacks next to ``--out`` (``<stem>_<mode>.raw.txt``) and a summary per mode:

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

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gr_engine.bench.runner import BenchRun

MARK = "sampled_window"
OUR_PACKAGES = ("gr_engine/", "cache_engine/", "scheduler/", "attention_backends/")
REGIONS = ("GREngine._add", "GREngine._step", "KVCacheManager.prefetch", "Scheduler.schedule", "KVCacheManager.acquire",
           "HostTier.poll", "KVCacheManager.launch_onloads", "ModelRunner.prepare", "ModelRunner.strip",
           "ModelRunner.forward", "ModelRunner.score", "KVCacheManager.issue_deferred_offloads", "GREngine._output",
           "KVCacheManager.commit", "Scheduler.complete", "HostTier.flush", "TransferEngine.offload",
           "TransferEngine.onload", "TransferEngine._stage_by_dma", "BatchedCopier.__call__",
           "OnloadLauncher.all_layers", "KVCacheManager._evict")


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


def allow_tracing_by_any_process() -> None:
    """Let a process that is not this one's ancestor (py-spy, started below) read its memory where the kernel's
    Yama policy would forbid it (``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``; no effect elsewhere)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)


def sample(py_spy: str, raw: Path, rate: int, work: Callable[[], dict]) -> dict:
    """Run ``work()`` while py-spy samples this process into ``raw``; returns ``work()``'s result."""
    allow_tracing_by_any_process()
    sampler = subprocess.Popen([py_spy, "record", "--native", "--format", "raw", "--rate", str(rate), "-o", str(raw),
                                "--pid", str(os.getpid())], stderr=subprocess.PIPE, text=True)
    time.sleep(3.0)  # attached: py-spy starts sampling well within this
    if sampler.poll() is not None:
        raise RuntimeError(f"py-spy exited: {sampler.stderr.read() if sampler.stderr else ''}")
    try:
        return work()
    finally:
        sampler.send_signal(signal.SIGINT)  # py-spy writes its samples on an interrupt
        sampler.wait(timeout=120)


def main() -> None:
    from gr_engine.bench.experiments import steady_state_parser, steady_state_runs, steady_state_settings

    parser = steady_state_parser(__doc__.splitlines()[0], batches=300)
    parser.add_argument("--py-spy", required=True, help="the py-spy executable")
    parser.add_argument("--rate", type=int, default=500, help="samples per second")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"command": " ".join(["python benchmarks/host_sampling.py", *sys.argv[1:]])}
    for mode, run in steady_state_runs(steady_state_settings(args), args.prime):
        # Every step graph captured first, as a server does at start-up: a capture (and the Triton compilation a new
        # bucket brings) inside the sampled batches would fill the profile (profiles/host_sampling_9acc370/).
        run.engine.warmup(use_tqdm=False)
        raw = out.with_name(f"{out.stem}_{mode}.raw.txt")
        report = sample(args.py_spy, raw, args.rate, lambda run=run: sampled_window(run, args.batches))
        result[mode] = {"median_ms": report["median_ms"], "host_ms_per_batch": report["host_ms_per_batch"],
                        "phase_ms_per_batch": report["phase_ms_per_batch"],
                        **summarise(raw.read_text().splitlines())}
        print(mode, json.dumps(result[mode], indent=1), flush=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
