"""Many host-to-device copies in one host call: the CUDA driver's ``cuMemcpyBatchAsync`` (CUDA 12.8 and later).

An onload's copies of one layer into the staging buffer (:mod:`.dma_staging`) are one driver call, bound with
:mod:`ctypes` from ``libcuda.so.1`` (torch does not expose it); where the driver lacks it, :meth:`BatchedCopier.load`
returns ``None`` and onload kernels read host memory directly. The copies are stream-ordered and hinted to overlap
compute; a batch may run its copies in any order, so none may depend on another. The driver accepts no batch inside a
CUDA graph capture or on the legacy default stream.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import numpy as np

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
    """The ``(dsts, srcs, sizes)`` uint64 arrays of a batch packing runs back to back from ``dst_base``: run ``i``
    copies ``counts[i]`` units of ``unit_bytes`` from ``src_addresses[i]`` (both int ``[n]``) to
    ``dst_base + unit_bytes * (counts[0] + .. + counts[i - 1])``."""
    counts = np.asarray(counts, dtype=np.uint64)
    sizes = counts * np.uint64(unit_bytes)
    dsts = np.empty_like(sizes)
    dsts[0:1] = dst_base
    np.add.accumulate(sizes[:-1], out=dsts[1:])
    dsts[1:] += np.uint64(dst_base)
    return dsts, np.asarray(src_addresses, dtype=np.int64).astype(np.uint64), sizes


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

    def layers(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, dst_layer_bytes: int,
               src_layer_bytes: int, num_layers: int, stream: int, after_layer: Callable[[int], None]) -> None:
        """Queue the copies of ``sizes[i]`` bytes from ``srcs[i] + l * src_layer_bytes`` to
        ``dsts[i] + l * dst_layer_bytes`` (uint64 ``[n]``, C-contiguous) for each layer ``l < num_layers``: one driver
        call per layer, in order, each followed by ``after_layer(l)`` (e.g. an event record), on the stream with raw
        handle ``stream``."""
        count = len(sizes)
        if not count:
            for layer in range(num_layers):
                after_layer(layer)
            return
        steps = np.arange(num_layers, dtype=np.uint64)[:, None]
        dst_rows = dsts + steps * np.uint64(dst_layer_bytes)  # [L, n], contiguous
        src_rows = srcs + steps * np.uint64(src_layer_bytes)
        sizes = np.ascontiguousarray(sizes)
        dst_base, src_base, sizes_address = dst_rows.ctypes.data, src_rows.ctypes.data, sizes.ctypes.data
        row_bytes = count * 8  # one layer's row of uint64 addresses
        for layer in range(num_layers):
            self._call(dst_base + layer * row_bytes, src_base + layer * row_bytes, sizes_address, count, stream)
            after_layer(layer)

    def _call(self, dsts: int, srcs: int, sizes: int, count: int, stream: int) -> None:
        """One driver call over ``count`` copies whose arrays start at these addresses."""
        status = self._function(dsts, srcs, sizes, count, *self._fixed, stream)
        if status:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUDA error {status} ({count} copies)")
