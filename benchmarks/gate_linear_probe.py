"""The HSTU layer's output half, ``residual += (u * LN(attn)) @ W.T``, as the engine runs it (the gate kernel of
``gr_engine.models.fused_ops``, then cuBLAS accumulating into the residual in place) against one probe kernel that
normalises and gates ``attn`` as it loads the GEMM's A tiles, on the GPU, replayed from CUDA graphs.

    python benchmarks/gate_linear_probe.py --out gate_linear.json [--rounds 3] [--commit REV]

Shapes: the bench model's (``W`` 512 attention width, ``d_model`` 512, ``u`` a column block of the ``[T, 2048]``
projection) at 8,292 rows (the cold visit), 78,000 (recompute's batch of 8), 2,048 and 256. Each round times every
variant at every row count (``do_bench_cudagraph``, fresh inputs, medians in microseconds, the residual restored
outside the timing by the graph's own copy: both variants time that copy too) and reports the largest absolute
difference from the engine's result. The probe kernel is not the engine's: no ``concat_ua``.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl
import triton.testing

from gr_engine.models.fused_ops import gated_attn_norm

ROWS = (8292, 78000, 2048, 256)
WIDTH, D_MODEL, EPS = 512, 512, 1e-6
SHAPES = {  # name: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    "128x128x64_w8_s3": (128, 128, 64, 8, 3),
    "128x128x64_w4_s3": (128, 128, 64, 4, 3),
    "64x128x64_w4_s3": (64, 128, 64, 4, 3),
    "128x256x64_w8_s3": (128, 256, 64, 8, 3),
    "64x256x64_w8_s3": (64, 256, 64, 8, 3),
}


@triton.jit(do_not_specialize=["num_rows"])
def _gated_linear_kernel(Attn, U, NormWeight, NormBias, Weight, Residual, num_rows, stride_attn, stride_u,
                         stride_w, stride_res, eps, K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """``Residual[rows, cols] += (U * LN(Attn)) @ Weight.T`` for one ``[BLOCK_M, BLOCK_N]`` tile: ``Attn``, ``U``
    ``[num_rows, K]``, ``Weight`` ``[N, K]``, ``Residual`` ``[num_rows, N]`` (rows ``stride_*`` apart, unit column
    stride), ``NormWeight``, ``NormBias`` ``[K]``. The row statistics in float32 over two passes (mean, then the
    centred variance), the gated A tile rounded once to the inputs' dtype, float32 accumulation, the sum with the
    residual rounded once."""
    pid = tl.program_id(0)
    col_tiles: tl.constexpr = N // BLOCK_N
    rows = (pid // col_tiles).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid % col_tiles * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    live = rows[:, None] < num_rows
    attn_rows = Attn + rows[:, None] * stride_attn + inner[None, :]
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K):
        total += tl.sum(tl.load(attn_rows + k, mask=live, other=0.0).to(tl.float32), axis=1)
    mean = total / K
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K):
        centred = tl.load(attn_rows + k, mask=live, other=0.0).to(tl.float32) - mean[:, None]
        squares += tl.sum(centred * centred, axis=1)
    rstd = 1.0 / tl.sqrt(squares / K + eps)
    u_rows = U + rows[:, None] * stride_u + inner[None, :]
    w_cols = Weight + cols[None, :].to(tl.int64) * stride_w + inner[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        attn = tl.load(attn_rows + k, mask=live, other=0.0).to(tl.float32)
        scale = tl.load(NormWeight + k + inner).to(tl.float32)[None, :]
        shift = tl.load(NormBias + k + inner).to(tl.float32)[None, :]
        gated = tl.load(u_rows + k, mask=live, other=0.0).to(tl.float32) * ((attn - mean[:, None]) * rstd[:, None]
                                                                             * scale + shift)
        acc = tl.dot(gated.to(Weight.dtype.element_ty), tl.load(w_cols + k), acc)
    res = Residual + rows[:, None] * stride_res + cols[None, :]
    out = acc + tl.load(res, mask=live, other=0.0).to(tl.float32)
    tl.store(res, out.to(Residual.dtype.element_ty), mask=live)


def gated_linear_(residual: torch.Tensor, attn: torch.Tensor, u: torch.Tensor, norm_weight: torch.Tensor,
                  norm_bias: torch.Tensor, weight: torch.Tensor, shape: tuple) -> torch.Tensor:
    """The probe kernel in launch shape ``shape`` (see ``SHAPES``): ``residual`` ``[T, N]`` updated in place."""
    block_m, block_n, block_k, warps, stages = shape
    num_rows, width = attn.shape
    grid = (triton.cdiv(num_rows, block_m) * (weight.shape[0] // block_n),)
    _gated_linear_kernel[grid](attn, u, norm_weight, norm_bias, weight, residual, num_rows, attn.stride(0),
                               u.stride(0), weight.stride(0), residual.stride(0), EPS, K=width, N=weight.shape[0],
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
                               num_warps=warps)
    return residual


def engine_(residual: torch.Tensor, attn: torch.Tensor, u: torch.Tensor, norm_weight: torch.Tensor,
            norm_bias: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What ``HSTULayer`` runs on CUDA: the gate kernel, then the output GEMM accumulating into ``residual``."""
    return residual.addmm_(gated_attn_norm(attn, u, norm_weight, norm_bias, EPS, False), weight.t())


