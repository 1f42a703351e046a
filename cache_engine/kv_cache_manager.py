"""Per-user persistent KV: which pages hold whose history, and what to evict.

A user's record persists across requests: its pages (in logical order), how many history tokens they
hold, one prefix hash per page, and whether a running request has it locked. The life of a request:

1. :meth:`KVCacheManager.acquire` verifies the cached prefix against the request's history (a record
   whose history no longer matches is cut back to the longest matching page prefix: stale KV is never
   served), locks the record, and gives it pages for the request's whole history, evicting least
   recently used unlocked users when needed (zero-copy: only metadata changes). It changes nothing and
   returns ``None`` when the pages cannot be found now.
2. :meth:`KVCacheManager.commit` records that the pages now hold more tokens (after each step).
3. :meth:`KVCacheManager.release` unlocks the record (``recompute`` mode drops it).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import CacheConfig
from .lru import LRUIndex
from .page_pool import PagePool


@dataclass(eq=False)
class UserRecord:
    """One user's cached history.

    Attributes:
        pages: physical page ids in logical order (may exceed what ``num_tokens`` needs while a request
            that will fill them is running).
        num_tokens: history tokens whose K/V the pages hold.
        page_hashes: uint64 ``[ceil(num_tokens / page_size)]``; entry ``k`` hashes the tokens held in page
            ``k`` (see :mod:`cache_engine.prefix_hash`).
        locked: a running request owns the record; it cannot be evicted.
    """

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    page_hashes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    locked: bool = False


@dataclass
class CacheStats:
    """Counters since the engine started."""

    evicted_users: int = 0
    evicted_tokens: int = 0
    truncated_tokens: int = 0


class KVCacheManager:
    """The GPU page pool plus per-user records, under one of the modes of :class:`CacheConfig`."""

    def __init__(
        self,
        config: CacheConfig,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        self.pool = PagePool(num_layers, config.num_gpu_pages, config.page_size, num_heads, head_dim,
                             dtype, device)
        self.users: dict[Hashable, UserRecord] = {}
        self._lru = LRUIndex()  # unlocked users that hold pages, evictable in this order
        self._evictable_pages = 0  # pages held by users in the LRU
        self.stats = CacheStats()

    @property
    def kv_cache(self) -> torch.Tensor:
        """``[num_layers, num_pages, 2, page_size, H, D]``."""
        return self.pool.kv

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------------ request lifecycle
    def acquire(self, user_id: Hashable, token_hashes: np.ndarray, reuse_limit: int) -> int | None:
        """Lock ``user_id``'s record for a request and give it pages for the whole history.

        Args:
            user_id: the request's user.
            token_hashes: uint64 ``[n]`` from :func:`~cache_engine.prefix_hash.page_prefix_hashes` of the
                request's full history (``n`` events).
            reuse_limit: at most this many cached tokens may be reused (``n``, or ``n - 1`` when the
                last history token must be recomputed for its output).

        Returns:
            The number of leading history tokens whose cached K/V the request reuses, or ``None`` if
            the pages cannot be found now (nothing was changed).
        """
        n = len(token_hashes)
        record = self.users.get(user_id)
        if record is not None and record.locked:
            raise RuntimeError(f"user {user_id!r} already has a running request")
        reuse = 0
        if record is not None and self.config.mode != "recompute":
            reuse = min(self._verified_prefix(record, token_hashes), reuse_limit)
        held = len(record.pages) if record is not None else 0
        deficit = self.pages_for(n) - held
        if deficit > self.pool.num_free:
            reclaimable = self._evictable_pages if self.config.mode == "gpu_only" else 0
            if record is not None and user_id in self._lru:
                reclaimable -= held
            if deficit > self.pool.num_free + reclaimable:
                return None

        if record is None:
            record = self.users[user_id] = UserRecord()
        self._lock(user_id, record)
        if reuse < record.num_tokens:
            self._truncate(record, reuse, token_hashes)
        if deficit > 0:
            self._evict_until_free(deficit)
            record.pages.extend(self.pool.allocate(deficit))
        elif deficit < 0:
            self.pool.free(record.pages[deficit:])
            del record.pages[deficit:]
        return reuse

    def commit(self, user_id: Hashable, num_tokens: int, token_hashes: np.ndarray) -> None:
        """The user's pages now hold the first ``num_tokens`` history tokens of the running request."""
        record = self.users[user_id]
        if not record.locked or not record.num_tokens <= num_tokens <= len(record.pages) * self.page_size:
            raise RuntimeError(f"commit of {num_tokens} tokens for user {user_id!r}: not locked, shrinking "
                               f"from {record.num_tokens}, or beyond its {len(record.pages)} pages")
        first = record.num_tokens // self.page_size
        last = self.pages_for(num_tokens)
        ends = np.minimum((np.arange(first, last) + 1) * self.page_size, num_tokens) - 1
        record.page_hashes = np.concatenate([record.page_hashes[:first], token_hashes[ends]])
        record.num_tokens = num_tokens

    def release(self, user_id: Hashable) -> None:
        """Unlock the record after its request finished (or failed); keep it for the next visit."""
        record = self.users[user_id]
        record.locked = False
        keep = 0 if self.config.mode == "recompute" else self.pages_for(record.num_tokens)
        if keep < len(record.pages):
            self.pool.free(record.pages[keep:])
            del record.pages[keep:]
        if keep == 0:
            del self.users[user_id]
            return
        self._lru.touch(user_id)
        self._evictable_pages += len(record.pages)

    def why_no_room(self, num_tokens: int) -> str | None:
        """Why a history of ``num_tokens`` can never get pages while nothing else runs, or ``None``
        if waiting for running requests may help."""
        need = self.pages_for(num_tokens)
        if need > self.pool.num_pages:
            return (f"a history of {num_tokens} tokens needs {need} KV pages but the pool has only "
                    f"{self.pool.num_pages}; raise cache.num_gpu_pages")
        if self.config.mode == "unlimited" and need > self.pool.num_free:
            return (f"unlimited mode ran out of KV pages ({need} needed, {self.pool.num_free} free, "
                    "and this mode never evicts); raise cache.num_gpu_pages or use gpu_only")
        return None

    # ------------------------------------------------------------------ metadata
    def page_table(
        self, user_ids: Sequence[Hashable], seq_lens: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CSR page table of the first ``seq_lens[b]`` tokens of each user's pages.

        Returns:
            ``(kv_indptr [B + 1], kv_indices [nnz], kv_last_page_len [B])``, int32 numpy arrays with
            FlashInfer's semantics (``kv_last_page_len`` is 0 for an empty history).
        """
        lens = np.asarray(seq_lens, dtype=np.int64)
        counts = -(-lens // self.page_size)
        indptr = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(counts, out=indptr[1:])
        indices = np.fromiter(
            (p for uid, c in zip(user_ids, counts) for p in self.users[uid].pages[:c]),
            dtype=np.int32, count=int(indptr[-1]),
        )
        last = np.where(counts > 0, lens - (counts - 1) * self.page_size, 0).astype(np.int32)
        return indptr, indices, last

    def cached_tokens(self, user_id: Hashable) -> int:
        record = self.users.get(user_id)
        return 0 if record is None else record.num_tokens

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any page is owned twice, leaked, or a counter is off."""
        owned = [p for r in self.users.values() for p in r.pages]
        free = self.pool.free_page_ids()
        assert len(owned) == len(set(owned)), "a page is owned by two users"
        assert not set(owned) & set(free), "a page is both owned and free"
        assert len(owned) + len(free) == self.pool.num_pages, "a page leaked"
        assert self._evictable_pages == sum(len(self.users[u].pages) for u in self._lru)
        for uid, r in self.users.items():
            assert (uid in self._lru) != r.locked, f"user {uid!r}: LRU membership disagrees with lock"
            assert len(r.page_hashes) == self.pages_for(r.num_tokens)
            assert r.locked or len(r.pages) == self.pages_for(r.num_tokens)

    # ------------------------------------------------------------------ internals
    def _verified_prefix(self, record: UserRecord, token_hashes: np.ndarray) -> int:
        """Cached tokens of ``record`` whose pages match the request's history, page by page."""
        num_pages = len(record.page_hashes)
        if num_pages == 0:
            return 0
        ends = np.minimum((np.arange(num_pages) + 1) * self.page_size, record.num_tokens)
        n = len(token_hashes)
        verifiable = ends <= n
        probe = token_hashes[np.minimum(ends, max(n, 1)) - 1] if n else np.zeros(num_pages, np.uint64)
        ok = verifiable & (probe == record.page_hashes)
        good = num_pages if ok.all() else int(np.argmin(ok))
        return int(ends[good - 1]) if good else 0

    def _truncate(self, record: UserRecord, num_tokens: int, token_hashes: np.ndarray) -> None:
        """Cut ``record`` back to its first ``num_tokens`` tokens (verified against ``token_hashes``)."""
        self.stats.truncated_tokens += record.num_tokens - num_tokens
        keep = self.pages_for(num_tokens)
        record.page_hashes = record.page_hashes[:keep].copy()
        if num_tokens % self.page_size:
            record.page_hashes[-1] = token_hashes[num_tokens - 1]
        record.num_tokens = num_tokens

    def _lock(self, user_id: Hashable, record: UserRecord) -> None:
        if user_id in self._lru:
            self._lru.remove(user_id)
            self._evictable_pages -= len(record.pages)
        record.locked = True

    def _evict_until_free(self, count: int) -> None:
        while self.pool.num_free < count:
            victim = self._lru.pop_oldest()
            record = self.users.pop(victim)
            self._evictable_pages -= len(record.pages)
            self.pool.free(record.pages)
            self.stats.evicted_users += 1
            self.stats.evicted_tokens += record.num_tokens
