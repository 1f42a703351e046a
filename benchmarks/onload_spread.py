"""Onload bandwidth against how far apart the host chunks lie in pinned memory, on the GPU.

    python benchmarks/onload_spread.py --arena-gib 24 --out benchmarks/results/onload_spread.json

The engine's onloads read chunks scattered over a host pool of tens of GiB; ``cache_bench.py`` and
``onload_sweep.py`` read chunks packed into a few hundred MiB. Here the same onload (96 chunks of 1,024 tokens of
benchmark KV, 8 layers, 4 heads x 128, page 32, bf16: 768 MiB, one kernel launch per layer as the transfer engine
issues them, index arrays in pinned memory) reads chunks packed together, then spread evenly over the first 1, 4,
... GiB of one pinned arena. Medians of CUDA-event timings; every placement checked against the data.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from functools import partial

import numpy as np
import torch
from cache_bench import cuda_time  # this script's folder is on the path when run as a script

from cache_engine.jobs import OnloadJob, host_page_addresses
from cache_engine.onload_kernel import OnloadLauncher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arena-gib", type=int, default=24)
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="")
    args = parser.parse_args()
    layers, chunk_pages, page, heads, dim, chunks = 8, 32, 32, 4, 128, 96
    slot_shape = (layers, chunk_pages, 2, page, heads, dim)
    slot_bytes = int(np.prod(slot_shape)) * 2
    t0 = time.perf_counter()
    arena = torch.empty(args.arena_gib * 2**30, dtype=torch.uint8, pin_memory=True)
    pin_s = time.perf_counter() - t0
    num_slots = arena.numel() // slot_bytes
    slots = arena[:num_slots * slot_bytes].view(torch.bfloat16).view(num_slots, *slot_shape)
    pool = torch.zeros(layers, chunks * chunk_pages, 2, page, heads, dim, dtype=torch.bfloat16, device="cuda")
    launcher = OnloadLauncher()
    results = []
    spans = [chunks * slot_bytes] + [g * 2**30 for g in (1, 2, 4, 8, 16, 32, 64) if g <= args.arena_gib]
    for span in spans:
        stride = max(1, span // slot_bytes // chunks)
        picked = np.arange(chunks) * stride
        for i, s in enumerate(picked):
            slots[s].fill_(float(i % 7))
        jobs = [OnloadJob(int(s), slots[s], np.arange(i * chunk_pages, (i + 1) * chunk_pages))
                for i, s in enumerate(picked)]
        addresses, layer_bytes = host_page_addresses(jobs)
        dst = torch.from_numpy(np.concatenate([j.pages for j in jobs])).pin_memory()
        src = torch.from_numpy(addresses).pin_memory()
        run = partial(launcher.all_layers, pool, src, dst, layer_bytes, torch.bfloat16)
        pool.zero_()
        run()
        torch.cuda.synchronize()
        expected = torch.tensor([float(i % 7) for i in range(chunks)]).repeat_interleave(chunk_pages)
        assert torch.equal(pool[:, :, 0, 0, 0, 0].float().cpu(), expected.expand(layers, -1))
        seconds = cuda_time(run, 9)
        results.append({"span_GiB": span / 2**30, "slot_stride": int(stride), "ms": seconds * 1e3,
                        "GBps": chunks * slot_bytes / seconds / 1e9})
        print(json.dumps(results[-1]))
    report = {"gpu": torch.cuda.get_device_name(), "commit": args.commit or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "command": f"python benchmarks/onload_spread.py --arena-gib {args.arena_gib} --out {args.out}",
        "arena_pin_seconds": pin_s, "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