def operands(num_rows: int, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """``residual [T, D]``, ``attn [T, W]``, ``u`` (a ``[T, W]`` column block of ``[T, 4W]``), the norm's weight and
    bias, the output Linear's ``weight [D, W]``."""
    residual = torch.randn(num_rows, D_MODEL, device=device).to(dtype)
    attn = torch.randn(num_rows, WIDTH, device=device).to(dtype)
    u = torch.nn.functional.silu(torch.randn(num_rows, 4 * WIDTH, device=device)).to(dtype)[:, :WIDTH]
    norm_weight = (1 + 0.1 * torch.randn(WIDTH, device=device)).to(dtype)
    norm_bias = (0.1 * torch.randn(WIDTH, device=device)).to(dtype)
    weight = (torch.randn(D_MODEL, WIDTH, device=device) / WIDTH**0.5).to(dtype)
    return residual, attn, u, norm_weight, norm_bias, weight


def restart_and_run(fn, work: torch.Tensor, residual: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """``fn(work, *inputs)`` from ``residual``'s values: each timed in-place update starts from the same residual."""
    work.copy_(residual)
    fn(work, *inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    variants = {"engine": engine_}
    variants.update({name: functools.partial(gated_linear_, shape=shape) for name, shape in SHAPES.items()})
    times = {name: {rows: [] for rows in ROWS} for name in variants}
    diffs: dict[str, dict[int, float]] = {name: {} for name in variants}
    for _ in range(args.rounds):
        for rows in ROWS:
            residual, *inputs = operands(rows, device)
            reference = engine_(residual.clone(), *inputs).float()
            work = torch.empty_like(residual)
            for name, fn in variants.items():
                diff = (fn(residual.clone(), *inputs).float() - reference).abs().max().item()
                diffs[name][rows] = max(diffs[name].get(rows, 0.0), diff)

                call = functools.partial(restart_and_run, fn, work, residual, inputs)
                times[name][rows].append(1e3 * triton.testing.do_bench_cudagraph(call, rep=100))
    medians = {name: {rows: sorted(t)[len(t) // 2] for rows, t in by_rows.items()} for name, by_rows in times.items()}
    for name in variants:
        cells = "  ".join(f"{rows}: {medians[name][rows]:7.1f} us (diff {diffs[name][rows]:.3g})" for rows in ROWS)
        print(f"{name:18s} {cells}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"commit": args.commit, "device": torch.cuda.get_device_name(), "rounds": args.rounds,
                   "median_us": medians, "all_us": times, "max_abs_diff_vs_engine": diffs}, f, indent=1)


if __name__ == "__main__":
    main()
