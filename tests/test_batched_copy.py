"""The batched copies' address arithmetic (:mod:`cache_engine.batched_copy`), checked on CPU by carrying the copies
out with ``memmove`` and comparing with the copy engine's per-chunk slices."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from cache_engine.batched_copy import BatchedCopier, copy_arrays, onload_batches, parameter_types
from cache_engine.jobs import OnloadJob


def test_copy_arrays_pack_runs_back_to_back():
    dsts, srcs, sizes = copy_arrays(1000, np.array([50, 7, 900]), np.array([2, 1, 3]), 16)
    assert dsts.tolist() == [1000, 1032, 1048] and srcs.tolist() == [50, 7, 900] and sizes.tolist() == [32, 16, 48]
    assert dsts.dtype == srcs.dtype == sizes.dtype == np.uint64


@pytest.mark.parametrize("share", [1, 2, 3])
@pytest.mark.parametrize("by_table", [False, True])
def test_onload_batches_copy_what_the_per_chunk_copies_do(share, by_table):
    """Every layer's batched copies, carried out byte by byte, fill each onload buffer exactly as the copy engine's
    ``buffer[start:start + n].copy_(slot[layer, :n])`` per job does (jobs of partial chunks, several streams'
    shares, slot addresses from the store's table or from each slot tensor)."""
    rng = np.random.default_rng(0)
    layers, chunk_pages, page_shape = 3, 4, (2, 2, 3, 5)  # [2, page_size, H, D]
    slots = torch.randn(6, layers, chunk_pages, *page_shape).to(torch.bfloat16)
    table = np.array([slot.data_ptr() for slot in slots], dtype=np.int64)
    counts = np.array([4, 1, 3, 4, 2])
    jobs = [OnloadJob(int(i), slots[i], rng.integers(0, 100, n)) for i, n in zip([5, 0, 3, 1, 4], counts)]
    buffers = [torch.zeros(20, *page_shape, dtype=torch.bfloat16) for _ in range(2)]
    expected = torch.zeros(20, *page_shape, dtype=torch.bfloat16)
    batches = onload_batches(jobs, counts, buffers, table if by_table else None, share)
    assert len(batches) == share
    for layer in range(layers):
        start = 0
        for job in jobs:
            expected[start:start + len(job.pages)].copy_(job.slot[layer, :len(job.pages)])
            start += len(job.pages)
        buffer = buffers[layer % 2]
        buffer.zero_()
        for dsts_by_buffer, srcs, sizes, layer_bytes in batches:
            for dst, src, size in zip(dsts_by_buffer[layer % 2], srcs + np.uint64(layer * layer_bytes), sizes):
                ctypes.memmove(int(dst), int(src), int(size))
        assert torch.equal(buffer[:start], expected[:start]), layer
        assert not buffer[start:].any()  # nothing written past the packed pages


def test_loading_the_copier_never_raises():
    """Without a CUDA driver (or one without batched copies) the copier is ``None``; with one it is callable, and an
    empty batch queues nothing."""
    copier = BatchedCopier.load(0)
    if copier is not None:
        copier(*(np.empty(0, dtype=np.uint64) for _ in range(3)), stream=0)


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
    copier(dsts, srcs, sizes, stream=0x1234)
    assert seen == [([4096, 4160], [100, 200], [64, 128], [1, 2, 0, 1, 3, 1], [0], 1, 2 if with_fail_index else 1,
                     0x1234)]
    status[0] = 1
    with pytest.raises(RuntimeError, match="cuMemcpyBatchAsync failed with CUDA error 1"):
        copier(dsts, srcs, sizes, stream=0x1234)


@pytest.mark.parametrize(("with_fail_index", "group"), [(False, 1), (True, 1), (False, 2), (True, 3), (False, 4)])
def test_per_group_batches_copy_each_layer_then_call_back(with_fail_index, group):
    """:meth:`BatchedCopier.layers` (the ``dma`` engine's staging copies), with a stand-in driver that carries each
    batch out with ``memmove``: each group's one batch (``group`` consecutive layers, the last group smaller) fills
    those layers of a ``[L, pages, ...]`` staging buffer with every job's first pages of each layer, packed in job
    order, and ``after_group(last)`` (the group's last layer) comes right after that group's one driver call; an empty
    batch makes no driver call but still calls back for every group."""
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
                  slots.stride(1) * slots.element_size(), layers, 0x99, lambda last: log.append(("after", last)),
                  group)
    lasts = [min(first + group, layers) - 1 for first in range(0, layers, group)]
    assert log == [entry for first, last in zip(range(0, layers, group), lasts, strict=True)
                   for entry in (("call", 3 * (last + 1 - first), 0x99), ("after", last))]
    for layer in range(layers):
        expected = torch.cat([slots[i, layer, :n] for i, n in zip(chosen, counts, strict=True)])
        assert torch.equal(staging[layer, :8], expected), layer
    assert not staging[:, 8:].any()
    log.clear()
    empty = np.empty(0, dtype=np.uint64)
    copier.layers(empty, empty, empty, 64, 64, 3, 0x99, lambda last: log.append(("after", last)), group)
    assert log == [("after", last) for last in lasts]
