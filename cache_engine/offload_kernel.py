"""Offload by kernel: one launch gathers the pages of chunks from the pool, laid out like their host slots, and
quantises them to FP8 with their scales on the way.

The copy path does this with about a dozen torch operations per offload (an ``index_select`` gather, a
transpose, and the FP8 quantisation's ``abs``, ``amax``, divisions and casts), each a separate launch with its
own host cost. Here one program per (chunk, layer, K/V, head) reads that head's values of the chunk's pages
twice (largest magnitude, then scaled values) and writes them into a packed device buffer whose chunk ``j`` is
one contiguous block shaped like a host slot, ready for a single device-to-host copy.

This module imports Triton; :mod:`cache_engine` imports it only when the ``kernel`` transfer engine is chosen.
On CPU the kernel runs in Triton's interpreter (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernel_cache import CompiledKernels

FP8_MAX = tl.constexpr(448.0)  # a constexpr: jitted code reads no other globals
NUM_WARPS = 4


@triton.jit
def _pack_chunks_kernel(
    Kv, Pages, SlotIds, Out, Scales,
    NUM_LAYERS: tl.constexpr, POOL_PAGES: tl.constexpr, SLOT_PAGES: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    QUANTISE: tl.constexpr,
):
    """Program ``(j, l, kv * H + h)`` writes ``Out[j, l, :, kv, :, h, :]`` (``Out``: ``[J, L, SLOT_PAGES, 2,
    PAGE_SIZE, H, D]``) from pool pages ``Pages[j * SLOT_PAGES + p]`` of ``Kv`` (``[L, POOL_PAGES, 2, PAGE_SIZE,
    H, D]``); with ``QUANTISE``, divided by ``scale = max(amax / 448, tiny)`` (then cast to ``Out``'s dtype, FP8),
    and ``scale`` stored at ``Scales[SlotIds[j], l, kv, h]`` (``[slots, L, 2, H]`` float32)."""
    job, layer, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv, head = kvh // NUM_HEADS, kvh % NUM_HEADS
    tokens = tl.arange(0, BLOCK_T)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (tokens < PAGE_SIZE) & (dims < HEAD_DIM)
    row = NUM_HEADS * HEAD_DIM
    within = tokens * row + head * HEAD_DIM + dims  # one page's [PAGE_SIZE, D] values of this K/V and head
    page_values = 2 * PAGE_SIZE * row
    src_layer = Kv + layer.to(tl.int64) * (POOL_PAGES * page_values) + kv * (PAGE_SIZE * row)
    dst = Out + ((job.to(tl.int64) * NUM_LAYERS + layer) * SLOT_PAGES) * page_values + kv * (PAGE_SIZE * row)
    if QUANTISE:
        amax = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for p in range(SLOT_PAGES):
            page = tl.load(Pages + job * SLOT_PAGES + p).to(tl.int64)
            values = tl.load(src_layer + page * page_values + within, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(values))
        peak = tl.max(tl.max(amax, axis=1), axis=0)
        scale = tl.maximum(tl.math.div_rn(peak, tl.full([], FP8_MAX, tl.float32)), 1.1754943508222875e-38)
        slot = tl.load(SlotIds + job)
        tl.store(Scales + ((slot * NUM_LAYERS + layer) * 2 + kv) * NUM_HEADS + head, scale)
    for p in range(SLOT_PAGES):
        page = tl.load(Pages + job * SLOT_PAGES + p).to(tl.int64)
        values = tl.load(src_layer + page * page_values + within, mask=mask, other=0.0)
        if QUANTISE:
            values = tl.math.div_rn(values.to(tl.float32), scale)  # IEEE divisions (not Triton's default), as torch's
        tl.store(dst + p * page_values + within, values.to(Out.dtype.element_ty), mask=mask)


class ChunkPacker:
    """Launches the packing kernel, keeping each specialisation's compiled kernel (see
    :class:`~.kernel_cache.CompiledKernels`)."""

    def __init__(self, num_warps: int = NUM_WARPS) -> None:
        self._kernels = CompiledKernels(_pack_chunks_kernel, num_warps)

    def __call__(self, kv: torch.Tensor, pages: torch.Tensor, out: torch.Tensor,
                 slot_ids: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                 stream: torch.cuda.Stream | None = None) -> None:
        """Gather whole chunks of pages into ``out``, on the current stream.

        Args:
            kv: the pool, ``[L, num_pages, 2, page_size, H, D]``, contiguous.
            pages: int64 ``[J * slot_pages]``: chunk ``j``'s pool pages at ``[j * slot_pages, (j + 1) *
                slot_pages)``, in order (repeat the last page to fill a partial chunk).
            out: ``[J, L, slot_pages, 2, page_size, H, D]``, contiguous: the pool's dtype, or with ``scales``
                ``torch.float8_e4m3fn`` (or float32, to see the scaled values before the cast).
            slot_ids: int64 ``[J]`` host slot of each chunk (where its scales go), with ``scales``.
            scales: float32 ``[num_slots, L, 2, H]``: written at each chunk's slot with its quantisation scales
                (``amax / 448`` per layer, K/V and head, at least the smallest normal float32); ``None``: no
                scaling.
            stream: the current stream, if the caller has it (its handle then needs no lookup).
        """
        num_chunks, num_layers, slot_pages, two, page_size, num_heads, head_dim = out.shape
        if num_chunks == 0:
            return
        quantise = scales is not None
        if quantise and slot_ids is None:
            raise ValueError("scales need the chunks' slot_ids")
        slot_ids, scales = (slot_ids, scales) if quantise else (pages, out)  # placeholders, never read
        constants = {"NUM_LAYERS": num_layers, "POOL_PAGES": kv.shape[1], "SLOT_PAGES": slot_pages,
                     "PAGE_SIZE": page_size, "NUM_HEADS": num_heads, "HEAD_DIM": head_dim,
                     "BLOCK_D": triton.next_power_of_2(head_dim), "BLOCK_T": triton.next_power_of_2(page_size),
                     "QUANTISE": quantise}
        key = (kv.dtype, out.dtype, pages.dtype, slot_ids.dtype, scales.dtype, *constants.values(),
               *(t.data_ptr() % 16 for t in (kv, pages, slot_ids, out, scales)))
        self._kernels.launch(key, (num_chunks, num_layers, two * num_heads), (kv, pages, slot_ids, out, scales),
                             constants, None if stream is None else stream.cuda_stream)
