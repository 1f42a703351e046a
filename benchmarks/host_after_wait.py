"""Does waiting for the device slow the host's next work down? (A diagnostic for the engine's host time.)

Inside engine steps on the GPU machine, host-only numpy work takes 1.6-3x what the same calls take back to back
(``host_api_costs.py``). Between steps the host waits for the device (scoring copies the logits back). This times one
call of host-only work (``layout_arrays`` at a benchmark batch's sizes, and a Python loop) right after each kind of
wait of ``--wait-ms``: none (back to back), a device synchronisation while a kernel runs, a small device-to-host copy
behind a running kernel (as scoring does), polling an event until it completes (the host spins in Python),
``time.sleep``, and a Python busy loop. Medians in microseconds.

Usage: ``python benchmarks/host_after_wait.py --out costs.json`` (CUDA), or ``--host-only`` (no device waits).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from attention_backends.base import layout_arrays


def host_work() -> dict[str, Callable[[], object]]:
    """Host-only work to time, by name: ``layout_arrays`` at a benchmark batch's sizes (8 requests of 5,000-15,000
    cached events, a few new ones and 100 candidates each) and a 1,000-step Python loop."""
    rng = np.random.default_rng(0)
    start = rng.integers(5_000, 15_000, 8)
    hist, cand = rng.integers(1, 10, 8), np.full(8, 100)
    pages = -(-(start + hist) // 32)
    indptr = np.concatenate([[0], np.cumsum(pages)])
    indices = rng.permutation(40_960)[: indptr[-1]].astype(np.int32)
    return {"layout_arrays (8 requests)": lambda: layout_arrays(start, hist, cand, indptr, indices, 32),
            "python: sum(range(1000))": lambda: sum(range(1000))}


def timed_after(wait: Callable[[], None], work: Callable[[], object], repeats: int) -> float:
    """Median microseconds of ``work()`` right after ``wait()``, over ``repeats`` rounds."""
    times = []
    for _ in range(repeats):
        wait()
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--wait-ms", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--host-only", action="store_true", help="no device waits (no CUDA needed)")
    args = parser.parse_args()
    work = host_work()
    seconds = args.wait_ms / 1e3

    def spin() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    waits: dict[str, Callable[[], None]] = {"none": lambda: None, "time.sleep": lambda: time.sleep(seconds),
                                           "python busy loop": spin}
    if not args.host_only:
        cycles = int(seconds * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # clock_rate: kHz

        def device_sync() -> None:
            torch.cuda._sleep(cycles)
            torch.cuda.synchronize()

        def event_poll() -> None:
            torch.cuda._sleep(cycles)
            event = torch.cuda.Event()
            event.record()
            while not event.query():
                pass

        logits = torch.zeros(800, 4, device="cuda")

        def copy_back() -> None:  # what scoring a step does
            torch.cuda._sleep(cycles)
            logits.cpu()

        waits |= {"torch.cuda.synchronize (kernel running)": device_sync, "event.query() polling": event_poll,
                  "logits.cpu() (kernel running)": copy_back}
    result = {name: {wait: timed_after(fn, job, args.repeats) for wait, fn in waits.items()}
              for name, job in work.items()}
    result["settings"] = {"wait_ms": args.wait_ms, "repeats": args.repeats,
                          "gpu": None if args.host_only else torch.cuda.get_device_name()}
    report(result, args.out)


def report(result: dict, out: str | None) -> None:
    """Print ``result`` as JSON with the command that produced it, and write it to ``out`` if given."""
    result["command"] = " ".join(["python", *sys.argv])
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
