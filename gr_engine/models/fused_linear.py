"""The HSTU layer's input projection with its SiLU in the GEMM's epilogue: ``silu(x @ weight.T + bias)`` in one
Triton kernel, so the ``[T, 4W]`` projection is written once, activated (docs/design.md section 4).

Each program computes a ``BLOCK_M x BLOCK_N`` tile of the output (64 rows instead of 128 in small calls, whose
128-row tiles would leave most multiprocessors idle) over the whole reduction (``K``, the model width, a
compile-time constant), its tiles moved by TMA (Hopper's tensor memory accelerator; the host builds a descriptor for
each tensor a call), float32 accumulation, bias and SiLU in float32, one rounding to the output dtype. Programs
are ordered in groups of ``GROUP_M`` row tiles so that neighbouring programs share the weight's column tiles in L2.
The row count is not specialised on (``do_not_specialize``): after a model's first launch of each tile shape no
other row count compiles a new variant; the kernel allocates only its output and never synchronises, so CUDA graphs
capture it.

This module imports Triton: :mod:`.layers` imports it only when a layer runs on CUDA. On CPU the kernel runs only in
Triton's interpreter (``TRITON_INTERPRET=1``, the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_WARPS, NUM_STAGES = 128, 128, 64, 8, 4, 3
"""Launch shape: an output tile of ``BLOCK_M x BLOCK_N`` over one warpgroup, the reduction in ``BLOCK_K`` steps over
``NUM_STAGES`` pipeline stages."""
SMALL_BLOCK_M, SMALL_MAX_ROWS = 64, 256
"""The output tile's rows in a call of at most ``SMALL_MAX_ROWS`` rows (the engine's eager warm-up, up to 512 rows,
runs both shapes)."""
# Measured on an H100 (benchmarks/results/README.md, "The projection's SiLU in its GEMM"): at 8,292 and 78,000 rows
# this shape ran 43-44 and 379-385 us against 57 and 488-493 for cuBLAS then torch's SiLU; tiles loaded by TMA were
# 6-11% faster than pointer loads, 128 x 256 tiles, 8 warps or 4 stages no faster, 128 x 128 x 128 and 64-row tiles
# 14-40% slower there; at 256 rows (32 programs of 128 rows on 132 multiprocessors) 64 x 128 tiles ran 4.7 us against
# 6.5-6.7 for 128 rows and 5.8 for cuBLAS then the SiLU, at 2,048 rows 13.0 against 10.3-10.8.


@triton.jit(do_not_specialize=["num_rows"])
def _linear_silu_kernel(x_desc, w_desc, Bias, out_desc, num_rows, N: tl.constexpr, K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        NUM_STAGES: tl.constexpr):
    """Writes one ``[BLOCK_M, BLOCK_N]`` tile of ``Out = silu(X @ Weight.T + Bias)``, tiles loaded and stored by
    TMA through the host's tensor descriptors (rows past ``num_rows`` read as zero, never stored): ``x_desc`` over
    ``X`` ``[num_rows, K]`` in ``[BLOCK_M, BLOCK_K]`` blocks, ``w_desc`` over ``Weight`` ``[N, K]`` in ``[BLOCK_N,
    BLOCK_K]``, ``out_desc`` over ``Out`` ``[num_rows, N]`` in ``[BLOCK_M, BLOCK_N]``; ``Bias``: ``[N]``. Tiles past
    ``N`` or ``K`` read zeros as well, and are not stored."""
    pid = tl.program_id(0)
    col_tiles: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    row_tiles = tl.cdiv(num_rows, BLOCK_M)
    first_row_tile = pid // (GROUP_M * col_tiles) * GROUP_M
    group_rows = min(row_tiles - first_row_tile, GROUP_M)
    in_group = pid % (GROUP_M * col_tiles)
    row0 = (first_row_tile + in_group % group_rows) * BLOCK_M
    col0 = in_group // group_rows * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        acc = tl.dot(x_desc.load([row0, k]), w_desc.load([col0, k]).T, acc)
    cols = col0 + tl.arange(0, BLOCK_N)
    acc += tl.load(Bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_desc.store([row0, col0], (acc / (1.0 + tl.exp(-acc))).to(out_desc.dtype))


def linear_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.silu(torch.nn.functional.linear(x, weight, bias))`` in one kernel.

    Args:
        x: ``[T, K]`` bf16 or fp16, unit column stride, rows 16-byte aligned (a multiple of 8 values apart, from a
            16-byte aligned start), ``K`` a multiple of 8; CUDA (or CPU under Triton's interpreter).
        weight: ``[N, K]`` (``nn.Linear``'s layout), ``x``'s dtype and device, laid out as ``x``, ``N`` a multiple of
            8 (:func:`supports` tells).
        bias: ``[N]`` contiguous, any float dtype (read as float32).

    Returns:
        ``[T, N]`` contiguous, ``x``'s dtype and device: the product accumulated in float32, bias and SiLU applied in
        float32, rounded once (the unfused ops round the product before the SiLU).
    """
    if not supports(x, weight):
        raise ValueError(f"x [T, K] and weight [N, K] must be bf16 or fp16 alike, with unit column stride, 16-byte "
                         f"aligned rows and K, N multiples of 8: got {x.dtype} {tuple(x.shape)} strides {x.stride()} "
                         f"and {weight.dtype} {tuple(weight.shape)} strides {weight.stride()}")
    num_rows, width = x.shape
    out_width = weight.shape[0]
    if bias.shape != (out_width,) or not bias.is_contiguous():
        raise ValueError(f"bias must be contiguous [{out_width}]: got {tuple(bias.shape)} strides {bias.stride()}")
    out = torch.empty((num_rows, out_width), dtype=x.dtype, device=x.device)
    if num_rows:
        block_m = SMALL_BLOCK_M if num_rows <= SMALL_MAX_ROWS else BLOCK_M
        grid = (triton.cdiv(num_rows, block_m) * triton.cdiv(out_width, BLOCK_N),)
        _linear_silu_kernel[grid](TensorDescriptor.from_tensor(x, [block_m, BLOCK_K]),
                                  TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K]), bias,
                                  TensorDescriptor.from_tensor(out, [block_m, BLOCK_N]), num_rows, N=out_width,
                                  K=width, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
                                  NUM_STAGES=NUM_STAGES, num_warps=NUM_WARPS)
    return out


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear_silu` takes ``x`` ``[T, K]`` and ``weight`` ``[N, K]``: both 2-D bf16 or both fp16 on one
    device, ``K`` and ``N`` multiples of 8, unit column strides and 16-byte aligned rows (what a TMA descriptor
    needs)."""
    if x.dim() != 2 or weight.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if weight.dtype != x.dtype or weight.device != x.device or weight.shape[1] != x.shape[1]:
        return False
    aligned = all(t.shape[1] % 8 == 0 and t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0
                  for t in (x, weight))
    return aligned and weight.shape[0] % 8 == 0
