"""Index arrays that transfer kernels read straight from pinned host memory (device-addressable), which saves the
upload (a staging buffer, a device allocation and a copy). A buffer is written again only once the event recorded
after its last reader reports done, so the host never overwrites indices a queued kernel has yet to read.
"""

from __future__ import annotations

import torch


class PinnedIndexRing:
    """``depth`` pinned int64 buffers, used in turn.

    Args:
        depth: buffers in the ring: a buffer is rewritten ``depth`` takes after its last use, so its reader has
            normally finished long before (the host waits for it otherwise).
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
        """The next buffer, int64 ``[size]`` (contents undefined), once its previous reader is done; its reader's
        event must be given to :meth:`guard` before the next :meth:`take`."""
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
        """The event recorded after the last kernel that reads the buffer just taken (``None``: nothing reads it
        any more)."""
        self._readers[self._taken] = reader
