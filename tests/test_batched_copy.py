"""The batched copies' address arithmetic and driver calls (:mod:`cache_engine.batched_copy`), checked on CPU with a
stand-in driver that carries the copies out with ``memmove``."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from cache_engine.batched_copy import BatchedCopier, copy_arrays, parameter_types


def test_copy_arrays_pack_runs_back_to_back():
    dsts, srcs, sizes = copy_arrays(1000, np.array([50, 7, 900]), np.array([2, 1, 3]), 16)
    assert dsts.tolist() == [1000, 1032, 1048] and srcs.tolist() == [50, 7, 900] and sizes.tolist() == [32, 16, 48]
    assert dsts.dtype == srcs.dtype == sizes.dtype == np.uint64


def test_loading_the_copier_never_raises():
    """Without a CUDA driver (or one without batched copies) the copier is ``None``; with one it is callable, and an
    empty batch queues nothing."""
    copier = BatchedCopier.load(0)
    if copier is not None:
        calls = []
        copier.layers(*(np.empty(0, dtype=np.uint64) for _ in range(3)), 0, 0, 2, 0, calls.append)
        assert calls == [0, 1]


@pytest.mark.parametrize("with_fail_index", [False, True])
def test_the_driver_call_gets_the_batch_as_the_driver_declares_it(with_fail_index):
    """A stand-in for ``cuMemcpyBatchAsync`` (``_v2`` of CUDA 13: no ``failIdx``; CUDA 12.8's with it), declared
    with the driver's parameter types: it receives the three arrays, their length, one set of stream-ordered
    attributes applying from copy 0, and the stream; a non-zero status becomes a ``RuntimeError``."""
    seen, status = [], [0]

    def driver(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, *rest):
        def read(address, kind=ctypes.c_uint64, n=count):
            return list(ctypes.cast(address, ctypes.POINTER(kind * n)).contents)

        seen.append((read(dsts), read(srcs), read(sizes), read(attrs, ctypes.c_int, 6), read(attrs_idxs, n=1),
                     num_attrs, len(rest), rest[-1]))
        return status[0]

    function = ctypes.CFUNCTYPE(ctypes.c_int, *parameter_types(with_fail_index))(driver)
    copier = BatchedCopier(function, with_fail_index, device_index=3)
    dsts, srcs, sizes = copy_arrays(4096, np.array([100, 200]), np.array([1, 2]), 64)
    copier.layers(dsts, srcs, sizes, 0, 0, 1, 0x1234, lambda layer: None)
    assert seen == [([4096, 4160], [100, 200], [64, 128], [1, 2, 0, 1, 3, 1], [0], 1, 2 if with_fail_index else 1,
                     0x1234)]
    status[0] = 1
    with pytest.raises(RuntimeError, match="cuMemcpyBatchAsync failed with CUDA error 1"):
        copier.layers(dsts, srcs, sizes, 0, 0, 1, 0x1234, lambda layer: None)


@pytest.mark.parametrize("with_fail_index", [False, True])
def test_per_layer_batches_copy_each_layer_then_call_back(with_fail_index):
    """:meth:`BatchedCopier.layers` (the staging copies of an onload), with a stand-in driver that carries each batch
    out with ``memmove``: each layer's one batch fills that layer of a ``[L, pages, ...]`` staging buffer with every
    job's first pages of the layer, packed in job order, and ``after_layer(l)`` comes right after that layer's driver
    call; an empty batch makes no driver call but still calls back for every layer."""
    log = []

    def driver(dsts, srcs, sizes, count, *rest):
        addresses = [list(ctypes.cast(a, ctypes.POINTER(ctypes.c_uint64 * count)).contents) for a in (dsts, srcs,
                                                                                                       sizes)]
        for dst, src, size in zip(*addresses, strict=True):
            ctypes.memmove(dst, src, size)
        log.append(("call", count, rest[-1]))
        return 0

    function = ctypes.CFUNCTYPE(ctypes.c_int, *parameter_types(with_fail_index))(driver)
    copier = BatchedCopier(function, with_fail_index, device_index=0)
    layers, chunk_pages, page_shape = 3, 4, (2, 2, 3, 5)
    slots = torch.randn(5, layers, chunk_pages, *page_shape)
    counts = np.array([4, 1, 3])
    chosen = [4, 0, 2]
    staging = torch.zeros(layers, 10, *page_shape)
    page_bytes = slots.stride(2) * slots.element_size()
    dsts, srcs, sizes = copy_arrays(staging.data_ptr(), np.array([slots[i].data_ptr() for i in chosen]), counts,
                                    page_bytes)
    copier.layers(dsts, srcs, sizes, staging.stride(0) * staging.element_size(),
                  slots.stride(1) * slots.element_size(), layers, 0x99, lambda layer: log.append(("after", layer)))
    assert log == [entry for layer in range(layers) for entry in (("call", 3, 0x99), ("after", layer))]
    for layer in range(layers):
        expected = torch.cat([slots[i, layer, :n] for i, n in zip(chosen, counts, strict=True)])
        assert torch.equal(staging[layer, :8], expected), layer
    assert not staging[:, 8:].any()
    log.clear()
    empty = np.empty(0, dtype=np.uint64)
    copier.layers(empty, empty, empty, 64, 64, 3, 0x99, lambda layer: log.append(("after", layer)))
    assert log == [("after", layer) for layer in range(layers)]
