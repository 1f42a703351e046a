"""Would a prefill's attention run faster reading K and V where the projection wrote them (dense rows, loadable by TMA)
than from the paged cache? On the GPU: the engine's paged kernel (hstu_triton, its own launch shape) against a
probe kernel over the dense ``[T, 4W]`` projection (u, v, q, k column blocks), with pointer loads and with TMA, in
several launch shapes, on one request of T new history rows (a cold first visit's or recompute's causal part).

    python benchmarks/dense_attention_probe.py --out dense_attention.json [--lengths 8192,16384] [--rounds 3]

Each round times every variant at every length replayed from a CUDA graph (``do_bench_cudagraph``, device time);
TFLOP/s count causal pairs once (``4 * H * D`` a pair). Each variant's output is compared with the paged kernel's
(the same K and V written into shuffled pages): bf16 outputs one rounding apart, the sums in another order.
The probe kernel is not the engine's: it has no candidates, no split tiles and one request.
"""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np
import torch
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

from attention_backends import AttentionSpec, PagedBatchMetadata
from attention_backends.hstu_triton import HSTUTritonBackend

HEADS, DIM, PAGE = 4, 128, 32
WIDTH = HEADS * DIM
SPEC = AttentionSpec(kind="hstu", num_heads=HEADS, head_dim=DIM, page_size=PAGE, dtype=torch.bfloat16,
                     device_type="cuda", alpha=DIM**-0.5, scaling_seqlen=20_000)
SHAPES = {  # name: (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA)
    "ptr_128x128_w8_s3": (128, 128, 8, 3, False),
    "tma_128x128_w8_s3": (128, 128, 8, 3, True),
    "tma_128x128_w8_s2": (128, 128, 8, 2, True),
    "tma_128x64_w8_s3": (128, 64, 8, 3, True),
    "tma_128x128_w4_s3": (128, 128, 4, 3, True),
}
# (tl.range(..., warp_specialize=True) compiled to the same SASS at 8 warps and failed to compile at 4 on sm_90:
# benchmarks/results/README.md, "Compiled, not yet timed ... from the step's own rows".)


@triton.jit
def _silu(x, alpha, FAST: tl.constexpr):
    """``silu(alpha * x)``: one ``tanh.approx.f32`` a value where ``FAST`` (CUDA), else with a sigmoid."""
    half = x * (0.5 * alpha)
    if FAST:
        tanh = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [half], dtype=tl.float32,
                                         is_pure=True, pack=1)
        return half + half * tanh
    return 2.0 * half * tl.sigmoid(2.0 * half)


@triton.jit
def _key_tile(acc, q, kv_desc, Proj, start_n, rows, num_rows, head, stride_row, alpha, MASKED: tl.constexpr,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, WIDTH: tl.constexpr, TMA: tl.constexpr,
              FAST: tl.constexpr):
    """``acc += silu(alpha q k^T) v`` over keys ``start_n ..`` (+ ``BLOCK_N``); ``MASKED``: causal, in the rows."""
    keys = start_n + tl.arange(0, BLOCK_N)
    if TMA:
        k = kv_desc.load([start_n, 3 * WIDTH + head * HEAD_DIM])
        v = kv_desc.load([start_n, WIDTH + head * HEAD_DIM])
    else:
        ptrs = Proj + keys.to(tl.int64)[:, None] * stride_row + head * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
        in_rows = (keys < num_rows)[:, None]
        k = tl.load(ptrs + 3 * WIDTH, mask=in_rows, other=0.0)
        v = tl.load(ptrs + WIDTH, mask=in_rows, other=0.0)
    p = _silu(tl.dot(q, tl.trans(k)), alpha, FAST)
    if MASKED:
        p = tl.where(keys[None, :] <= rows[:, None], p, 0.0)
    return tl.dot(p.to(v.dtype), v, acc)


