"""The first half of a CUDA onload: host pages cross PCIe by DMA into a device staging buffer, one batched driver call
per layer, whose event the onload kernel waits for before reading that layer (docs/design.md section 5)."""

from __future__ import annotations

import numpy as np
import torch

from .batched_copy import BatchedCopier, copy_arrays
from .jobs import OnloadJob, job_slot_addresses
from .streams import on_stream


class DmaStaging:
    """The staging buffer, ``[L, pages, 2, page_size, H, D]`` of the host dtype on the device, and its copies.

    Args:
        copier: issues a layer's copies in one driver call.
        stream: the copy stream, on the pool's device.
        slot_shape: host slots' shape, ``[L, chunk_pages, 2, page_size, H, D]``.
        dtype: host slots' dtype.
        pages: pages of every layer the buffer holds.
    """

    def __init__(self, copier: BatchedCopier, stream: torch.cuda.Stream, slot_shape: tuple[int, ...],
                 dtype: torch.dtype, pages: int) -> None:
        self.copier, self.stream = copier, stream
        self.buffer = torch.empty((slot_shape[0], pages, *slot_shape[2:]), dtype=dtype, device=stream.device)
        #: ``events[l]``: recorded after layer ``l``'s copies of the latest onload.
        self.events = [torch.cuda.Event() for _ in range(slot_shape[0])]
        self.capacity = pages  #: pages of every layer the buffer holds
        self.layer_bytes = self.buffer.stride(0) * self.buffer.element_size()  #: from one layer to the next

    def copy(self, jobs: list[OnloadJob], counts: np.ndarray, slot_addresses: np.ndarray | None,
             after: torch.cuda.Event | None, compute: torch.cuda.Stream) -> np.ndarray:
        """Queue on the copy stream, after ``after`` (the previous onload's last kernel, a reader of the buffer), per
        layer one batched copy of each job's first ``counts[j]`` (int64 ``[len(jobs)]``) host pages into the buffer,
        packed in job order, then a record of ``events[l]``; the buffer must hold ``counts.sum()`` pages.
        ``slot_addresses``: as :func:`~.jobs.job_slot_addresses`. Returns each staged page's layer-0 device address
        (int64 ``[counts.sum()]``; layer ``l`` is ``l * layer_bytes`` further). Raises ``RuntimeError`` if a driver
        call fails (earlier copies only wrote the buffer)."""
        slot, buffer = jobs[0].slot, self.buffer
        page_bytes, host_layer_bytes = slot.stride(1) * slot.element_size(), slot.stride(0) * slot.element_size()
        dsts, srcs, sizes = copy_arrays(buffer.data_ptr(), job_slot_addresses(jobs, slot_addresses), counts,
                                        page_bytes)
        stream, events = self.stream, self.events
        with on_stream(stream, compute):
            if after is not None:
                stream.wait_event(after)
            self.copier.layers(dsts, srcs, sizes, self.layer_bytes, host_layer_bytes, len(events),
                               stream.cuda_stream, lambda layer: events[layer].record(stream))
        return buffer.data_ptr() + np.arange(int(counts.sum()), dtype=np.int64) * page_bytes
