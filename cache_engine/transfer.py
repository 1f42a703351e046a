"""Moving KV between the GPU page pool and host chunk slots.

On CUDA, three side streams keep copies off the compute stream:

- **offload**: waits for the step's compute, then with ``kernels`` one Triton kernel (:mod:`.offload_kernel`)
  gathers the pages of all chunks, quantises them to FP8 if host chunks are FP8, and stores them straight into
  their host slots (pinned memory is device-addressable); otherwise an ``index_select`` gathers them into a
  transient device buffer, and at :meth:`TransferEngine.issue_deferred` (the engine calls it once the step's
  forward is queued, so this host work overlaps the device's) they are quantised, laid out like the slots and
  copied to host, one DMA per chunk. The gather's event tells when the pages may be written again; the copy's
  (the kernel's, the same) when the host data is complete.
- **onload** (one or more streams): per layer, copies the layer's block of each host chunk into a device
  onload buffer (double-buffered: layer ``l`` reuses the buffer of layer ``l - 2`` once that one is
  scattered), in one driver call per layer and stream where the driver has batched copies
  (:mod:`.batched_copy`), else one torch copy per chunk.
- **scatter**: per layer, waits for that layer's copies and scatters the buffer into the users'
  pages; its event for layer ``l`` is what the model's layer ``l`` waits for.

With ``kernels``, the scatter stream instead runs one kernel per layer that reads the host pages directly
(:mod:`.onload_kernel`); with ``dma`` (the default engine) the onload stream first copies each layer's host pages
into a device staging buffer, one batched DMA call per layer (:mod:`.dma_staging`), and the kernels read that, so
the bytes crossing PCIe take no multiprocessors from the forward; with ``graphs``, the kernels, their waits and
records are replayed from a CUDA graph (:mod:`.onload_graphs`). Their index arrays are read from pinned host memory
(:class:`.index_ring.PinnedIndexRing`, or the graphs' own buffers): no upload per transfer.

Host chunks may be stored in FP8 (e4m3), quantised on the device on the way out with one scale per (slot, layer,
K/V, head) in a device table (``amax / 448``, :mod:`.fp8`), dequantised on the way in: half the host memory and
PCIe bytes, at a small, measured, cost in accuracy.

Nothing here synchronises the device. On CPU the same calls copy synchronously and return no events.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from .batched_copy import BatchedCopier, onload_batches
from .dma_staging import DmaStaging
from .fp8 import dequantize, quantize
from .index_ring import PinnedIndexRing
from .jobs import OffloadHandle, OffloadJob, OnloadJob, host_page_addresses, job_slot_addresses
from .streams import CurrentStream, StreamFence, confined_stream, indexed, on_stream

if TYPE_CHECKING:
    from .offload_kernel import ChunkPacker
    from .onload_graphs import OnloadGraphs
    from .onload_kernel import OnloadLauncher

logger = logging.getLogger(__name__)

_QUANTISE_BYTES = 2**30  # float32 bytes the copy path quantises at once (see TransferEngine.issue_deferred)


class TransferEngine:
    """Issues offloads and onloads for one device (streams on CUDA, synchronous copies on CPU).

    Args:
        device: where the page pool lives.
        scales: with FP8 host chunks, float32 ``[num_slots, L, 2, H]`` on ``device``: each slot's
            dequantisation scales (written by offloads, read by onloads); ``None`` when host chunks
            have the pool's dtype.
        onload_streams: streams the per-layer host-to-device copies are spread over (more than one lets
            several copy engines work at once).
        kernels: on CUDA, move data with Triton kernels (when Triton is installed): offloads gather and
            quantise with :class:`.offload_kernel.ChunkPacker`, onloads read host pages with
            :class:`.onload_kernel.OnloadLauncher`; otherwise torch operations, copies and scatters.
        graphs: with ``kernels``, replay each onload's launches from a CUDA graph of its capacity
            (:class:`.onload_graphs.OnloadGraphs`).
        slot_addresses: int64, the address of each host slot id (:attr:`.host_store.HostChunkStore.addresses`,
            read when a kernel is given host addresses; kept by reference, so it may grow), or ``None``: ask each
            job's slot tensor.
        onload_sms: on CUDA, if positive, the scatter stream (where the onload kernels run) is confined to this
            many multiprocessors (:func:`.streams.confined_stream`).
        dma: with ``kernels`` and a driver with batched copies, onloads first copy the host pages into a device
            staging buffer (:mod:`.dma_staging`), which the onload kernel reads instead of host memory.
        dma_graphs: with ``dma``, replay the onload kernels from CUDA graphs too (``graphs`` must be on).
        staging_pages: with ``dma``, the staging buffer's pages (of every layer; at most the pool's): an onload of
            more pages reads host memory directly. Also the largest onload :meth:`warm_onloads` captures graphs for.
        group_bytes: with ``kernels``, an onload launched eagerly moves as many consecutive layers per kernel
            launch (and, with ``dma``, per driver call) as fit in this many bytes of its host pages, at least one,
            with one event per group: fewer host calls for a small onload, while a layer's compute waits for its whole
            group. 0: one layer at a time (always so for onloads replayed from CUDA graphs).
    """

    def __init__(self, device: torch.device, scales: torch.Tensor | None = None, onload_streams: int = 1,
                 kernels: bool = False, graphs: bool = False, slot_addresses: np.ndarray | None = None,
                 onload_sms: int = 0, dma: bool = False, dma_graphs: bool = False, staging_pages: int = 4096,
                 group_bytes: int = 0) -> None:
        self.device = indexed(device)
        self.scales = scales
        self.slot_addresses = slot_addresses
        self.is_cuda = device.type == "cuda"
        self.dma = False  # onloads by DMA into a staging buffer, then the onload kernel (CUDA: see below)
        self.kernels = kernels and self.is_cuda and importlib.util.find_spec("triton") is not None
        self.onload_graphs, self.dma_graphs, self.staging_pages = graphs, dma_graphs, staging_pages
        self.group_bytes = group_bytes
        if self.is_cuda:
            self.current_stream = CurrentStream(self.device)  # the compute stream, where the caller works
            self.offload_stream = torch.cuda.Stream(device)
            self.onload_streams = [torch.cuda.Stream(device) for _ in range(max(1, onload_streams))]
            # per-layer copies in one driver call each (copy engine, dma onloads), where the driver has it
            self._copier = BatchedCopier.load(self.device.index) if dma or not self.kernels else None
            self.dma = dma and self.kernels and self._copier is not None
            # onload_sms: the green context is kept with its stream
            self._confined = confined_stream(self.device, onload_sms) if onload_sms else None
            self.scatter_stream = self._confined[1] if self._confined else torch.cuda.Stream(device)
            self._fence = StreamFence()  # side streams wait for the compute stream's work so far
        self._buffers: list[torch.Tensor] = []  # the two onload buffers, grown on demand
        self._deferred: list[tuple[OffloadHandle, list[OffloadJob]]] = []  # gathered, not yet copied out
        self.last_gather: torch.cuda.Event | None = None
        # The gather before_writes last made the streams wait for, and the current stream then.
        self._waited_gather: tuple[torch.cuda.Event, torch.cuda.Stream] | None = None
        self._last_scatter: torch.cuda.Event | None = None
        self._launcher: OnloadLauncher | None = None  # the onload kernel's, created at the first kernel onload
        self._packer: ChunkPacker | None = None  # the offload kernel's, created at the first kernel offload
        self._graphs: OnloadGraphs | None = None  # the kernel onload's CUDA graphs, with the launcher
        self._layer_events: list[torch.cuda.Event] = []  # recorded after each layer's kernel, reused every step
        self._staging: DmaStaging | None = None  # dma: the staging buffer and its copies
        # The kernels' index arrays, read from pinned memory (CUDA with kernels only).
        self._offload_indices = PinnedIndexRing(pin=self.kernels)
        self._onload_indices = PinnedIndexRing(pin=self.kernels)
        #: When False, offloads and onloads move no data and complete at once: the cache's bookkeeping
        #: runs as usual but KV contents go stale. Only for fast-forwarding a benchmark's cache state.
        self.moves_data = True

    # ------------------------------------------------------------------ offload
    def offload(self, kv: torch.Tensor, jobs: list[OffloadJob]) -> OffloadHandle:
        """Copy each job's pages of all layers to its host slot.

        Args:
            kv: the pool, ``[L, num_pages, 2, page_size, H, D]``.
            jobs: what to copy; the pages must not be written until ``handle.gather_done()``.
        """
        if not self.moves_data:
            return OffloadHandle(None, None)
        if not self.is_cuda:
            for job in jobs:
                data = kv[:, job.pages].unsqueeze(0)  # [1, L, n, 2, page_size, H, D]
                if self.scales is not None:
                    data = quantize(data, [job.tokens], self.scales, [job.slot_id])
                job.slot[:, : len(job.pages)] = data[0]
            return OffloadHandle(None, None)
        # Pad every job to a whole slot: each chunk is then one contiguous block (one copy, or the kernel's stores).
        # The kernel skips pages of id -1: a tail's slot gets the tail's pages, not a whole chunk's worth of PCIe.
        # Index layout: the chunks' pool pages, their slot ids, their token counts, then (kernel) their slot addresses.
        num_jobs, slot_pages = len(jobs), jobs[0].slot.shape[1]
        num_pages = num_jobs * slot_pages
        size = num_pages + num_jobs * (3 if self.kernels else 2)
        index = self._offload_indices.take(size) if self.kernels else torch.empty(size, dtype=torch.long)
        host = index.numpy()
        for row, job in zip(host[:num_pages].reshape(num_jobs, slot_pages), jobs, strict=True):  # per chunk
            row[:len(job.pages)] = job.pages
            row[len(job.pages):] = -1 if self.kernels else job.pages[-1]
        host[num_pages:num_pages + num_jobs] = [job.slot_id for job in jobs]
        host[num_pages + num_jobs:num_pages + 2 * num_jobs] = [job.tokens for job in jobs]
        compute = self.current_stream()
        with on_stream(self.offload_stream, compute):
            self._fence(self.offload_stream, compute)
            if self.kernels:  # the kernel reads the indices from pinned memory and writes the slots: no copies
                host[num_pages + 2 * num_jobs:] = job_slot_addresses(jobs, self.slot_addresses)
                self._pack(kv, index, num_pages, jobs[0].slot)
            else:  # [L, jobs * slot_pages, 2, ps, H, D], laid out and quantised by issue_deferred
                index = self._upload(host)
                packed = kv.index_select(1, index[:num_pages])
            gathered = torch.cuda.Event()
            gathered.record(self.offload_stream)
        self.last_gather = gathered
        if self.kernels:
            self._offload_indices.guard(gathered)
            return OffloadHandle(gathered, gathered)
        handle = OffloadHandle(gathered, None, (packed, index), deferred=True)
        self._deferred.append((handle, jobs))
        return handle

    def issue_deferred(self) -> None:
        """Issue the copies out of the offloads gathered so far by the copy path (FP8 quantisation, one DMA per
        chunk) on the offload stream; each handle's ``copied`` event is set. (Kernel offloads defer nothing.)"""
        if not self._deferred:
            return
        with on_stream(self.offload_stream, self.current_stream()):
            for handle, jobs in self._deferred:
                gathered, index = handle.buffer  # lay the gathered pages out like the slots, quantise
                num_layers, slot_pages = gathered.shape[0], jobs[0].slot.shape[1]
                by_chunk = gathered.view(num_layers, len(jobs), slot_pages, *gathered.shape[2:]).transpose(0, 1)
                slot_ids, tokens, kept = index[-2 * len(jobs):-len(jobs)], index[-len(jobs):], []
                # a few chunks at a time: quantising widens them to float32 (a warm-up step may offload hundreds)
                group = max(1, _QUANTISE_BYTES // (by_chunk[0].numel() * 4))
                for start in range(0, len(jobs), group):
                    part = slice(start, start + group)
                    blocks = by_chunk[part].contiguous()
                    if self.scales is not None:
                        blocks = quantize(blocks, tokens[part], self.scales, slot_ids[part])
                    kept.append(blocks)  # held until the copies out of it are done (the handle keeps it)
                    for job, block in zip(jobs[part], blocks, strict=True):
                        job.slot.copy_(block, non_blocking=True)
                handle.buffer = (*handle.buffer, *kept)
                handle.copied = torch.cuda.Event()
                handle.copied.record(self.offload_stream)
                handle.deferred = False
        self._deferred.clear()

    def _pack(self, kv: torch.Tensor, index: torch.Tensor, num_pages: int, slot: torch.Tensor) -> None:
        """Write chunks into their host slots (``slot``'s shape and dtype), quantised with scales for their slot ids
        when host chunks are FP8: one kernel on the offload stream, which must be current. ``index``: int64 (pinned
        host memory), the chunks' pool pages (``num_pages``, ``slot_pages`` per chunk), then their ``J`` slot ids,
        their ``J`` token counts and their ``J`` slot addresses."""
        if self._packer is None:
            from .offload_kernel import ChunkPacker  # imports Triton

            self._packer = ChunkPacker()
        num_chunks = (len(index) - num_pages) // 3
        pages, addresses = index[:num_pages], index[-num_chunks:]
        slot_ids, tokens = index[num_pages:num_pages + num_chunks], index[num_pages + num_chunks:-num_chunks]
        self._packer(kv, pages, addresses, slot.dtype, slot.shape[1], slot_ids, self.scales, self.offload_stream,
                     tokens=tokens)

    def before_writes(self) -> None:
        """Make the compute (current) and scatter streams wait for gathers already issued (pages that were
        being read may now be written by their new owner); nothing to do when both already waited for the last one
        (no gather since the last call, on the same current stream)."""
        if not self.is_cuda or self.last_gather is None:
            return
        compute = self.current_stream()
        if self._waited_gather != (self.last_gather, compute):
            compute.wait_event(self.last_gather)
            self.scatter_stream.wait_event(self.last_gather)
            self._waited_gather = (self.last_gather, compute)

    # ------------------------------------------------------------------ onload
    def onload(self, kv: torch.Tensor, jobs: list[OnloadJob]) -> list[torch.cuda.Event | None]:
        """Copy each job's host chunk into its GPU pages, layer by layer.

        Returns:
            One entry per layer: on CUDA the event after which that layer's pages hold the data (the
            model's layer must wait for it; recorded in layer order on one stream; with ``group_bytes``, the layers of
            a group share their group's event); on CPU ``None`` (the copy is done).
        """
        num_layers = kv.shape[0]
        if not jobs or not self.moves_data:
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
        if self.kernels:
            return self._onload_by_kernel(kv, jobs, pages, page_slots, counts)
        compute = self.current_stream()
        buffers = self._onload_buffers(jobs[0].slot, len(pages))
        scattered: list[torch.cuda.Event] = []
        if self._last_scatter is not None:  # the previous step's scatters still read the buffers
            for stream in self.onload_streams:
                stream.wait_event(self._last_scatter)
        with on_stream(self.scatter_stream, compute):
            self._fence(self.scatter_stream, compute)  # the pages were just handed out on the host side
            index = self._upload(np.concatenate([pages, page_slots]))
            dst = index[: len(pages)]
            scales = None if self.scales is None else self.scales[index[len(pages):]]
        starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        batches = (None if self._copier is None else
                   onload_batches(jobs, counts, buffers, self.slot_addresses, len(self.onload_streams)))
        for layer in range(num_layers):
            buffer = buffers[layer % 2][: len(pages)]
            copied = []
            for s, stream in enumerate(self.onload_streams):
                with on_stream(stream, compute):
                    if layer >= 2:
                        stream.wait_event(scattered[layer - 2])
                    if batches is not None:  # jobs dealt round-robin: this stream's, in one driver call
                        dsts, srcs, sizes, layer_bytes = batches[s]
                        try:
                            self._copier(dsts[layer % 2], srcs + np.uint64(layer * layer_bytes), sizes,
                                         stream.cuda_stream)
                        except RuntimeError:  # nothing was queued: copy one chunk at a time from now on
                            logger.warning("batched copies failed; copying one chunk at a time", exc_info=True)
                            self._copier, batches = None, None
                    if batches is None:
                        for j in range(s, len(jobs), len(self.onload_streams)):
                            n = len(jobs[j].pages)
                            buffer[starts[j]:starts[j] + n].copy_(jobs[j].slot[layer, :n], non_blocking=True)
                    copied.append(torch.cuda.Event())
                    copied[-1].record(stream)
            with on_stream(self.scatter_stream, compute):
                for event in copied:
                    self.scatter_stream.wait_event(event)
                kv[layer].index_copy_(0, dst, buffer if scales is None else dequantize(buffer, scales, layer,
                                                                                         kv.dtype))
                scattered.append(torch.cuda.Event())
                scattered[-1].record(self.scatter_stream)
        index.record_stream(self.scatter_stream)
        if scales is not None:
            scales.record_stream(self.scatter_stream)
        self._last_scatter = scattered[-1]
        return scattered

    def _onload_by_kernel(self, kv: torch.Tensor, jobs: list[OnloadJob], pages: np.ndarray, page_slots: np.ndarray,
                          counts: np.ndarray) -> list[torch.cuda.Event]:
        """Per layer (or group of layers: ``group_bytes``), one kernel on the scatter stream reads every job's host
        pages (pinned, device-addressable) into their GPU pages, replayed from a CUDA graph
        (:class:`.onload_graphs.OnloadGraphs`) when graphs are on; with ``dma``, from a staging buffer the pages were
        first copied into (:meth:`_stage_by_dma`). Returns the per-layer events."""
        src_dtype = jobs[0].slot.dtype
        if self._launcher is None:
            self._prepare_kernels(kv, jobs[0].slot.shape, src_dtype)
        compute = self.current_stream()
        # The same events every step: a stream that waits on one waits for its latest record at that time, and each
        # step's waits are queued before the next step records again. The host tier frees the host slots an onload
        # reads once its events report done, which a later record can only delay (one stream, in order).
        events, staged, group = self._layer_events, None, self._group(kv.shape[0], len(pages), jobs[0].slot)
        if self.dma and len(pages) <= self._staging.capacity:  # the host pages cross PCIe by DMA into the staging
            try:  # buffer, and the kernels read that instead (an onload too large for it reads host memory)
                staged = self._stage_by_dma(jobs, counts, compute, group)
            except RuntimeError:  # copies queued before the failure only wrote the staging buffer
                logger.warning("batched copies failed; onload kernels read host memory from now on", exc_info=True)
                self.dma, self._graphs = False, None
        addresses, layer_bytes, before_group = staged or (*host_page_addresses(jobs, self.slot_addresses), None)
        with on_stream(self.scatter_stream, compute):
            self._fence(self.scatter_stream, compute)  # the pages were just handed out on the host side
            graphs = self._graphs
            if graphs is None or not graphs.serves(kv, layer_bytes, src_dtype) or not graphs.replay(
                    pages, page_slots, addresses):
                count = len(pages)
                index = self._onload_indices.take(3 * count)  # read by the kernels from pinned memory
                host = index.numpy()
                host[:count], host[count:2 * count], host[2 * count:] = pages, page_slots, addresses
                dst, slot_ids, src = index[:count], index[count:2 * count], index[2 * count:]
                self._launcher.all_layers(kv, src, dst, layer_bytes, src_dtype, slot_ids, self.scales, events,
                                          self.scatter_stream, before_group=before_group, group=group)
                self._onload_indices.guard(events[-1])  # re-recorded by later steps: that only waits longer
        self._last_scatter = events[-1]
        if group == 1:
            return list(events)
        return [events[min(layer - layer % group + group, len(events)) - 1] for layer in range(len(events))]

    def _group(self, num_layers: int, num_pages: int, slot: torch.Tensor) -> int:
        """Layers per launch of an eager onload of ``num_pages`` pages from host slots like ``slot``: as many as fit
        in ``group_bytes`` (at least one); one whenever graphs may replay it (they launch layer by layer)."""
        if not self.group_bytes or self._graphs is not None:
            return 1
        layer_bytes = num_pages * slot.stride(1) * slot.element_size()
        return max(1, min(num_layers, self.group_bytes // max(layer_bytes, 1)))

    def _stage_by_dma(self, jobs: list[OnloadJob], counts: np.ndarray, compute: torch.cuda.Stream, group: int
                      ) -> tuple[np.ndarray, int, Callable[[int], None]]:
        """Queue the copies of every job's host pages into the staging buffer (:meth:`.dma_staging.DmaStaging.copy`,
        once the previous onload's kernels have read it), recording the events of the turn the onload graphs
        replay next. Returns the staged pages' device addresses (layer 0, int64 ``[count]``), the bytes from one
        staged layer to the next, and what an eager kernel of the group of ``group`` layers ending at layer ``last``
        must queue before its launch (a wait for that group's copies). ``counts``: int64 ``[len(jobs)]``, each job's
        pages."""
        staging, graphs = self._staging, self._graphs
        turn = graphs.begin() if graphs is not None and graphs.enabled else 0
        addresses = staging.copy(jobs, counts, self.slot_addresses, turn, self._last_scatter, compute, group)
        copied = staging.events[turn]
        return addresses, staging.layer_bytes, lambda last: self.scatter_stream.wait_event(copied[last])

    def _prepare_kernels(self, kv: torch.Tensor, slot_shape: tuple[int, ...], src_dtype: torch.dtype) -> None:
        """Create the onload kernel's launcher, its per-layer events, with ``dma`` the staging buffer (of
        ``staging_pages`` pages, or the pool's pages if fewer) and, with graphs, the onload graphs (their layout:
        the staging buffer's, else host slots of shape ``slot_shape`` and dtype ``src_dtype``)."""
        from .onload_graphs import OnloadGraphs  # imports Triton
        from .onload_kernel import OnloadLauncher

        self._launcher = OnloadLauncher()
        self.onload_graphs = self.onload_graphs and (self.dma_graphs or not self.dma)
        try:  # external: graph replays record them as event nodes, waited for outside the graphs
            self._layer_events = [torch.cuda.Event(external=self.onload_graphs) for _ in range(kv.shape[0])]
        except TypeError:  # a torch without external events (before 2.9): onloads launch eagerly
            self._layer_events, self.onload_graphs = [torch.cuda.Event() for _ in range(kv.shape[0])], False
        layer_bytes, waits = int(np.prod(slot_shape[1:])) * src_dtype.itemsize, None
        if self.dma:
            self._staging = DmaStaging(self._copier, self.onload_streams[0], slot_shape, src_dtype,
                                       min(self.staging_pages, kv.shape[1]), external_events=self.onload_graphs)
            layer_bytes, waits = self._staging.layer_bytes, self._staging.events
        if self.onload_graphs:
            self._graphs = OnloadGraphs(self._launcher, kv, layer_bytes, src_dtype, self.scales, self._layer_events,
                                        self.scatter_stream, waits=waits)

    def warm_onloads(self, kv: torch.Tensor, slot_shape: tuple[int, ...], src_dtype: torch.dtype) -> int:
        """Before serving: with the kernels on CUDA, create what onloads need (:meth:`_prepare_kernels`) and, with
        graphs, capture the onload graph of every capacity up to ``staging_pages`` (a capture in a step costs it
        milliseconds). Returns the graphs captured."""
        if not (self.is_cuda and self.kernels):
            return 0
        if self._launcher is None:
            self._prepare_kernels(kv, slot_shape, src_dtype)
        if self._graphs is None:
            return 0
        with on_stream(self.scatter_stream, self.current_stream()):
            return self._graphs.capture_all(min(self.staging_pages, kv.shape[1]))

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        """int64 ``[len(values)]`` on the device, copied without blocking on the current stream from pinned memory
        of torch's caching host allocator, which reuses it once that copy is done."""
        staged = torch.empty(len(values), dtype=torch.long, pin_memory=True)
        staged.numpy()[:] = values
        return staged.to(self.device, non_blocking=True)

    def _onload_buffers(self, slot: torch.Tensor, num_pages: int) -> list[torch.Tensor]:
        """Two ``[>= num_pages, 2, page_size, H, D]`` device buffers of the host dtype. Replaced buffers are
        marked as used by the side streams, so the allocator reuses their memory only after those copies."""
        if not self._buffers or self._buffers[0].shape[0] < num_pages:
            for old in self._buffers:
                for stream in (*self.onload_streams, self.scatter_stream):
                    old.record_stream(stream)
            size = max(num_pages, 2 * (self._buffers[0].shape[0] if self._buffers else 0))
            self._buffers = [torch.empty((size, *slot.shape[2:]), dtype=slot.dtype, device=self.device)
                             for _ in range(2)]
        return self._buffers
