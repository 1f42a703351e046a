"""The onload kernel: one launch per layer writes every page of an onload into its pool page, dequantising FP8, from
the DMA staging buffer (:mod:`.dma_staging`) or else pinned host memory directly (docs/design.md section 5). This
module imports Triton; on CPU the kernel runs in Triton's interpreter (tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from .kernel_cache import POINTER_DTYPES, CompiledKernels

# Launch shape: rows and warps per program (tuned; any power of two is correct).
ROWS_PER_PROGRAM, NUM_WARPS = 8, 8


@triton.jit(do_not_specialize=["SrcAddr", "DstPage", "SlotIds", "layer_offset", "layer"])
def _onload_pages_kernel(
    Kv, SrcAddr, DstPage, SlotIds, Scales, layer_offset, layer, num_layers, num_heads, page_size,
    SRC_DTYPE: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr, HAS_SCALES: tl.constexpr,
):
    """Program ``(i, r)`` copies rows ``r * ROWS ..`` (+ ``ROWS``) of page ``i``, a row being ``ROW = H * D`` values
    of one token's K or V (row ``j``: ``j // page_size`` is K or V, ``j % page_size`` the token), from host address
    ``SrcAddr[i] + layer_offset`` (bytes) to pool page ``DstPage[i]`` of ``Kv`` (one layer, ``[num_pages, 2,
    page_size, H, D]``, contiguous); with ``HAS_SCALES``, times ``Scales[SlotIds[i], layer, K/V, head]`` (``[slots,
    L, 2, H]`` float32)."""
    page = tl.program_id(0)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    valid = cols < ROW
    offsets = rows * ROW + cols
    # Pages start 16-byte aligned (slots and pages are whole multiples of 16 bytes): say so, for wide loads.
    src = tl.load(SrcAddr + page) + layer_offset
    src = tl.multiple_of(src, 16).to(tl.pointer_type(SRC_DTYPE))
    values = tl.load(src + offsets, mask=valid, other=0.0).to(tl.float32)
    if HAS_SCALES:
        slot = tl.load(SlotIds + page)
        kv = rows // page_size
        scale_at = ((slot * num_layers + layer) * 2 + kv) * num_heads + cols // HEAD_DIM
        values *= tl.load(Scales + scale_at, mask=valid, other=1.0)
    dst = tl.load(DstPage + page).to(tl.int64) * (2 * page_size * ROW)
    tl.store(Kv + dst + offsets, values.to(Kv.dtype.element_ty), mask=valid)


class OnloadLauncher:
    """Launches the onload kernel, keeping each compiled specialisation (:class:`~.kernel_cache.CompiledKernels`),
    keyed by dtypes, specialised integers' values, and the pool and scale pointers' 16-byte alignment.

    Args:
        rows_per_program: K/V rows (one token's ``H * D`` values each) copied by one program, a power of two; capped
            at the largest power of two dividing ``2 * page_size``.
        num_warps: warps per program.
    """

    def __init__(self, rows_per_program: int = ROWS_PER_PROGRAM, num_warps: int = NUM_WARPS) -> None:
        self.rows_per_program = rows_per_program
        self._kernels = CompiledKernels(_onload_pages_kernel, num_warps)

    def all_layers(self, kv: torch.Tensor, src_addr: torch.Tensor, dst_pages: torch.Tensor, layer_bytes: int,
                   src_dtype: torch.dtype, slot_ids: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                   events: list[torch.cuda.Event] | None = None, stream: torch.cuda.Stream | None = None,
                   before_layer: Callable[[int], None] | None = None) -> None:
        """Write pages into every layer of the pool, on the current stream: one launch per layer, each preceded by
        ``before_layer(l)`` if given (to queue a wait, say) and followed by a record of ``events[l]`` (if given).

        Args:
            kv: the pool, ``[L, num_pages, 2, page_size, H, D]``, contiguous, written in place.
            src_addr: int64 ``[P]``, the byte address of each page's first layer (``[2, page_size, H, D]`` of
                ``src_dtype``, contiguous; layer ``l`` is ``l * layer_bytes`` further): pinned host memory or device
                memory (a staging buffer).
            dst_pages: int64 ``[P]``, the pool page of each.
            layer_bytes: bytes from one layer of a source page to the next.
            src_dtype: dtype of the source pages (the pool's, or ``torch.float8_e4m3fn``).
            slot_ids: int64 ``[P]``, the host slot of each page, with ``scales``.
            scales: float32 ``[num_slots, L, 2, H]`` dequantisation scales of FP8 pages, or ``None``.
            events: one per layer, recorded on ``stream`` after that layer's launch.
            stream: the current stream, if the caller has it (its handle then needs no lookup per launch).
            before_layer: called with ``l`` just before layer ``l``'s launch.
        """
        if src_addr.shape[0] == 0:
            return
        uniform = kv[0].nbytes % 16 == 0  # then every layer has the first one's 16-byte alignment
        handle = None if stream is None else stream.cuda_stream
        launch = None
        for layer in range(kv.shape[0]):
            kv_layer = kv[layer]
            if launch is None or not uniform:
                launch, fixed = self._bind(kv_layer, src_addr, dst_pages, src_dtype, slot_ids, scales, handle)
            if before_layer is not None:
                before_layer(layer)
            launch((kv_layer, *fixed[:4], layer * layer_bytes, layer, *fixed[4:]))
            if events is not None:
                events[layer].record(stream)

    def _bind(self, kv_layer: torch.Tensor, src_addr: torch.Tensor, dst_pages: torch.Tensor, src_dtype: torch.dtype,
              slot_ids: torch.Tensor | None, scales: torch.Tensor | None, stream: int | None
              ) -> tuple[Callable[[tuple[Any, ...]], None], tuple[Any, ...]]:
        """A launch of the kernel's specialisation for these arguments over ``kv_layer`` (one layer of a contiguous
        pool), taking the whole argument tuple, and the arguments shared by every launch: ``(src_addr, dst_pages,
        slot_ids, scales, num_layers, num_heads, page_size)``."""
        _, two, page_size, num_heads, head_dim = kv_layer.shape
        row = num_heads * head_dim
        rows = min(self.rows_per_program, (two * page_size) & -(two * page_size))  # a power of 2 dividing 2 * page_size
        has_scales = scales is not None
        slot_ids, scales = (slot_ids, scales) if has_scales else (dst_pages, kv_layer)  # placeholders: never read
        num_layers = scales.shape[1] if has_scales else 1
        constants = {"SRC_DTYPE": POINTER_DTYPES[src_dtype], "ROW": row, "BLOCK": triton.next_power_of_2(row),
                     "HEAD_DIM": head_dim, "ROWS": rows, "HAS_SCALES": has_scales}
        key = (kv_layer.dtype, src_dtype, src_addr.dtype, dst_pages.dtype, slot_ids.dtype, scales.dtype, num_layers,
               num_heads, page_size, row, head_dim, rows, has_scales, kv_layer.data_ptr() % 16, scales.data_ptr() % 16)
        grid, kernels = (src_addr.shape[0], two * page_size // rows), self._kernels

        def launch(args: tuple[Any, ...]) -> None:  # Triton types an integer i32 or i64 by its value: so does the key
            kernels.launch((*key, _small(args[5])), grid, args, constants, stream)

        return launch, (src_addr, dst_pages, slot_ids, scales, num_layers, num_heads, page_size)


def _small(value: int) -> bool:
    """Whether Triton passes this integer argument as i32 (else i64)."""
    return -(2**31) <= value < 2**31
