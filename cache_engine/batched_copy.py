"""Many host-to-device copies in one host call: the CUDA driver's ``cuMemcpyBatchAsync`` (CUDA 12.8 and later).

The ``copy`` onload engine copies each host chunk's block of a layer into the onload buffer with the DMA engines,
which leaves the multiprocessors to the forward; a copy per (layer, chunk) costs the host one torch call each
(~10 us on the GPU machine, ~30 calls a layer for a batch of 8). :class:`BatchedCopier` issues a layer's copies in
one driver call instead. torch does not expose the call, so it is bound here with :mod:`ctypes` from the driver
library torch already uses (``libcuda.so.1``); where the driver lacks it, :meth:`BatchedCopier.load` returns
``None`` and the engine copies one chunk at a time.

The copies are stream-ordered (``CU_MEMCPY_SRC_ACCESS_ORDER_STREAM``) and hinted to run beside compute
(``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``); a batch may run its copies in any order, so none may depend on
another. The driver does not accept a batch inside a CUDA graph capture, nor on the legacy default stream.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .jobs import OnloadJob, job_slot_addresses

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2  # CU_MEM_LOCATION_TYPE_DEVICE / _HOST


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]  # CUmemLocation


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]  # CUmemcpyAttributes_v1


def copy_arrays(dst_base: int, src_addresses: np.ndarray, counts: np.ndarray, unit_bytes: int) -> tuple[
        np.ndarray, np.ndarray, np.ndarray]:
    """The ``(dsts, srcs, sizes)`` uint64 arrays of a batch that packs runs of units back to back from
    ``dst_base``: run ``i`` copies ``counts[i]`` units of ``unit_bytes`` from address ``src_addresses[i]`` to
    ``dst_base + unit_bytes * (counts[0] + .. + counts[i - 1])``. ``src_addresses``, ``counts``: int ``[n]``."""
    counts = np.asarray(counts, dtype=np.uint64)
    sizes = counts * np.uint64(unit_bytes)
    dsts = np.empty_like(sizes)
    dsts[0:1] = dst_base
    np.add.accumulate(sizes[:-1], out=dsts[1:])
    dsts[1:] += np.uint64(dst_base)
    return dsts, np.asarray(src_addresses, dtype=np.int64).astype(np.uint64), sizes


def onload_batches(jobs: list[OnloadJob], counts: np.ndarray, buffers: list[torch.Tensor],
                   slot_addresses: np.ndarray | None, share: int) -> list[tuple[tuple[np.ndarray, np.ndarray],
                                                                                  np.ndarray, np.ndarray, int]]:
    """An onload's copies of layer 0 into each of the two onload ``buffers`` (``[>= sum(counts), 2, page_size,
    H, D]``, the host dtype): job ``j``'s first ``counts[j]`` pages of its slot, packed in job order. Per share
    ``s`` of ``share`` (jobs ``s, s + share, ..``: one per onload stream): ``((dsts into buffer 0, dsts into
    buffer 1), srcs, sizes, layer_bytes)``; layer ``l``'s sources are ``srcs + l * layer_bytes``.
    ``slot_addresses``: int64, each slot id's host address, or ``None``: ask each job's slot tensor."""
    slot = jobs[0].slot
    layer_bytes, page_bytes = slot.stride(0) * slot.element_size(), slot.stride(1) * slot.element_size()
    offsets, srcs, sizes = copy_arrays(0, job_slot_addresses(jobs, slot_addresses), counts, page_bytes)
    bases = [np.uint64(buffer.data_ptr()) for buffer in buffers]
    return [(tuple(offsets[s::share] + base for base in bases), srcs[s::share].copy(), sizes[s::share].copy(),
             layer_bytes) for s in range(share)]


def parameter_types(with_fail_index: bool) -> list[type]:
    """``cuMemcpyBatchAsync``'s parameters: ``dsts``, ``srcs``, ``sizes`` (arrays), ``count``, ``attrs``,
    ``attrsIdxs``, ``numAttrs``, then (CUDA 12.8's, not ``_v2``) ``failIdx``, then ``hStream``."""
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    return [pointer, pointer, pointer, size, pointer, pointer, size, *([pointer] if with_fail_index else []), pointer]


class BatchedCopier:
    """Issues host-to-device copies to one device as one ``cuMemcpyBatchAsync`` call per batch."""

    def __init__(self, function: ctypes._CFuncPtr, with_fail_index: bool, device_index: int) -> None:
        self._function = function
        self._attributes = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(_LOCATION_HOST, 0),
                                             _MemLocation(_LOCATION_DEVICE, device_index),
                                             _FLAG_PREFER_OVERLAP_WITH_COMPUTE)
        self._first_index = (ctypes.c_size_t * 1)(0)  # every copy has the one set of attributes
        self._fail_index = ctypes.c_size_t(0)
        # The driver's arguments after (dsts, srcs, sizes, count), up to the stream: the same for every call.
        self._fixed = (ctypes.addressof(self._attributes), ctypes.addressof(self._first_index), 1,
                       *((ctypes.addressof(self._fail_index),) if with_fail_index else ()))

    @classmethod
    def load(cls, device_index: int) -> BatchedCopier | None:
        """The copier, or ``None`` (logged) where the driver has no ``cuMemcpyBatchAsync``."""
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError:
            logger.warning("no CUDA driver library to batch copies with; copying one chunk at a time")
            return None
        for name, with_fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
            function = getattr(driver, name, None)
            if function is not None:
                function.restype, function.argtypes = ctypes.c_int, parameter_types(with_fail_index)
                return cls(function, with_fail_index, device_index)
        logger.warning("this CUDA driver has no cuMemcpyBatchAsync; copying one chunk at a time")
        return None

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """Queue copying ``sizes[i]`` bytes from address ``srcs[i]`` to ``dsts[i]`` for every ``i`` (uint64 ``[n]``
        arrays, C-contiguous) on the CUDA stream with handle ``stream`` (not the legacy default stream; not while
        capturing a graph). The arrays are read during the call only."""
        if len(sizes):
            self._call(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes), stream)

    def layers(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, dst_layer_bytes: int,
               src_layer_bytes: int, num_layers: int, stream: int, after_group: Callable[[int], None],
               group: int = 1) -> None:
        """Queue the copies of ``sizes[i]`` bytes from ``srcs[i] + l * src_layer_bytes`` to ``dsts[i] + l *
        dst_layer_bytes`` (uint64 ``[n]``) for every layer ``l`` of ``num_layers``: one batch per group of ``group``
        consecutive layers (``0 .. group - 1``, ``group .. 2 * group - 1``, ..; the last possibly smaller), in order,
        each followed by ``after_group(last)``, ``last`` being the group's last layer (to record an event after the
        group's copies, say); as :meth:`__call__` otherwise. The addresses of every layer are computed at once."""
        count = len(sizes)
        if not count:
            for first in range(0, num_layers, group):
                after_group(min(first + group, num_layers) - 1)
            return
        steps = np.arange(num_layers, dtype=np.uint64)[:, None]
        dst_rows = dsts + steps * np.uint64(dst_layer_bytes)  # [L, n], contiguous: a group's rows are one run
        src_rows = srcs + steps * np.uint64(src_layer_bytes)
        sizes = np.tile(np.ascontiguousarray(sizes), min(group, num_layers))  # the sizes of a whole group's rows
        dst_base, src_base, sizes_address = dst_rows.ctypes.data, src_rows.ctypes.data, sizes.ctypes.data
        row_bytes = count * 8  # one layer's row of uint64 addresses
        for first in range(0, num_layers, group):
            last = min(first + group, num_layers) - 1
            self._call(dst_base + first * row_bytes, src_base + first * row_bytes, sizes_address,
                       (last + 1 - first) * count, stream)
            after_group(last)

    def _call(self, dsts: int, srcs: int, sizes: int, count: int, stream: int) -> None:
        """One driver call over ``count`` copies whose arrays start at these addresses."""
        status = self._function(dsts, srcs, sizes, count, *self._fixed, stream)
        if status:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUDA error {status} ({count} copies)")
