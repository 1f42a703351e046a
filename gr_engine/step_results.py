"""A step's results on their way from the device to the host (:meth:`ModelRunner.fetch
<gr_engine.model_runner.ModelRunner.fetch>` queues the copies, :meth:`ScoreFetch.wait` waits for them).

The ranking logits of every step land in pinned buffers of a :class:`PinnedBuffers` pool owned by the runner: a
buffer goes back to the pool once its step's results were read, so steady serving allocates no pinned memory.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ChunkResult:
    """A finishing request's result: ranking ``logits`` (float32 ``[c, num_tasks]`` on the host) or retrieval
    ``(items, scores)``."""

    logits: np.ndarray | None = None
    item_ids: list[int] | None = None
    scores: list[float] | None = None


class PinnedBuffers:
    """Reusable host buffers for the copies of steps' logits: float32 ``[capacity, width]``, pinned on CUDA.

    :meth:`take` hands out a free buffer with room for ``rows`` (allocating one, of a power-of-two capacity, when none
    is free); :meth:`give_back` returns it once the copy into it was waited for and read. As many buffers exist as
    steps were ever in flight at once.

    Args:
        width: columns of every buffer (the model's ``num_tasks``).
        pin: pin the buffers (CUDA: asynchronous copies need it); plain memory otherwise (tests).
    """

    def __init__(self, width: int, pin: bool = True) -> None:
        self.width = width
        self.pin = pin
        self._free: list[torch.Tensor] = []

    @property
    def num_free(self) -> int:
        """Buffers waiting in the pool."""
        return len(self._free)

    def take(self, rows: int) -> torch.Tensor:
        """A buffer of at least ``rows`` rows (the smallest free one that fits)."""
        fitting = [i for i, b in enumerate(self._free) if b.shape[0] >= rows]
        if fitting:  # by index: list.remove would compare tensors element by element
            return self._free.pop(min(fitting, key=lambda i: self._free[i].shape[0]))
        capacity = 1 << max(rows - 1, 63).bit_length()  # a power of two, at least 64
        return torch.empty((capacity, self.width), dtype=torch.float32, pin_memory=self.pin)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return a buffer of :meth:`take` whose contents nobody reads any more."""
        self._free.append(buffer)


@dataclass(eq=False)
class ScoreFetch:
    """A step's results on their way to the host.

    Attributes:
        counts: candidate rows of each chunk of the step.
        logits: float32 ``[sum(counts), num_tasks]`` ranking logits (host; on CUDA a view of a pinned buffer of
            ``buffers``), ``None`` without candidates.
        buffers: the pool ``logits``' buffer goes back to once read (``None``: the tensor is the step's own).
        buffer: that buffer.
        retrieval: the finishing retrieval chunks' indices, their ``top_k``, and float32 scores and int64 item ids
            ``[R, k]`` (host), or ``None``.
        started: CUDA event recorded before the step's forward, or ``None``.
        copied: CUDA event recorded after the copies (``None`` on CPU: they are done).
    """

    counts: list[int]
    logits: torch.Tensor | None = None
    buffers: PinnedBuffers | None = None
    buffer: torch.Tensor | None = None
    retrieval: tuple[list[int], list[int], torch.Tensor, torch.Tensor] | None = None
    started: torch.cuda.Event | None = None
    copied: torch.cuda.Event | None = None

    def copy_logits(self, logits: torch.Tensor, buffers: PinnedBuffers | None) -> None:
        """Queue the copy of float32 ``logits [sum(counts), num_tasks]`` into a buffer of ``buffers`` (``None``, or a
        CPU tensor: keep the tensor itself)."""
        if buffers is None or logits.device.type == "cpu":
            self.logits = logits
            return
        self.buffers, self.buffer = buffers, buffers.take(logits.shape[0])
        self.logits = self.buffer[: logits.shape[0]]
        self.logits.copy_(logits, non_blocking=True)

    def wait(self) -> list[ChunkResult]:
        """Wait for the copies; one :class:`ChunkResult` per chunk of the step. The logits' buffer goes back to its
        pool (each chunk's logits are a copy)."""
        if self.copied is not None:
            self.copied.synchronize()
        results = [ChunkResult() for _ in self.counts]
        if self.logits is not None:
            host = self.logits.numpy().copy()
            if self.buffers is not None:
                self.buffers.give_back(self.buffer)
                self.buffers = self.buffer = None
            for result, end, count in zip(results, itertools.accumulate(self.counts), self.counts, strict=True):
                result.logits = host[end - count:end]
        if self.retrieval is not None:
            chunk_ids, top_ks, top_scores, top_items = self.retrieval
            for b, (i, top_k) in enumerate(zip(chunk_ids, top_ks, strict=True)):
                keep = top_scores[b, :top_k]
                finite = torch.isfinite(keep)
                results[i].item_ids = top_items[b, :top_k][finite].tolist()
                results[i].scores = keep[finite].tolist()
        return results

    def device_seconds(self) -> float | None:
        """Once :meth:`wait` returned: the compute stream's time from the step's forward to its results on the host
        (its forward and heads, and waits for its onloads), in seconds; ``None`` on CPU."""
        if self.started is None or self.copied is None:
            return None
        return self.started.elapsed_time(self.copied) / 1e3


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Queue ``tensor``'s copy into a pinned block of torch's caching host allocator (used for the retrieval head's
    top items, whose width varies with ``top_k``); a CPU tensor is returned as it is."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
