"""Host-tier transfer jobs and the host addresses they read (:class:`~.transfer.TransferEngine` runs them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class OffloadJob:
    """Copy GPU pages ``pages`` (int64 ``[n]`` or a list, at most a chunk's worth, in order) into host slot
    ``slot_id`` (memory ``slot``: ``[L, chunk_pages, 2, page_size, H, D]``), leaving the rest of the slot. The pages
    hold ``tokens`` tokens (``(n - 1) * page_size < tokens <= n * page_size``); the last page's rows past them are a
    previous owner's: FP8 scales ignore them and they are stored as zeros."""

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


def is_done(event: torch.cuda.Event | None) -> bool:
    """Whether the transfer that recorded ``event`` is done (``None``: a CPU transfer, done when issued)."""
    return event is None or event.query()


def host_page_addresses(jobs: list[OnloadJob], slot_addresses: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """For :meth:`~.onload_kernel.OnloadLauncher.all_layers`: each job page's first-layer host address, in job order
    (int64), and the bytes between layers (slots ``[L, chunk_pages, 2, page_size, H, D]``, contiguous, 16-byte
    aligned for the kernel's 16-byte loads). ``slot_addresses``: as :func:`job_slot_addresses`."""
    slot = jobs[0].slot
    page_bytes, layer_bytes = slot.stride(1) * slot.element_size(), slot.stride(0) * slot.element_size()
    slot_addresses = job_slot_addresses(jobs, slot_addresses)
    if page_bytes % 16 or (slot_addresses % 16).any():
        raise ValueError("host pages must start 16-byte aligned for the onload kernel")
    counts = np.fromiter((len(job.pages) for job in jobs), dtype=np.int64, count=len(jobs))
    first = np.repeat(np.cumsum(counts) - counts, counts)  # each page's job's first entry
    return np.repeat(slot_addresses, counts) + (np.arange(int(counts.sum())) - first) * page_bytes, layer_bytes


def job_slot_addresses(jobs: list[OnloadJob] | list[OffloadJob],
                       slot_addresses: np.ndarray | None = None) -> np.ndarray:
    """int64 ``[len(jobs)]``: each job's slot address, from ``slot_addresses`` (per slot id,
    :attr:`.host_store.HostChunkStore.addresses`) if given, else from each job's tensor (a torch call per job)."""
    if slot_addresses is None:
        return np.fromiter((job.slot.data_ptr() for job in jobs), dtype=np.int64, count=len(jobs))
    return slot_addresses[np.fromiter((job.slot_id for job in jobs), dtype=np.int64, count=len(jobs))]
