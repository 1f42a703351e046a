"""Offload by kernel: one launch gathers chunks' pages from the pool into their (pinned, device-addressable) host
slots, quantised to FP8 on the way; one program per (chunk, layer, K/V, head) reads that head's values twice (largest
magnitude, then scaled values). This module imports Triton; on CPU the kernel runs in Triton's interpreter (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernel_cache import POINTER_DTYPES, CompiledKernels

FP8_MAX = tl.constexpr(448.0)  # a constexpr: jitted code reads no other globals
NUM_WARPS = 4


@triton.jit(do_not_specialize=["OutAddr"])
def _pack_chunks_kernel(
    Kv, Pages, SlotIds, Tokens, OutAddr, Scales,
    NUM_LAYERS: tl.constexpr, POOL_PAGES: tl.constexpr, SLOT_PAGES: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr, QUANTISE: tl.constexpr, OUT_DTYPE: tl.constexpr,
):
    """Program ``(j, l, kv * H + h)`` writes ``[l, :, kv, :, h, :]`` of the slot at address ``OutAddr[j]`` (bytes;
    ``[L, SLOT_PAGES, 2, PAGE_SIZE, H, D]`` of ``OUT_DTYPE``, contiguous) from pool pages ``Pages[j * SLOT_PAGES +
    p]`` of ``Kv`` (``[L, POOL_PAGES, 2, PAGE_SIZE, H, D]``); with ``QUANTISE``, divided by ``scale = max(amax /
    448, tiny)`` (then cast to ``OUT_DTYPE``, FP8), and ``scale`` stored at ``Scales[SlotIds[j], l, kv, h]``
    (``[slots, L, 2, H]`` float32), taken over the chunk's first ``Tokens[j]`` tokens only: the rows after them,
    which hold what the page's previous owner wrote, are stored as zeros. A page id of -1 is a gap: that page of
    the slot is neither read nor written (a partial chunk's slot receives its pages only, not a whole slot's worth
    of PCIe writes). The chunk's page ids are loaded once, together (``BLOCK_P >= SLOT_PAGES``): the index arrays
    may be in host memory, where each load is a PCIe round trip."""
    job, layer, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv, head = kvh // NUM_HEADS, kvh % NUM_HEADS
    tokens = tl.arange(0, BLOCK_T)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (tokens < PAGE_SIZE) & (dims < HEAD_DIM)
    row = NUM_HEADS * HEAD_DIM
    within = tokens * row + head * HEAD_DIM + dims  # one page's [PAGE_SIZE, D] values of this K/V and head
    page_values = 2 * PAGE_SIZE * row
    src_layer = Kv + layer.to(tl.int64) * (POOL_PAGES * page_values) + kv * (PAGE_SIZE * row)
    slot_start = tl.load(OutAddr + job).to(tl.pointer_type(OUT_DTYPE))
    dst = slot_start + (layer.to(tl.int64) * SLOT_PAGES) * page_values + kv * (PAGE_SIZE * row)
    lanes = tl.arange(0, BLOCK_P)
    chunk_pages = tl.load(Pages + job * SLOT_PAGES + lanes, mask=lanes < SLOT_PAGES, other=-1).to(tl.int64)
    if QUANTISE:
        num_tokens = tl.load(Tokens + job)
        amax = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for p in range(SLOT_PAGES):
            page = tl.sum(tl.where(lanes == p, chunk_pages, 0))  # lane p of the register vector
            mine = mask & (page >= 0) & (p * PAGE_SIZE + tokens < num_tokens)
            values = tl.load(src_layer + page * page_values + within, mask=mine, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(values))
        peak = tl.max(tl.max(amax, axis=1), axis=0)
        scale = tl.maximum(tl.math.div_rn(peak, tl.full([], FP8_MAX, tl.float32)), 1.1754943508222875e-38)
        slot = tl.load(SlotIds + job)
        tl.store(Scales + ((slot * NUM_LAYERS + layer) * 2 + kv) * NUM_HEADS + head, scale)
    for p in range(SLOT_PAGES):
        page = tl.sum(tl.where(lanes == p, chunk_pages, 0))
        present = mask & (page >= 0)
        if QUANTISE:
            mine = present & (p * PAGE_SIZE + tokens < num_tokens)
            values = tl.load(src_layer + page * page_values + within, mask=mine, other=0.0)
            values = tl.math.div_rn(values.to(tl.float32), scale)  # IEEE divisions (not Triton's default), as torch's
        else:
            values = tl.load(src_layer + page * page_values + within, mask=present, other=0.0)
        tl.store(dst + p * page_values + within, values.to(OUT_DTYPE), mask=present)


class ChunkPacker:
    """Launches the packing kernel, keeping each specialisation's compiled kernel (see
    :class:`~.kernel_cache.CompiledKernels`)."""

    def __init__(self, num_warps: int = NUM_WARPS) -> None:
        self._kernels = CompiledKernels(_pack_chunks_kernel, num_warps)
        # (pool shape and dtype, out dtype, slot pages, quantise) -> (constexprs, their part of the key), built once
        self._constants: dict[tuple, tuple[dict[str, object], tuple]] = {}

    def __call__(self, kv: torch.Tensor, pages: torch.Tensor, out_addr: torch.Tensor, out_dtype: torch.dtype,
                 slot_pages: int, slot_ids: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                 stream: torch.cuda.Stream | None = None, tokens: torch.Tensor | None = None) -> None:
        """Gather whole chunks of pages into their slots, on the current stream. The index tensors (``pages``,
        ``out_addr``, ``slot_ids``, ``tokens``) may be on the device or in pinned host memory.

        Args:
            kv: the pool, ``[L, num_pages, 2, page_size, H, D]``, contiguous.
            pages: int64 ``[J * slot_pages]``: chunk ``j``'s pool pages at ``[j * slot_pages, (j + 1) *
                slot_pages)``, in order; -1 after a partial chunk's last page (those pages of its slot are left
                as they are).
            out_addr: int64 ``[J]``, the byte address of chunk ``j``'s slot, ``[L, slot_pages, 2, page_size, H, D]``
                of ``out_dtype``, contiguous: pinned host memory (device-addressable) or device memory.
            out_dtype: the slots' dtype: the pool's, or with ``scales`` ``torch.float8_e4m3fn`` (or float32, to
                see the scaled values before the cast).
            slot_pages: pages per slot.
            slot_ids: int64 ``[J]`` host slot of each chunk (where its scales go), with ``scales``.
            scales: float32 ``[num_slots, L, 2, H]``: written at each chunk's slot with its quantisation scales
                (``amax / 448`` per layer, K/V and head, at least the smallest normal float32); ``None``: no
                scaling.
            stream: the current stream, if the caller has it (its handle then needs no lookup).
            tokens: int64 ``[J]``, with ``scales``: the tokens chunk ``j`` holds (its first ``tokens[j]`` rows of
                pages, K and V each): its scales are taken over them, and the rows after them are stored as zeros.
        """
        num_chunks = out_addr.shape[0]
        if num_chunks == 0:
            return
        num_layers, _, two, page_size, num_heads, head_dim = kv.shape
        quantise = scales is not None
        if quantise and (slot_ids is None or tokens is None):
            raise ValueError("scales need the chunks' slot_ids and tokens")
        slot_ids, tokens, scales = (slot_ids, tokens, scales) if quantise else (pages, pages, kv)  # placeholders
        shape = (kv.shape, kv.dtype, out_dtype, slot_pages, quantise)
        cached = self._constants.get(shape)
        if cached is None:
            constants = {"NUM_LAYERS": num_layers, "POOL_PAGES": kv.shape[1], "SLOT_PAGES": slot_pages,
                         "PAGE_SIZE": page_size, "NUM_HEADS": num_heads, "HEAD_DIM": head_dim,
                         "BLOCK_D": triton.next_power_of_2(head_dim), "BLOCK_T": triton.next_power_of_2(page_size),
                         "BLOCK_P": triton.next_power_of_2(slot_pages),
                         "QUANTISE": quantise, "OUT_DTYPE": POINTER_DTYPES[out_dtype]}
            cached = self._constants[shape] = (constants, (kv.dtype, out_dtype, *constants.values()))
        constants, shape_key = cached
        key = (*shape_key, pages.dtype, slot_ids.dtype, tokens.dtype, out_addr.dtype, scales.dtype,
               *(t.data_ptr() % 16 for t in (kv, pages, slot_ids, tokens, scales)))
        self._kernels.launch(key, (num_chunks, num_layers, two * num_heads),
                             (kv, pages, slot_ids, tokens, out_addr, scales),
                             constants, None if stream is None else stream.cuda_stream)
