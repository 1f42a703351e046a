"""Is the host slower while the device moves data over PCIe? (A diagnostic for the engine's host time.)

In ``gr-engine bench`` the same host code (intake, staging) takes up to ~1.7x longer in ``hierarchical`` batches
than in ``unlimited`` ones. Hierarchical batches move KV between pinned host memory and the GPU: kernels that load
from (onload) and store to (offload) host memory directly, or copy-engine DMA on the copy path. This times host-only
work (``layout_arrays`` at a benchmark batch's sizes, and a Python loop), call after call, while the device runs one
of: nothing, a device-only kernel (control), a kernel reading pinned host memory, a kernel writing pinned host memory,
and a DMA copy host -> device. Medians in microseconds, and each transfer's rate.

Usage (CUDA): ``python benchmarks/host_under_transfers.py --out result.json``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl
from host_after_wait import host_work, report  # this folder: the scripts run as `python benchmarks/...`


@triton.jit
def _read_host(Src, Out, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(Src + offsets, mask=offsets < n, other=0.0)
    tl.store(Out + tl.program_id(0), tl.sum(values, 0))


@triton.jit
def _write_host(Dst, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Dst + offsets, offsets.to(tl.float32), mask=offsets < n)


def host_times_during(launch: Callable[[], None], work: Callable[[], object], calls: int) -> tuple[float, float]:
    """Launch device work, time ``calls`` calls of ``work`` while it runs; returns (median us per call, device ms)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    launch()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        work()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return float(np.median(times) * 1e6), (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--gib", type=float, default=2.0, help="pinned buffer moved per launch")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    work = host_work()
    n = int(args.gib * 2**30) // 4
    pinned = torch.ones(n, dtype=torch.float32, pin_memory=True)
    device = torch.empty(n, dtype=torch.float32, device="cuda")
    block = 4096
    out = torch.empty(triton.cdiv(n, block), dtype=torch.float32, device="cuda")
    grid = (triton.cdiv(n, block),)
    cycles = int(0.4 * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # ~0.4 s of a device-only kernel
    devices: dict[str, Callable[[], None]] = {
        "idle": lambda: None,
        "device-only kernel": lambda: torch.cuda._sleep(cycles),
        "kernel reading pinned host memory": lambda: _read_host[grid](pinned, out, n, BLOCK=block),
        "kernel writing pinned host memory": lambda: _write_host[grid](pinned, n, BLOCK=block),
        "DMA host -> device": lambda: device.copy_(pinned, non_blocking=True),
        "DMA device -> host": lambda: pinned.copy_(device, non_blocking=True),
    }
    for launch in devices.values():  # compile
        launch()
    torch.cuda.synchronize()
    result: dict[str, dict] = {}
    for name, launch in devices.items():
        entry: dict[str, float] = {}
        for label, job in work.items():
            runs = [host_times_during(launch, job, args.calls) for _ in range(args.rounds)]
            entry[label + " us"] = float(np.median([us for us, _ in runs]))
            entry["device ms"] = float(np.median([ms for _, ms in runs]))
        if name not in ("idle", "device-only kernel"):
            entry["GB/s (with host work)"] = n * 4 / (entry["device ms"] / 1e3) / 1e9
        result[name] = entry
    result["settings"] = {"gib": args.gib, "calls": args.calls, "rounds": args.rounds,
                          "gpu": torch.cuda.get_device_name()}
    report(result, args.out)


if __name__ == "__main__":
    main()
