"""The ``dma`` onload engine's first half: host pages cross PCIe by DMA into a device staging buffer.

Per layer, or per group of consecutive layers, one batched driver call (:class:`.batched_copy.BatchedCopier`) on
the copy stream copies every job's host pages of those layers into the staging buffer, packed in job order, then
records the event of the group's last layer. The onload kernel (:mod:`.onload_kernel`) then reads the staging buffer
into the pool's pages, each launch queued after a wait for its layers' event: eagerly, or (one layer per group)
inside a CUDA graph (:mod:`.onload_graphs`), which is why the events come in sets, one per graph turn, and are created
external.
"""

from __future__ import annotations

import numpy as np
import torch

from .batched_copy import BatchedCopier, copy_arrays
from .jobs import OnloadJob, job_slot_addresses
from .streams import on_stream

#: Event sets (graph turns). A turn's events are recorded again only once the graph replay that last waited on them is
#: done; a batch's onload comes one batch after the last one of its turn, whose forward the host has scored by then.
DMA_TURNS = 2


def layer_events(num_layers: int, external: bool, stream: torch.cuda.Stream) -> list[torch.cuda.Event]:
    """One event per layer, each recorded once on ``stream`` (a wait captured in a graph before an event's first
    record would be left out of the graph). ``external``: waits on them captured in a graph are event-wait nodes
    (needs torch 2.9 or later)."""
    events = [torch.cuda.Event(external=True) if external else torch.cuda.Event() for _ in range(num_layers)]
    for event in events:
        event.record(stream)
    return events


class DmaStaging:
    """The staging buffer, ``[L, pages, 2, page_size, H, D]`` of the host dtype on the device, and its copies. Its
    layout never changes (onload graphs bake its layer stride).

    Args:
        copier: issues a layer's copies in one driver call.
        stream: the copy stream (an onload stream of the transfer engine), on the pool's device.
        slot_shape: host slots' shape, ``[L, chunk_pages, 2, page_size, H, D]``.
        dtype: host slots' dtype.
        pages: pages of every layer the buffer holds.
        external_events: create the per-layer events external (for waits inside CUDA graphs).
    """

    def __init__(self, copier: BatchedCopier, stream: torch.cuda.Stream, slot_shape: tuple[int, ...],
                 dtype: torch.dtype, pages: int, external_events: bool) -> None:
        self.copier, self.stream = copier, stream
        self.buffer = torch.empty((slot_shape[0], pages, *slot_shape[2:]), dtype=dtype, device=stream.device)
        #: ``events[turn][l]``: recorded after layer ``l``'s copies of an onload of that turn.
        self.events = [layer_events(slot_shape[0], external_events, stream) for _ in range(DMA_TURNS)]

    @property
    def layer_bytes(self) -> int:
        """Bytes from one layer of the staging buffer to the next."""
        return self.buffer.stride(0) * self.buffer.element_size()

    @property
    def capacity(self) -> int:
        """Pages of every layer the buffer holds."""
        return self.buffer.shape[1]

    def copy(self, jobs: list[OnloadJob], counts: np.ndarray, slot_addresses: np.ndarray | None, turn: int,
             after: torch.cuda.Event | None, compute: torch.cuda.Stream, group: int = 1) -> np.ndarray:
        """Queue on the copy stream, once ``after`` (the previous onload's last kernel: it reads the buffer) is
        done, per group of ``group`` consecutive layers one batched copy of every job's first ``counts[j]`` host pages
        of those layers into the buffer, packed in job order, then a record of ``events[turn][last]``, ``last`` being
        the group's last layer. The buffer must hold ``counts.sum()`` pages.
        ``counts``: int64 ``[len(jobs)]``; ``slot_addresses``: as :func:`~.jobs.job_slot_addresses`. Returns each
        staged page's device address in layer 0 (int64 ``[counts.sum()]``); layer ``l``'s is ``l * layer_bytes``
        further. Raises ``RuntimeError`` if a driver call fails (the copies queued before it only wrote the
        buffer)."""
        slot, buffer = jobs[0].slot, self.buffer
        page_bytes, host_layer_bytes = slot.stride(1) * slot.element_size(), slot.stride(0) * slot.element_size()
        staged_layer_bytes = self.layer_bytes
        dsts, srcs, sizes = copy_arrays(buffer.data_ptr(), job_slot_addresses(jobs, slot_addresses), counts,
                                        page_bytes)
        stream, events = self.stream, self.events[turn]
        with on_stream(stream, compute):
            if after is not None:
                stream.wait_event(after)
            self.copier.layers(dsts, srcs, sizes, staged_layer_bytes, host_layer_bytes, len(events),
                               stream.cuda_stream, lambda last: events[last].record(stream), group)
        return buffer.data_ptr() + np.arange(int(counts.sum()), dtype=np.int64) * page_bytes
