"""The host tier's memory: chunk slots ``[num_layers, chunk_pages, 2, page_size, H, D]`` in a (pinned) host pool,
allocated in segments whose slots do not exist until they arrive (docs/design.md section 5, "Host tier")."""

from __future__ import annotations

import math
import queue
import threading

import numpy as np
import torch


class HostChunkStore:
    """Chunk slots with an O(1) free list; slots appear as their segments are allocated.

    Args:
        num_slots: slots in the whole pool (may be 0).
        slot_shape: ``(num_layers, chunk_pages, 2, page_size, H, D)``.
        dtype: KV dtype.
        segment_slots: slots per segment.
        pin: pin the memory (for asynchronous DMA); segments are then allocated in the background.
        memory: optional preallocated flat uint8 host memory (pinned for CUDA) to carve the slots from, e.g. one
            arena shared by successive engines; ``num_slots`` is then capped by its size and nothing is allocated.
    """

    def __init__(self, num_slots: int, slot_shape: tuple[int, ...], dtype: torch.dtype, segment_slots: int,
                 pin: bool, memory: torch.Tensor | None = None) -> None:
        self.slot_shape = slot_shape
        self.dtype = dtype
        self.slot_bytes = math.prod(slot_shape) * dtype.itemsize  #: bytes of one slot
        self._segments: list[torch.Tensor] = []
        self._slots: list[torch.Tensor] = []  # per slot id, a view into its segment
        self._free: list[int] = []
        self._num_allocated = 0  # slots in the adopted segments
        self._ready: queue.Queue[torch.Tensor] = queue.Queue()
        self._stop = threading.Event()
        self._thread = None
        if memory is not None:  # one segment: the slots that fit
            num_slots = segment_slots = min(num_slots, memory.numel() // self.slot_bytes)
        self.num_slots = num_slots
        #: int64 ``[num_slots]``: each slot's address once its segment is adopted (for kernels reading host memory)
        self.addresses = np.zeros(num_slots, dtype=np.int64)
        segment_slots = max(1, segment_slots)
        sizes = [min(segment_slots, num_slots - s) for s in range(0, num_slots, segment_slots)]
        self._coming = len(sizes)  # segments not adopted yet
        if memory is not None:
            for size in sizes:
                self._ready.put(memory[: size * self.slot_bytes].view(dtype).view(size, *slot_shape))
        elif pin:
            self._thread = threading.Thread(target=self._allocate, args=(sizes, True), daemon=True,
                                            name="gr-engine-host-pool")
            self._thread.start()
            return
        else:
            self._allocate(sizes, False)
        self.adopt_ready_segments()

    @property
    def num_allocated(self) -> int:
        """Slots whose memory exists (grows while the background allocation runs)."""
        return self._num_allocated

    @property
    def num_free(self) -> int:
        """Slots allocated and not in use."""
        return len(self._free)

    def adopt_ready_segments(self) -> int:
        """Make the slots of segments allocated since the last call available; returns how many."""
        added = 0
        while self._coming:  # once every segment is adopted, this costs nothing per step
            try:
                segment = self._ready.get_nowait()
            except queue.Empty:
                return added
            self._coming -= 1
            base = self._num_allocated
            self._num_allocated += len(segment)
            self._segments.append(segment)
            self._slots.extend(segment.unbind(0))  # one view per slot, made once (slicing per use costs µs)
            self.addresses[base:base + len(segment)] = (segment.data_ptr()
                                                        + np.arange(len(segment), dtype=np.int64) * self.slot_bytes)
            self._free.extend(range(base + len(segment) - 1, base - 1, -1))
            added += len(segment)
        return added

    def wait_until_allocated(self, timeout: float | None = None) -> None:
        """Block until the whole pool exists (tests and benchmarks; the engine never calls this)."""
        if self._thread is not None:
            self._thread.join(timeout)
        self.adopt_ready_segments()

    def allocate(self) -> int | None:
        """A free slot id, or ``None`` when none is free."""
        return self._free.pop() if self._free else None

    def free(self, slots: list[int]) -> None:
        """Give slot ids back (the caller no longer reads or writes them)."""
        self._free.extend(slots)

    def slot(self, slot_id: int) -> torch.Tensor:
        """The slot's memory, ``[num_layers, chunk_pages, 2, page_size, H, D]``."""
        return self._slots[slot_id]

    def free_slot_ids(self) -> list[int]:
        """The free slot ids (a copy; for invariant checks)."""
        return list(self._free)

    def close(self) -> None:
        """Stop the background allocation (idempotent)."""
        self._stop.set()

    def _allocate(self, sizes: list[int], pin: bool) -> None:
        for size in sizes:
            if self._stop.is_set():
                return
            self._ready.put(torch.empty((size, *self.slot_shape), dtype=self.dtype, pin_memory=pin))
