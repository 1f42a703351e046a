"""Moving KV between the GPU page pool and host chunk slots.

On CUDA, three side streams keep copies off the compute stream:

- **offload**: waits for the step's compute, gathers the pages of each chunk into a transient device
  buffer (one ``index_select``), then copies the buffer to pinned host slots (one DMA per layer and
  chunk). The gather's event tells when the pages may be written again; the copy's event when the
  host data is complete.
- **onload**: per layer, copies the layer's block of each host chunk into a device onload buffer
  (double-buffered: layer ``l`` reuses the buffer of layer ``l - 2`` once that one is scattered).
- **scatter**: per layer, waits for that layer's copies and scatters the buffer into the users'
  pages; its event for layer ``l`` is what the model's layer ``l`` waits for.

Nothing here synchronises the device. On CPU the same calls copy synchronously and return no events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class OffloadJob:
    """Copy GPU pages ``pages`` (at most a chunk's worth, in order) into host ``slot[:, :len(pages)]``;
    the rest of the slot may be overwritten with copies of the last page."""

    pages: list[int]
    slot: torch.Tensor


@dataclass
class OnloadJob:
    """Copy host ``slot[:, :len(pages)]`` into GPU pages ``pages``."""

    slot: torch.Tensor
    pages: list[int]


@dataclass
class OffloadHandle:
    """An offload in flight. ``gathered``/``copied`` are CUDA events (``None`` on CPU: already done)."""

    gathered: torch.cuda.Event | None
    copied: torch.cuda.Event | None
    buffer: torch.Tensor | None = field(default=None, repr=False)  # kept alive until ``copied``

    def gather_done(self) -> bool:
        return self.gathered is None or self.gathered.query()

    def copy_done(self) -> bool:
        return self.copied is None or self.copied.query()


class TransferEngine:
    """Issues offloads and onloads for one device (streams on CUDA, synchronous copies on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.offload_stream = torch.cuda.Stream(device)
            self.onload_stream = torch.cuda.Stream(device)
            self.scatter_stream = torch.cuda.Stream(device)
        self._buffers: list[torch.Tensor] = []  # the two onload buffers, grown on demand
        self.last_gather: torch.cuda.Event | None = None
        self._last_scatter: torch.cuda.Event | None = None

    # ------------------------------------------------------------------ offload
    def offload(self, kv: torch.Tensor, jobs: list[OffloadJob]) -> OffloadHandle:
        """Copy each job's pages of all layers to its host slot.

        Args:
            kv: the pool, ``[L, num_pages, 2, page_size, H, D]``.
            jobs: what to copy; the pages must not be written until ``handle.gather_done()``.
        """
        if not self.is_cuda:
            for job in jobs:
                job.slot[:, : len(job.pages)] = kv[:, job.pages]
            return OffloadHandle(None, None)
        # Pad every job to a whole slot so each chunk is one contiguous device->host copy.
        slot_pages = jobs[0].slot.shape[1]
        pages = [p for job in jobs for p in job.pages + job.pages[-1:] * (slot_pages - len(job.pages))]
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.offload_stream):
            self.offload_stream.wait_stream(compute)
            index = torch.tensor(pages, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
            gathered_pages = kv.index_select(1, index)  # [L, jobs * slot_pages, 2, page_size, H, D]
            gathered = torch.cuda.Event()
            gathered.record()
            num_layers = kv.shape[0]
            buffer = gathered_pages.view(num_layers, len(jobs), slot_pages, *kv.shape[2:]).transpose(0, 1)
            buffer = buffer.contiguous()  # [jobs, L, slot_pages, ...]: one block per slot
            for job, block in zip(jobs, buffer, strict=True):
                job.slot.copy_(block, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        gathered_pages.record_stream(self.offload_stream)
        buffer.record_stream(self.offload_stream)
        self.last_gather = gathered
        return OffloadHandle(gathered, copied, buffer)

    def before_writes(self) -> None:
        """Make the compute and scatter streams wait for gathers already issued (pages that were
        being read may now be written by their new owner)."""
        if self.is_cuda and self.last_gather is not None:
            torch.cuda.current_stream(self.device).wait_event(self.last_gather)
            self.scatter_stream.wait_event(self.last_gather)

    # ------------------------------------------------------------------ onload
    def onload(self, kv: torch.Tensor, jobs: list[OnloadJob]) -> list[torch.cuda.Event | None]:
        """Copy each job's host chunk into its GPU pages, layer by layer.

        Returns:
            One entry per layer: on CUDA the event after which that layer's pages hold the data (the
            model's layer must wait for it); on CPU ``None`` (the copy is done).
        """
        num_layers = kv.shape[0]
        if not jobs:
            return [None] * num_layers
        pages = [p for job in jobs for p in job.pages]
        if not self.is_cuda:
            dst = torch.tensor(pages, dtype=torch.long)
            for layer in range(num_layers):
                src = torch.cat([job.slot[layer, : len(job.pages)] for job in jobs])
                kv[layer].index_copy_(0, dst, src)
            return [None] * num_layers
        compute = torch.cuda.current_stream(self.device)
        buffers = self._onload_buffers(kv, len(pages))
        copied, scattered = [], []
        if self._last_scatter is not None:  # the previous step's scatters still read the buffers
            self.onload_stream.wait_event(self._last_scatter)
        with torch.cuda.stream(self.scatter_stream):
            self.scatter_stream.wait_stream(compute)  # the pages were just allocated on the host side
            dst = torch.tensor(pages, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
        for layer in range(num_layers):
            buffer = buffers[layer % 2][: len(pages)]
            with torch.cuda.stream(self.onload_stream):
                if layer >= 2:
                    self.onload_stream.wait_event(scattered[layer - 2])
                start = 0
                for job in jobs:
                    n = len(job.pages)
                    buffer[start:start + n].copy_(job.slot[layer, :n], non_blocking=True)
                    start += n
                copied.append(torch.cuda.Event())
                copied[-1].record()
            with torch.cuda.stream(self.scatter_stream):
                self.scatter_stream.wait_event(copied[layer])
                kv[layer].index_copy_(0, dst, buffer)
                scattered.append(torch.cuda.Event())
                scattered[-1].record()
        dst.record_stream(self.scatter_stream)
        self._last_scatter = scattered[-1]
        return scattered

    def _onload_buffers(self, kv: torch.Tensor, num_pages: int) -> list[torch.Tensor]:
        """Two ``[>= num_pages, 2, page_size, H, D]`` device buffers. Replaced buffers are marked as used
        by the side streams, so the allocator reuses their memory only after those copies."""
        if not self._buffers or self._buffers[0].shape[0] < num_pages:
            for old in self._buffers:
                old.record_stream(self.onload_stream)
                old.record_stream(self.scatter_stream)
            size = max(num_pages, 2 * (self._buffers[0].shape[0] if self._buffers else 0))
            self._buffers = [torch.empty((size, *kv.shape[2:]), dtype=kv.dtype, device=self.device)
                             for _ in range(2)]
        return self._buffers
