"""Launch shapes of the onload kernel (rows and warps per program) against the pinned copy peak, on the GPU.

    python benchmarks/onload_sweep.py --out benchmarks/results/onload_sweep.json

Onloads 49,152 tokens of benchmark KV (8 layers, 4 heads x 128, page 32; bf16 and FP8 host pages, pool in
bf16) from pinned host slots of 1,024-token chunks into random pool pages, one launch per layer as the
transfer engine does, for every (rows per program, warps) pair; also one 256 MiB pinned copy (the peak).
Medians of CUDA-event timings; every shape checked against the copy it replaces. The chosen default lives in
``cache_engine.onload_kernel`` (``ROWS_PER_PROGRAM``, ``NUM_WARPS``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from functools import partial

import numpy as np
import torch
from cache_bench import cuda_time  # this script's folder is on the path when run as a script

from cache_engine.onload_kernel import onload_pages


def onload_all_layers(pool: torch.Tensor, addr: torch.Tensor, dst_pages: torch.Tensor, layer_bytes: int,
                      dtype: torch.dtype, slot_ids: torch.Tensor, scales: torch.Tensor | None, rows: int,
                      warps: int) -> None:
    """One kernel launch per layer of ``pool [L, pages, 2, page, H, D]``, as the transfer engine does."""
    for layer in range(pool.shape[0]):
        onload_pages(pool[layer], addr, dst_pages, layer * layer_bytes, dtype, layer, slot_ids, scales,
                     rows_per_program=rows, num_warps=warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="")
    args = parser.parse_args()
    layers, heads, dim, page, chunk_pages, tokens = 8, 4, 128, 32, 32, 49_152
    num_pages = tokens // page
    src = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    peak = src.numel() / cuda_time(partial(torch.Tensor.copy_, torch.empty_like(src, device="cuda"), src,
                                           non_blocking=True), 9) / 1e9
    pool = torch.zeros(layers, 2 * num_pages, 2, page, heads, dim, dtype=torch.bfloat16, device="cuda")
    dst_pages = torch.from_numpy(np.random.default_rng(0).permutation(2 * num_pages)[:num_pages]).cuda()
    results = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        chunks = num_pages // chunk_pages  # host slots [chunks, L, chunk_pages, 2, page, H, D]
        host = torch.randn(chunks, layers, chunk_pages, 2, page, heads, dim).to(dtype).pin_memory()
        slot_ids = torch.arange(num_pages, device="cuda") // chunk_pages
        addr = (host.data_ptr() + (slot_ids.cpu() * host.stride(0) + torch.arange(num_pages) % chunk_pages
                                   * host.stride(2)) * host.element_size()).cuda()
        layer_bytes = host.stride(1) * host.element_size()
        scales = torch.ones(chunks, layers, 2, heads, device="cuda") if dtype != torch.bfloat16 else None
        nbytes = host.numel() * host.element_size()
        expected = host[:, 0].reshape(num_pages, 2, page, heads, dim).to(torch.bfloat16)  # layer 0 of every page
        for rows in (1, 4, 8, 16, 64):
            for warps in (2, 4, 8):
                run = partial(onload_all_layers, pool, addr, dst_pages, layer_bytes, dtype, slot_ids, scales,
                              rows, warps)
                pool.zero_()
                run()
                assert torch.equal(pool[0, dst_pages].cpu(), expected), (rows, warps)
                ms = cuda_time(run, 9) * 1e3
                results.append({"host_dtype": str(dtype).removeprefix("torch."), "rows_per_program": rows,
                                "num_warps": warps, "ms": ms, "GBps": nbytes / ms / 1e6,
                                "bf16_equivalent_GBps": 2 * tokens * layers * heads * dim * 2 / ms / 1e6})
                print(json.dumps(results[-1]))
    report = {"gpu": torch.cuda.get_device_name(), "commit": args.commit or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "command": f"python benchmarks/onload_sweep.py --out {args.out}", "peak_pinned_h2d_GBps": peak,
        "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for dtype in ("bfloat16", "float8_e4m3fn"):
        best = max((r for r in results if r["host_dtype"] == dtype), key=lambda r: r["GBps"])
        print(f"peak {peak:.1f} GB/s; best {dtype}: {best}")


if __name__ == "__main__":
    main()
