"""Per-user cache records, the LRU index that orders them, and counters."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


def grown(buffer: np.ndarray, keep: int, need: int) -> np.ndarray:
    """A new buffer of ``buffer``'s dtype with room for ``need`` entries plus 25% (a history growing a page at a time
    is copied O(log) times), holding ``buffer[:keep]`` first."""
    new = np.empty(need + need // 4 + 4, dtype=buffer.dtype)
    if keep:
        new[:keep] = buffer[:keep]
    return new


@dataclass(eq=False, slots=True)
class UserRecord:
    """One user's cached history, across both tiers (docs/design.md section 5, "Per-user records"; the host tier
    writes ``host_slots``, ``host_tokens`` and ``readers``, the manager the rest).

    Attributes:
        page_buffer: int32 ``[>= num_pages]``; ``page_buffer[:num_pages]`` (:attr:`pages`) are the user's GPU
            page ids in logical order; entries beyond are garbage.
        num_pages: GPU pages held (0 when the user is not on the GPU; may exceed what ``num_tokens`` needs
            while a request that will fill them is running).
        num_tokens: leading history tokens whose K/V the GPU pages hold.
        host_slots: host chunk slots in logical order; slot ``i`` holds tokens
            ``[i * chunk_tokens, (i + 1) * chunk_tokens)`` (the last one possibly partly).
        host_tokens: leading history tokens whose K/V is complete on host.
        hashed_tokens: tokens covered by the page hashes (``>= num_tokens`` and ``>= host_tokens``).
        hash_buffer: uint64 ``[>= ceil(hashed_tokens / page_size)]``; entry ``k`` below that hashes page ``k``'s
            known tokens (:mod:`cache_engine.prefix_hash`); entries beyond are garbage.
        locked: a running request owns the record (or a request on its way: see
            :meth:`~cache_engine.KVCacheManager.prefetch`).
        prefetched: history tokens loaded from host ahead of the user's next request (:meth:`~cache_engine.
            KVCacheManager.prefetch`), counted as host hits when that request acquires the record; 0 otherwise.
        readers: offloads in flight still reading its GPU pages (it cannot be evicted meanwhile).
        generation: unique to the record, changed whenever its history is cut back, 0 once it is deleted;
            transfers of another generation are discarded when they complete.
    """

    page_buffer: np.ndarray = field(default_factory=lambda: _NO_PAGES)
    num_pages: int = 0
    num_tokens: int = 0
    host_slots: list[int] = field(default_factory=list)
    host_tokens: int = 0
    hashed_tokens: int = 0
    hash_buffer: np.ndarray = field(default_factory=lambda: _NO_HASHES)
    locked: bool = False
    prefetched: int = 0
    readers: int = 0
    generation: int = 0

    @property
    def pages(self) -> np.ndarray:
        """int32 ``[num_pages]``: the GPU page ids in logical order (a view: do not keep it across changes)."""
        return self.page_buffer[: self.num_pages]

    def forget_pages(self) -> None:
        """Hold no pages (the caller has given them back), releasing the buffer's memory."""
        self.page_buffer = _NO_PAGES
        self.num_pages = self.prefetched = 0


_NO_PAGES = np.zeros(0, dtype=np.int32)  # shared by records without pages: capacity 0, so never written
_NO_HASHES = np.zeros(0, dtype=np.uint64)


class LRUIndex(OrderedDict[Hashable, Any]):
    """Keys from least to most recently used (iteration order), each with a value (e.g. the user's record, so a
    policy walking the order needs no second lookup); every operation is O(1)."""

    def touch(self, key: Hashable, value: Any = None) -> None:
        """Insert ``key`` (with ``value``) or mark it most recently used (and set its value)."""
        self[key] = value
        self.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        """Drop ``key`` if present."""
        self.pop(key, None)


class CacheHit(NamedTuple):
    """History tokens a request reuses: ``gpu`` already in GPU pages, ``host`` loaded from host."""

    gpu: int
    host: int

    @property
    def total(self) -> int:
        """Reused history tokens, from GPU pages and host chunks together."""
        return self.gpu + self.host


@dataclass
class PoolStats:
    """The manager's counters since start (tokens are history tokens of one user each).

    Attributes:
        evicted_users: users whose GPU pages were reclaimed (LRU eviction).
        evicted_tokens: their cached tokens at the time.
        truncated_tokens: cached tokens dropped because a request's history no longer matched them.
        prefetched_tokens: tokens loaded from host as the user's request arrived (``cache.prefetch``).
        unfinished_copy_tokens: history tokens a returning request found still being copied to host (the user had
            just left the GPU); its acquire waited for the copy instead of recomputing them.
    """

    evicted_users: int = 0
    evicted_tokens: int = 0
    truncated_tokens: int = 0
    prefetched_tokens: int = 0
    unfinished_copy_tokens: int = 0


@dataclass
class HostStats:
    """The host tier's counters since start.

    Attributes:
        host_evicted_users: users whose host copy was dropped to free slots (host LRU).
        onloaded_tokens, onloaded_bytes: history loaded from host into GPU pages.
        offloaded_tokens, offloaded_bytes: history copied from GPU pages to host.
        tail_persisted_tokens: tails (less than a chunk) persisted as their user was evicted.
        lost_tokens: tokens of evicted users that could not be persisted (no free slot, or ``persist_tails`` off).
        deferred_offloads: chunk-steps that full chunks waited for admission (``max_pending_offloads``).
    """

    host_evicted_users: int = 0
    onloaded_tokens: int = 0
    onloaded_bytes: int = 0
    offloaded_tokens: int = 0
    offloaded_bytes: int = 0
    tail_persisted_tokens: int = 0
    lost_tokens: int = 0
    deferred_offloads: int = 0


@dataclass
class CacheStats(PoolStats, HostStats):
    """A snapshot of every cache counter, taken by :attr:`~cache_engine.KVCacheManager.stats`."""
