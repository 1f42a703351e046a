"""The HSTU layer's input projection, ``silu(x @ W.T + b)``, as cuBLAS plus torch's SiLU against the fused Triton
kernel (:mod:`gr_engine.models.fused_linear`) in several launch shapes, with pointer loads and with TMA, on the GPU,
replayed from CUDA graphs.

    python benchmarks/linear_silu_probe.py --out linear_silu.json [--rounds 3] [--commit REV]

Shapes: the bench model's projection (``K`` 512, ``N`` 2048) at the row counts of the cold 8,192-event visit (8,292),
recompute's batch of 8 (78,000), a serving step (2,048) and a small one (256). Each round times every variant on every
row count (``triton.testing.do_bench_cudagraph``, fresh random inputs, medians in microseconds) and reports the
largest absolute difference of each variant's output from cuBLAS's (bf16: one rounding apart).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

from gr_engine.models import fused_linear

ROWS = (8292, 78000, 2048, 256)
WIDTH, OUT_WIDTH = 512, 2048
SHAPES = {  # name: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
    "128x128x64_w8_s3": (128, 128, 64, 8, 8, 3),
    "128x128x64_w4_s3": (128, 128, 64, 8, 4, 3),
    "128x256x64_w8_s3": (128, 256, 64, 8, 8, 3),
    "128x256x64_w8_s4": (128, 256, 64, 8, 8, 4),
    "128x128x128_w8_s2": (128, 128, 128, 8, 8, 2),
    "64x256x64_w4_s4": (64, 256, 64, 8, 4, 4),
    "64x128x64_w4_s3": (64, 128, 64, 8, 4, 3),
    "256x128x64_w8_s3": (256, 128, 64, 8, 8, 3),
}


@triton.jit(do_not_specialize=["num_rows"])
def _pointer_kernel(X, Weight, Bias, Out, num_rows, stride_x, stride_w, stride_out, N: tl.constexpr,
                    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr):
    """As ``fused_linear._linear_silu_kernel``, its tiles loaded and stored through pointers (``N`` a multiple of
    ``BLOCK_N``, ``K`` of ``BLOCK_K``)."""
    pid = tl.program_id(0)
    col_tiles: tl.constexpr = N // BLOCK_N
    row_tiles = tl.cdiv(num_rows, BLOCK_M)
    first_row_tile = pid // (GROUP_M * col_tiles) * GROUP_M
    group_rows = min(row_tiles - first_row_tile, GROUP_M)
    in_group = pid % (GROUP_M * col_tiles)
    rows = (first_row_tile + in_group % group_rows).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = in_group // group_rows * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    x_tile = X + rows[:, None] * stride_x + inner[None, :]
    w_tile = Weight + cols[None, :].to(tl.int64) * stride_w + inner[:, None]
    row_in = rows[:, None] < num_rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in tl.range(0, K // BLOCK_K, num_stages=NUM_STAGES):
        acc = tl.dot(tl.load(x_tile, mask=row_in, other=0.0), tl.load(w_tile), acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    acc += tl.load(Bias + cols).to(tl.float32)[None, :]
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(Out + rows[:, None] * stride_out + cols[None, :], out.to(Out.dtype.element_ty), mask=row_in)


def tma(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The module's kernel (tiles moved by TMA) in launch shape ``shape``."""
    block_m, block_n, block_k, group_m, warps, stages = shape
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], block_m) * (w.shape[0] // block_n),)
    descriptors = (TensorDescriptor.from_tensor(x, [block_m, block_k]),
                   TensorDescriptor.from_tensor(w, [block_n, block_k]),
                   TensorDescriptor.from_tensor(out, [block_m, block_n]))
    fused_linear._linear_silu_kernel[grid](descriptors[0], descriptors[1], b, descriptors[2], x.shape[0], N=w.shape[0],
                                           K=x.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                           GROUP_M=group_m, NUM_STAGES=stages, num_warps=warps)
    return out


def pointer(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The pointer-load kernel in launch shape ``shape`` (see ``SHAPES``)."""
    block_m, block_n, block_k, group_m, warps, stages = shape
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], block_m) * (w.shape[0] // block_n),)
    _pointer_kernel[grid](x, w, b, out, x.shape[0], x.stride(0), w.stride(0), out.stride(0), N=w.shape[0],
                          K=x.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                          NUM_STAGES=stages, num_warps=warps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    variants = {"cublas_then_silu": lambda x, w, b: F.silu(F.linear(x, w, b))}
    variants.update({name: (lambda x, w, b, s=shape: pointer(x, w, b, s)) for name, shape in SHAPES.items()})
    variants.update({f"tma_{name}": (lambda x, w, b, s=shape: tma(x, w, b, s)) for name, shape in SHAPES.items()})
    times = {name: {rows: [] for rows in ROWS} for name in variants}
    diffs: dict[str, dict[int, float]] = {name: {} for name in variants}
    for _ in range(args.rounds):
        for rows in ROWS:
            x = torch.randn(rows, WIDTH, device=device, dtype=torch.bfloat16)
            w = (torch.randn(OUT_WIDTH, WIDTH, device=device) / WIDTH**0.5).to(torch.bfloat16)
            b = (0.1 * torch.randn(OUT_WIDTH, device=device)).to(torch.bfloat16)
            reference = variants["cublas_then_silu"](x, w, b).float()
            for name, fn in variants.items():
                diff = (fn(x, w, b).float() - reference).abs().max().item()
                diffs[name][rows] = max(diffs[name].get(rows, 0.0), diff)
                call = functools.partial(fn, x, w, b)
                times[name][rows].append(1e3 * triton.testing.do_bench_cudagraph(call, rep=100))
    medians = {name: {rows: sorted(t)[len(t) // 2] for rows, t in by_rows.items()} for name, by_rows in times.items()}
    for name in variants:
        cells = "  ".join(f"{rows}: {medians[name][rows]:7.1f} us "
                          f"({2e-6 * rows * WIDTH * OUT_WIDTH / medians[name][rows]:5.0f} TFLOP/s, "
                          f"diff {diffs[name][rows]:.3g})" for rows in ROWS)
        print(f"{name:20s} {cells}")
    with open(args.out, "w") as f:
        json.dump({"commit": args.commit, "device": torch.cuda.get_device_name(), "rounds": args.rounds,
                   "median_us": medians, "all_us": times, "max_abs_diff_vs_cublas": diffs}, f, indent=1)


if __name__ == "__main__":
    main()
