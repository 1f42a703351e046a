"""The jobs and handles of host-tier transfers, and the host addresses they read
(:class:`~.transfer.TransferEngine` carries them out)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class OffloadJob:
    """Copy GPU pages ``pages`` (int64 ``[n]``, at most a chunk's worth, in order; or a list) into host slot
    ``slot_id`` (memory ``slot``: ``[L, chunk_pages, 2, page_size, H, D]``); the rest of the slot may be
    overwritten with copies of the last page (the copy path) or left as it is (the kernel). The pages hold
    ``tokens`` tokens (``(n - 1) * page_size < tokens <= n * page_size``): the rows of the last page past them
    are not the user's (a page keeps what its previous owner wrote there). FP8 scales are taken over the tokens
    only, and the rows past them are stored as zeros."""

    pages: np.ndarray
    slot_id: int
    slot: torch.Tensor
    tokens: int


@dataclass(slots=True)
class OnloadJob:
    """Copy host slot ``slot_id`` (memory ``slot``), its first ``len(pages)`` pages, into GPU ``pages`` (int64
    ``[n]``, or a list)."""

    slot_id: int
    slot: torch.Tensor
    pages: np.ndarray


@dataclass(slots=True)
class OffloadHandle:
    """An offload in flight. ``gathered``/``copied`` are CUDA events (``None`` on CPU: already done);
    ``deferred``: the copy out is not issued yet (``copied`` is set when it is)."""

    gathered: torch.cuda.Event | None
    copied: torch.cuda.Event | None
    buffer: tuple[torch.Tensor, ...] = field(default=(), repr=False)  # kept alive until ``copied``
    deferred: bool = False

    def gather_done(self) -> bool:
        return self.gathered is None or self.gathered.query()

    def copy_done(self) -> bool:
        return not self.deferred and (self.copied is None or self.copied.query())


def host_page_addresses(jobs: list[OnloadJob], slot_addresses: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """For :func:`~.onload_kernel.onload_pages`: the host address of each job page's first layer, in job
    order, and the bytes from one layer of a page to the next (slots ``[L, chunk_pages, 2, page_size, H, D]``,
    contiguous, 16-byte aligned: the kernel loads 16 bytes at a time). ``slot_addresses``: int64, each slot id's
    address (:attr:`.host_store.HostChunkStore.addresses`), read instead of asking each job's tensor (a torch call
    per job)."""
    slot = jobs[0].slot
    page_bytes, layer_bytes = slot.stride(1) * slot.element_size(), slot.stride(0) * slot.element_size()
    slot_addresses = job_slot_addresses(jobs, slot_addresses)
    if page_bytes % 16 or (slot_addresses % 16).any():
        raise ValueError("host pages must start 16-byte aligned for the onload kernel")
    counts = np.fromiter((len(job.pages) for job in jobs), dtype=np.int64, count=len(jobs))
    first = np.repeat(np.cumsum(counts) - counts, counts)  # each page's job's first entry
    return np.repeat(slot_addresses, counts) + (np.arange(int(counts.sum())) - first) * page_bytes, layer_bytes


def job_slot_addresses(jobs: list[OnloadJob] | list[OffloadJob], slot_addresses: np.ndarray | None = None
                       ) -> np.ndarray:
    """int64 ``[len(jobs)]``: the host address of each job's slot, read from ``slot_addresses`` (each slot id's
    address, :attr:`.host_store.HostChunkStore.addresses`) if given, else asked of each job's tensor (a torch
    call per job)."""
    if slot_addresses is None:
        return np.fromiter((job.slot.data_ptr() for job in jobs), dtype=np.int64, count=len(jobs))
    return slot_addresses[np.fromiter((job.slot_id for job in jobs), dtype=np.int64, count=len(jobs))]