@triton.jit
def _dense_prefill_kernel(q_desc, kv_desc, Proj, Out, num_rows, stride_row, stride_ot, alpha, inv_scaling,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, TMA: tl.constexpr,
                          FAST: tl.constexpr):
    """One (query tile, head), longest tiles first: causal HSTU attention of one request's ``num_rows`` new rows,
    q, k, v read from ``Proj`` ``[num_rows, 4W]`` (u, v, q, k column blocks, rows ``stride_row`` apart; with
    ``TMA`` through descriptors over it, ``q_desc`` in ``[BLOCK_M, HEAD_DIM]`` blocks, ``kv_desc`` in ``[BLOCK_N,
    HEAD_DIM]``). ``Out``: ``[num_rows, H, D]``."""
    pid = tl.program_id(0)
    tile = tl.cdiv(num_rows, BLOCK_M) - 1 - pid // NUM_HEADS
    head = pid % NUM_HEADS
    first = tile * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    WIDTH: tl.constexpr = NUM_HEADS * HEAD_DIM
    if TMA:
        q = q_desc.load([first, 2 * WIDTH + head * HEAD_DIM])
    else:
        q_ptrs = Proj + rows.to(tl.int64)[:, None] * stride_row + 2 * WIDTH + head * HEAD_DIM + dims[None, :]
        q = tl.load(q_ptrs, mask=(rows < num_rows)[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    unmasked_end = first // BLOCK_N * BLOCK_N  # key tiles every row of the tile sees whole
    for start_n in tl.range(0, unmasked_end, BLOCK_N, num_stages=NUM_STAGES):
        acc = _key_tile(acc, q, kv_desc, Proj, start_n, rows, num_rows, head, stride_row, alpha, False, BLOCK_N,
                        HEAD_DIM, WIDTH, TMA, FAST)
    for start_n in tl.range(unmasked_end, tl.minimum(first + BLOCK_M, num_rows), BLOCK_N):
        acc = _key_tile(acc, q, kv_desc, Proj, start_n, rows, num_rows, head, stride_row, alpha, True, BLOCK_N,
                        HEAD_DIM, WIDTH, TMA, FAST)
    out_ptrs = Out + rows.to(tl.int64)[:, None] * stride_ot + head * HEAD_DIM + dims[None, :]
    tl.store(out_ptrs, (acc * inv_scaling).to(Out.dtype.element_ty), mask=(rows < num_rows)[:, None])


def dense_prefill(proj: torch.Tensor, shape: tuple, fast: bool) -> torch.Tensor:
    """The probe kernel over ``proj`` ``[T, 4W]`` in launch shape ``shape`` (see ``SHAPES``): ``[T, H, D]``."""
    block_m, block_n, warps, stages, tma = shape
    num_rows = proj.shape[0]
    out = torch.empty((num_rows, HEADS, DIM), dtype=proj.dtype, device=proj.device)
    q_desc, kv_desc = ((TensorDescriptor.from_tensor(proj, [block_m, DIM]),
                        TensorDescriptor.from_tensor(proj, [block_n, DIM])) if tma else (proj, proj))
    grid = (triton.cdiv(num_rows, block_m) * HEADS,)
    _dense_prefill_kernel[grid](q_desc, kv_desc, proj, out, num_rows, proj.stride(0), out.stride(0), SPEC.alpha,
                                1.0 / SPEC.scaling_seqlen, NUM_HEADS=HEADS, HEAD_DIM=DIM, BLOCK_M=block_m,
                                BLOCK_N=block_n, NUM_STAGES=stages, TMA=tma, FAST=fast,
                                num_warps=warps)
    return out


def paged_step(proj: torch.Tensor) -> tuple:
    """The engine kernel's inputs for the same prefill: K and V of ``proj`` written into shuffled pages."""
    num_rows, device = proj.shape[0], proj.device
    num_pages = -(-num_rows // PAGE)
    indices = np.random.default_rng(0).permutation(num_pages + 8)[:num_pages]
    cache = torch.zeros(num_pages + 8, 2, PAGE, HEADS, DIM, dtype=proj.dtype, device=device)
    positions = torch.arange(num_rows, device=device)
    page = torch.as_tensor(indices, device=device)[positions // PAGE]
    heads = proj.unflatten(1, (4, HEADS, DIM))  # u, v, q, k
    cache[page, 0, positions % PAGE] = heads[:, 3]
    cache[page, 1, positions % PAGE] = heads[:, 1]
    meta = PagedBatchMetadata.from_layout(np.array([0]), np.array([num_rows]), np.array([0]),
                                          np.array([0, num_pages]), indices, PAGE, device)
    return heads[:, 2], heads[:, 3], heads[:, 1], cache, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", default="8192,16384")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    lengths = [int(n) for n in args.lengths.split(",")]
    times: dict[str, dict[int, list[float]]] = {}
    diffs: dict[str, dict[int, float]] = {}
    errors: dict[str, str] = {}
    for _ in range(args.rounds):
        for length in lengths:
            proj = torch.randn(length, 4 * WIDTH, device=device, dtype=torch.bfloat16)
            q, k, v, cache, meta = paged_step(proj)
            backend = HSTUTritonBackend(SPEC)
            attend = functools.partial(backend.attend, q, k, v, cache, backend.build_metadata(meta))
            variants = {"paged_engine": attend}
            variants.update({name: functools.partial(dense_prefill, proj, shape, True)
                             for name, shape in SHAPES.items() if name not in errors})
            reference = variants["paged_engine"]().float()
            for name, fn in variants.items():
                try:
                    diff = (fn().float() - reference).abs().max().item()
                    seconds = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") / 1e3
                except Exception as exc:  # a shape or feature Triton cannot compile here
                    errors[name] = repr(exc)[:300]
                    continue
                diffs.setdefault(name, {})[length] = max(diffs.get(name, {}).get(length, 0.0), diff)
                times.setdefault(name, {}).setdefault(length, []).append(seconds)
    result = {"commit": args.commit, "device": torch.cuda.get_device_name(), "rounds": args.rounds, "tflops": {},
              "max_abs_diff_vs_paged": diffs, "errors": errors}
    for name, by_length in times.items():
        result["tflops"][name] = {n: 4 * HEADS * DIM * n * (n + 1) / 2 / float(np.median(t)) / 1e12
                                  for n, t in by_length.items()}
        cells = "  ".join(f"{n}: {tf:6.1f} TFLOP/s (diff {diffs[name][n]:.3g})"
                          for n, tf in result["tflops"][name].items())
        print(f"{name:24s} {cells}", flush=True)
    for name, error in errors.items():
        print(f"{name:24s} failed: {error}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
