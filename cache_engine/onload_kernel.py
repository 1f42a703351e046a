"""Onload by kernel: GPU programs read host chunk pages directly and write them into the pool's pages.

Pinned host memory is mapped into the device's address space (unified virtual addressing), so a kernel
can load from it over PCIe. One launch per layer then replaces a DMA copy per (layer, chunk) into the
onload buffer plus the scatter out of it: no per-copy set-up cost, no staging buffer, FP8 dequantised on
the way. ``CacheConfig.onload_engine = "kernel"`` selects it (see :class:`~.transfer.TransferEngine`).

This module imports Triton; :mod:`cache_engine` imports it only when that engine is chosen. On CPU the
kernel runs in Triton's interpreter (tests), where "host memory" is simply memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from .kernel_cache import POINTER_DTYPES, CompiledKernels

# Launch shape: rows and warps per program. On the H200 with benchmark KV (4 x 128, page 32) every shape from 1 to
# 64 rows with enough warps reads host memory at 49.5-51 GB/s of its 55 GB/s copy peak; 8 rows x 8 warps was the
# best for bf16 host pages and within 1% of the best for FP8 (benchmarks/results/onload_sweep.json).
ROWS_PER_PROGRAM, NUM_WARPS = 8, 8


@triton.jit(do_not_specialize=["SrcAddr", "DstPage", "SlotIds", "Count", "layer_offset", "layer", "layer_elems",
                             "src_layer_bytes"])
def _onload_pages_kernel(
    Kv, SrcAddr, DstPage, SlotIds, Scales, Count, layer_offset, layer, layer_elems, src_layer_bytes,
    num_layers, num_heads, page_size,
    SRC_DTYPE: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_COUNT: tl.constexpr,
):
    """Program ``(i, r, g)`` copies rows ``r * ROWS ..`` (+ ``ROWS``) of page ``i`` in layer ``layer + g``, a row
    being ``ROW = H * D`` values of one token's K or V (row ``j``: ``j // page_size`` is K or V, ``j % page_size`` the
    token), from host address ``SrcAddr[i] + layer_offset + g * src_layer_bytes`` (bytes) to pool page ``DstPage[i]``
    of that layer (``Kv``: layer ``layer``, ``[num_pages, 2, page_size, H, D]``, contiguous, the next layer
    ``layer_elems`` values further); with ``HAS_SCALES``, times ``Scales[SlotIds[i], layer + g, K/V, head]``
    (``[slots, L, 2, H]`` float32). With ``HAS_COUNT``, only pages ``i < Count[0]`` are copied (a grid sized to a
    capacity, as in a CUDA graph)."""
    page = tl.program_id(0)
    step = tl.program_id(2).to(tl.int64)  # the layer within the launch's group
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    if HAS_COUNT:
        live = page < tl.load(Count)
    else:
        live = page >= 0
    valid = (cols < ROW) & live
    offsets = rows * ROW + cols
    # Pages start 16-byte aligned (slots and pages are whole multiples of 16 bytes): say so, for wide loads.
    src = tl.load(SrcAddr + page, mask=live, other=0) + layer_offset + step * src_layer_bytes
    src = tl.multiple_of(src, 16).to(tl.pointer_type(SRC_DTYPE))
    values = tl.load(src + offsets, mask=valid, other=0.0).to(tl.float32)
    if HAS_SCALES:
        slot = tl.load(SlotIds + page, mask=live, other=0)
        kv = rows // page_size
        scale_at = ((slot * num_layers + layer + step) * 2 + kv) * num_heads + cols // HEAD_DIM
        values *= tl.load(Scales + scale_at, mask=valid, other=1.0)
    dst = tl.load(DstPage + page, mask=live, other=0).to(tl.int64) * (2 * page_size * ROW) + step * layer_elems
    tl.store(Kv + dst + offsets, values.to(Kv.dtype.element_ty), mask=valid)


def onload_pages(kv_layer: torch.Tensor, src_addr: torch.Tensor, dst_pages: torch.Tensor, layer_offset: int,
                 src_dtype: torch.dtype, layer: int = 0, slot_ids: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None, rows_per_program: int = ROWS_PER_PROGRAM,
                 num_warps: int = NUM_WARPS) -> None:
    """Write host pages into one layer of the pool, on the current stream (one launch through Triton's JIT
    dispatch; :class:`OnloadLauncher` launches repeatedly at less host cost).

    Args:
        kv_layer: ``[num_pages, 2, page_size, H, D]`` one layer of the pool, contiguous, written in place.
        src_addr: int64 ``[P]`` host byte address of each page's first layer (``[2, page_size, H, D]`` of
            ``src_dtype``, contiguous); pinned memory on CUDA.
        dst_pages: int64 ``[P]`` pool page of each.
        layer_offset: bytes from a page's first-layer address to this layer's.
        src_dtype: dtype of the host pages (the pool's, or ``torch.float8_e4m3fn``).
        layer: this layer's index (for the scales).
        slot_ids: int64 ``[P]`` host slot of each page, with ``scales``.
        scales: float32 ``[num_slots, L, 2, H]`` dequantisation scales of FP8 pages, or ``None``.
        rows_per_program: K/V rows (one token's ``H * D`` values each) copied by one program, a power of two;
            capped at the largest power of two dividing ``2 * page_size``.
        num_warps: warps per program.
    """
    OnloadLauncher(rows_per_program, num_warps)(kv_layer, src_addr, dst_pages, layer_offset, src_dtype, layer,
                                                slot_ids, scales)


class OnloadLauncher:
    """Launches the onload kernel (arguments as :func:`onload_pages`), keeping each specialisation's compiled
    kernel (:class:`~.kernel_cache.CompiledKernels`). The key holds everything the compiled kernel is specialised
    on: dtypes, the values of the specialised integers, the pool and scale pointers' 16-byte alignment."""

    def __init__(self, rows_per_program: int = ROWS_PER_PROGRAM, num_warps: int = NUM_WARPS) -> None:
        self.rows_per_program = rows_per_program
        self._kernels = CompiledKernels(_onload_pages_kernel, num_warps)

    def __call__(self, kv_layer: torch.Tensor, src_addr: torch.Tensor, dst_pages: torch.Tensor, layer_offset: int,
                 src_dtype: torch.dtype, layer: int = 0, slot_ids: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None) -> None:
        if src_addr.shape[0]:
            launch, fixed = self._bind(kv_layer, src_addr, dst_pages, src_dtype, slot_ids, scales, None, 0, None, 1)
            launch((kv_layer, *fixed[:5], layer_offset, layer, *fixed[5:]))

    def all_layers(self, kv: torch.Tensor, src_addr: torch.Tensor, dst_pages: torch.Tensor, layer_bytes: int,
                   src_dtype: torch.dtype, slot_ids: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                   events: list[torch.cuda.Event] | None = None, stream: torch.cuda.Stream | None = None,
                   count: torch.Tensor | None = None, before_group: Callable[[int], None] | None = None,
                   group: int = 1) -> None:
        """Load every layer of the pool ``kv`` (``[L, num_pages, 2, page_size, H, D]``, contiguous), reading host
        addresses ``src_addr + l * layer_bytes`` for layer ``l``: one launch per group of ``group`` consecutive
        layers (``0 .. group - 1``, ``group .. 2 * group - 1``, ..; the last group possibly smaller), then a record of
        ``events[last]`` (if given, one per layer), ``last`` being the group's last layer, on ``stream``; the rest as
        :func:`onload_pages`. ``stream``, if given, must be the current stream: its handle then needs no lookup per
        launch. ``count``: int64 ``[1]`` on the device; if given, only the first ``count[0]`` entries of the index
        tensors are loaded (the launches can then be captured once for index tensors of a fixed capacity).
        ``before_group(last)``, if given, is called just before the launch of the group ending at layer ``last`` (to
        queue a wait, say)."""
        if src_addr.shape[0] == 0:
            return
        num_layers = kv.shape[0]
        uniform = kv[0].nbytes % 16 == 0  # then every layer has the first one's 16-byte alignment
        handle = None if stream is None else stream.cuda_stream
        bind = (src_addr, dst_pages, src_dtype, slot_ids, scales, count, layer_bytes, handle)
        launch, size = None, 0
        for first in range(0, num_layers, group):
            kv_layer, last = kv[first], min(first + group, num_layers) - 1
            if launch is None or not uniform or size != last + 1 - first:
                size = last + 1 - first
                launch, fixed = self._bind(kv_layer, *bind, size)
            if before_group is not None:
                before_group(last)
            launch((kv_layer, *fixed[:5], first * layer_bytes, first, *fixed[5:]))
            if events is not None:
                events[last].record(stream)

    def _bind(self, kv_layer: torch.Tensor, src_addr: torch.Tensor, dst_pages: torch.Tensor, src_dtype: torch.dtype,
              slot_ids: torch.Tensor | None, scales: torch.Tensor | None, count: torch.Tensor | None, layer_bytes: int,
              stream: int | None, layers: int) -> tuple[Callable[[tuple[Any, ...]], None], tuple[Any, ...]]:
        """A launch of the kernel's specialisation for these arguments over ``layers`` consecutive layers from
        ``kv_layer`` (one layer of a contiguous pool; host layers ``layer_bytes`` apart), taking the whole argument
        tuple, and the arguments shared by every launch: ``(src_addr, dst_pages, slot_ids, scales, count,
        layer_elems, layer_bytes, num_layers, num_heads, page_size)``."""
        _, two, page_size, num_heads, head_dim = kv_layer.shape
        row = num_heads * head_dim
        rows = min(self.rows_per_program, (two * page_size) & -(two * page_size))  # a power of 2 dividing 2 * page_size
        has_scales, has_count = scales is not None, count is not None
        slot_ids, scales = (slot_ids, scales) if has_scales else (dst_pages, kv_layer)  # placeholders: never read
        count = count if has_count else dst_pages
        num_layers = scales.shape[1] if has_scales else 1
        layer_elems = kv_layer.numel()  # from one layer of the (contiguous) pool to the next
        constants = {"SRC_DTYPE": POINTER_DTYPES[src_dtype], "ROW": row, "BLOCK": triton.next_power_of_2(row),
                     "HEAD_DIM": head_dim, "ROWS": rows, "HAS_SCALES": has_scales, "HAS_COUNT": has_count}
        key = (kv_layer.dtype, src_dtype, src_addr.dtype, dst_pages.dtype, slot_ids.dtype, scales.dtype, count.dtype,
               num_layers, num_heads, page_size, row, head_dim, rows, has_scales, has_count, kv_layer.data_ptr() % 16,
               scales.data_ptr() % 16, _small(layer_elems), _small(layer_bytes))
        grid, kernels = (src_addr.shape[0], two * page_size // rows, layers), self._kernels

        def launch(args: tuple[Any, ...]) -> None:  # Triton types an integer i32 or i64 by its value: so does the key
            kernels.launch((*key, _small(args[6])), grid, args, constants, stream)

        return launch, (src_addr, dst_pages, slot_ids, scales, count, layer_elems, layer_bytes, num_layers, num_heads,
                        page_size)


def _small(value: int) -> bool:
    """Whether Triton passes this integer argument as i32 (else i64)."""
    return -(2**31) <= value < 2**31
