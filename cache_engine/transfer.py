"""Moving KV between the GPU page pool and host chunk slots (the CUDA path: docs/design.md section 5).

On CUDA three side streams keep transfers off the compute stream: **offload** runs the packing kernel, **copy** the
per-layer batched DMA into the staging buffer, **scatter** the per-layer onload kernel, whose layer ``l`` event the
model's layer ``l`` waits for. Nothing here synchronises the device. On CPU the same calls copy synchronously.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from .batched_copy import BatchedCopier
from .dma_staging import DmaStaging
from .fp8 import dequantize, quantize
from .jobs import OffloadJob, OnloadJob, host_page_addresses, job_slot_addresses
from .streams import CurrentStream, StreamFence, indexed, on_stream

if TYPE_CHECKING:
    from .offload_kernel import ChunkPacker
    from .onload_kernel import OnloadLauncher

logger = logging.getLogger(__name__)


class PinnedIndexRing:
    """``depth`` pinned int64 buffers, used in turn, for index arrays the transfer kernels read straight from pinned
    host memory (no upload). A buffer is rewritten only once the event after its last reader reports done (the host
    waits otherwise), so a queued kernel's indices are never overwritten.

    Args:
        depth: buffers in the ring.
        pin: pin the buffers (CUDA); plain memory otherwise (tests).
    """

    def __init__(self, depth: int = 4, pin: bool = True) -> None:
        if depth < 1:
            raise ValueError("a ring needs at least one buffer")
        self.pin = pin
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._readers: list[torch.cuda.Event | None] = [None] * depth  # recorded after each buffer's last reader
        self._turn = 0
        self._taken = -1

    def take(self, size: int) -> torch.Tensor:
        """The next buffer, int64 ``[size]`` (undefined contents), once its previous reader is done; give its reader's
        event to :meth:`guard` before the next :meth:`take`."""
        index = self._turn
        self._turn = (index + 1) % len(self._buffers)
        reader = self._readers[index]
        if reader is not None and not reader.query():
            reader.synchronize()  # the ring went round faster than the device: wait for that reader
        self._readers[index] = None
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < size:
            capacity = 1 << max(size - 1, 255).bit_length()  # a power of two, at least 256
            buffer = self._buffers[index] = torch.empty(capacity, dtype=torch.long, pin_memory=self.pin)
        self._taken = index
        return buffer[:size]

    def guard(self, reader: torch.cuda.Event | None) -> None:
        """The event after the last kernel reading the buffer just taken (``None``: nothing reads it)."""
        self._readers[self._taken] = reader


class TransferEngine:
    """Issues offloads and onloads for one device (kernels and DMA on CUDA, synchronous copies on CPU).

    Args:
        device: where the page pool lives.
        scales: with FP8 host chunks, float32 ``[num_slots, L, 2, H]`` on ``device``: each slot's dequantisation
            scales (written by offloads, read by onloads); ``None`` when host chunks have the pool's dtype.
        slot_addresses: int64, each host slot id's address (:attr:`.host_store.HostChunkStore.addresses`, kept by
            reference, so it may grow), or ``None``: ask each job's slot tensor.
        staging_pages: the staging buffer's pages (of every layer; at most the pool's): larger onloads read host
            memory directly.

    Raises:
        RuntimeError: on CUDA without Triton (the transfer kernels need it).
    """

    def __init__(self, device: torch.device, scales: torch.Tensor | None = None,
                 slot_addresses: np.ndarray | None = None, staging_pages: int = 4096) -> None:
        self.device = indexed(device)
        self.scales = scales
        self.slot_addresses = slot_addresses
        self.staging_pages = staging_pages
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            if importlib.util.find_spec("triton") is None:
                raise RuntimeError("the host tier on CUDA needs Triton for its transfer kernels (pip install triton)")
            self.current_stream = CurrentStream(self.device)  # the compute stream, where the caller works
            self.offload_stream = torch.cuda.Stream(device)
            self.copy_stream = torch.cuda.Stream(device)
            self.scatter_stream = torch.cuda.Stream(device)
            self._fence = StreamFence()  # side streams wait for the compute stream's work so far
            self._copier = BatchedCopier.load(self.device.index)  # None: onload kernels read host memory
        self.last_gather: torch.cuda.Event | None = None
        self._waited_gather: tuple[torch.cuda.Event, torch.cuda.Stream] | None = None
        self._last_scatter: torch.cuda.Event | None = None
        self._launcher: OnloadLauncher | None = None  # created at the first onload (imports Triton)
        self._packer: ChunkPacker | None = None  # created at the first offload
        self._layer_events: list[torch.cuda.Event] = []  # recorded after each layer's onload, reused every onload
        self._staging: DmaStaging | None = None
        self._offload_indices = PinnedIndexRing(pin=self.is_cuda)
        self._onload_indices = PinnedIndexRing(pin=self.is_cuda)

    # ------------------------------------------------------------------ offload
    def offload(self, kv: torch.Tensor, jobs: list[OffloadJob]) -> torch.cuda.Event | None:
        """Copy each job's pages of all layers of ``kv`` (the pool, ``[L, num_pages, 2, page_size, H, D]``) to its
        host slot. Returns the event after which the pages may be written again and the slots hold the data (CUDA),
        or ``None`` (CPU: the copy is done)."""
        if not self.is_cuda:
            for job in jobs:
                data = kv[:, job.pages].unsqueeze(0)  # [1, L, n, 2, page_size, H, D]
                if self.scales is not None:
                    data = quantize(data, [job.tokens], self.scales, [job.slot_id])
                job.slot[:, : len(job.pages)] = data[0]
            return None
        # Index layout in pinned memory: each chunk's pool pages padded to a whole slot with -1 (pages the kernel
        # skips), the slot ids, the token counts, the slot addresses; each part starts 16-byte aligned (the kernel
        # is specialised on its pointers' alignment: a part at an odd offset would compile another variant).
        num_jobs, slot = len(jobs), jobs[0].slot
        slot_pages = slot.shape[1]
        num_pages = num_jobs * slot_pages
        pages_end, part = num_pages + (num_pages & 1), num_jobs + (num_jobs & 1)
        index = self._offload_indices.take(pages_end + 3 * part)
        host = index.numpy()
        for row, job in zip(host[:num_pages].reshape(num_jobs, slot_pages), jobs, strict=True):  # per chunk
            row[:len(job.pages)] = job.pages
            row[len(job.pages):] = -1
        slot_ids, tokens, addresses = (index[pages_end + k * part: pages_end + k * part + num_jobs] for k in range(3))
        slot_ids.numpy()[:] = [job.slot_id for job in jobs]
        tokens.numpy()[:] = [job.tokens for job in jobs]
        addresses.numpy()[:] = job_slot_addresses(jobs, self.slot_addresses)
        if self._packer is None:
            from .offload_kernel import ChunkPacker

            self._packer = ChunkPacker()
        compute = self.current_stream()
        with on_stream(self.offload_stream, compute):
            self._fence(self.offload_stream, compute)
            self._packer(kv, index[:num_pages], addresses, slot.dtype, slot_pages, slot_ids, self.scales,
                         self.offload_stream, tokens=tokens)
            gathered = torch.cuda.Event()
            gathered.record(self.offload_stream)
        self._offload_indices.guard(gathered)
        self.last_gather = gathered
        return gathered

    def before_writes(self) -> None:
        """Make the compute (current) and scatter streams wait for offloads already issued, so pages being read may
        be written by their new owner (nothing to do if they already waited for the last one)."""
        if not self.is_cuda or self.last_gather is None:
            return
        compute = self.current_stream()
        if self._waited_gather != (self.last_gather, compute):
            compute.wait_event(self.last_gather)
            self.scatter_stream.wait_event(self.last_gather)
            self._waited_gather = (self.last_gather, compute)

    # ------------------------------------------------------------------ onload
    def onload(self, kv: torch.Tensor, jobs: list[OnloadJob]) -> list[torch.cuda.Event | None]:
        """Copy each job's host chunk into its GPU pages of ``kv`` (the pool), layer by layer. Returns per layer the
        event after which its pages hold the data (CUDA: recorded in layer order on one stream, re-recorded by later
        onloads), or ``None`` (CPU: the copy is done)."""
        num_layers = kv.shape[0]
        if not jobs:
            return [None] * num_layers
        counts = np.fromiter((len(job.pages) for job in jobs), dtype=np.int64, count=len(jobs))
        pages = np.concatenate([job.pages for job in jobs], dtype=np.int64)
        page_slots = np.repeat(np.fromiter((job.slot_id for job in jobs), dtype=np.int64, count=len(jobs)), counts)
        if not self.is_cuda:
            dst = torch.from_numpy(pages)
            scales = None if self.scales is None else self.scales[torch.from_numpy(page_slots)]
            for layer in range(num_layers):
                src = torch.cat([job.slot[layer, : len(job.pages)] for job in jobs])
                kv[layer].index_copy_(0, dst, src if scales is None else dequantize(src, scales, layer, kv.dtype))
            return [None] * num_layers
        src_dtype = jobs[0].slot.dtype
        if self._launcher is None:
            self.prepare(kv, jobs[0].slot.shape, src_dtype)
        compute = self.current_stream()
        staging, copied = self._staging, None
        if staging is not None and len(pages) <= staging.capacity:
            try:  # the host pages cross PCIe by DMA into the staging buffer, and the kernels read that
                addresses = staging.copy(jobs, counts, self.slot_addresses, self._last_scatter, compute)
                layer_bytes, copied = staging.layer_bytes, staging.events
            except RuntimeError:  # copies queued before the failure only wrote the staging buffer
                logger.warning("batched copies failed; onload kernels read host memory from now on", exc_info=True)
                self._staging = None
        if copied is None:
            addresses, layer_bytes = host_page_addresses(jobs, self.slot_addresses)
        events, scatter = self._layer_events, self.scatter_stream
        with on_stream(scatter, compute):
            self._fence(scatter, compute)  # the pages were just handed out on the host side
            count = len(pages)
            index = self._onload_indices.take(3 * count)  # read by the kernels from pinned memory
            host = index.numpy()
            host[:count], host[count:2 * count], host[2 * count:] = pages, page_slots, addresses
            self._launcher.all_layers(kv, index[2 * count:], index[:count], layer_bytes, src_dtype,
                                      index[count:2 * count], self.scales, events, scatter,
                                      None if copied is None else lambda layer: scatter.wait_event(copied[layer]))
            self._onload_indices.guard(events[-1])  # re-recorded by later onloads: that only waits longer
        self._last_scatter = events[-1]
        return list(events)

    def warm(self, kv: torch.Tensor, offload: OffloadJob) -> None:
        """Before serving (CUDA; nothing on CPU): compile and run every transfer kernel once, so that no step
        compiles one. Packs ``offload``'s pages (free pool pages) into its slot, then copies the slot back into
        them by each onload path (DMA into the staging buffer where there is one, and host reads), and waits."""
        if not self.is_cuda:
            return
        self.offload(kv, [offload])
        self.before_writes()
        onload = [OnloadJob(offload.slot_id, offload.slot, offload.pages)]
        self.onload(kv, onload)
        staging, self._staging = self._staging, None
        try:
            self.onload(kv, onload)
        finally:
            self._staging = staging
        torch.cuda.synchronize(self.device)

    def prepare(self, kv: torch.Tensor, slot_shape: tuple[int, ...], src_dtype: torch.dtype) -> None:
        """Create what CUDA onloads need (nothing on CPU): the onload kernel's launcher, its per-layer events and,
        where the driver batches copies, the staging buffer of host slots' shape ``slot_shape`` and ``src_dtype``."""
        if not self.is_cuda or self._launcher is not None:
            return
        from .onload_kernel import OnloadLauncher  # imports Triton

        self._launcher = OnloadLauncher()
        self._layer_events = [torch.cuda.Event() for _ in range(kv.shape[0])]
        if self._copier is not None:
            self._staging = DmaStaging(self._copier, self.copy_stream, slot_shape, src_dtype,
                                       min(self.staging_pages, kv.shape[1]))
