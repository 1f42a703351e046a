"""Per-user cache records and counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


@dataclass(eq=False)
class UserRecord:
    """One user's cached history, across both tiers.

    Attributes:
        pages: GPU page ids in logical order (empty when the user is not on the GPU; may exceed what
            ``num_tokens`` needs while a request that will fill them is running).
        num_tokens: leading history tokens whose K/V the GPU pages hold.
        host_slots: host chunk slots in logical order; slot ``i`` holds tokens
            ``[i * chunk_tokens, (i + 1) * chunk_tokens)`` (the last one possibly partly).
        host_tokens: leading history tokens whose K/V is complete on host.
        hashed_tokens: tokens covered by ``page_hashes`` (``>= num_tokens`` and ``>= host_tokens``).
        page_hashes: uint64 ``[ceil(hashed_tokens / page_size)]``; entry ``k`` hashes the tokens of page
            ``k`` (see :mod:`cache_engine.prefix_hash`).
        locked: a running request owns the record.
        readers: offloads in flight still reading its GPU pages (it cannot be evicted meanwhile).
        generation: bumped whenever the cached history is cut back; transfers of an older generation
            are discarded when they complete.
    """

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    host_slots: list[int] = field(default_factory=list)
    host_tokens: int = 0
    hashed_tokens: int = 0
    page_hashes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    locked: bool = False
    readers: int = 0
    generation: int = 0
    _page_array: np.ndarray | None = field(default=None, repr=False)

    def set_pages(self, pages: list[int]) -> None:
        """Replace the page list (the only way it changes, so :meth:`page_array` stays in step)."""
        self.pages = pages
        self._page_array = None

    def page_array(self) -> np.ndarray:
        """``pages`` as int32 numpy, cached until :meth:`set_pages`."""
        if self._page_array is None:
            self._page_array = np.asarray(self.pages, dtype=np.int32)
        return self._page_array


class CacheHit(NamedTuple):
    """History tokens a request reuses: ``gpu`` already in GPU pages, ``host`` loaded from host."""

    gpu: int
    host: int

    @property
    def total(self) -> int:
        return self.gpu + self.host


@dataclass
class CacheStats:
    """Counters since the engine started (tokens are history tokens of one user each)."""

    evicted_users: int = 0
    evicted_tokens: int = 0
    truncated_tokens: int = 0
    host_evicted_users: int = 0
    onloaded_tokens: int = 0
    onloaded_bytes: int = 0
    offloaded_tokens: int = 0
    offloaded_bytes: int = 0
    tail_persisted_tokens: int = 0
    lost_tokens: int = 0
    deferred_offloads: int = 0
