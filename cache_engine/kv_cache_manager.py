"""Per-user persistent KV: which pages (and host chunks) hold whose history, and what to evict (docs/design.md
section 5, which also says what the manager and the host tier each own).

A request is served by :meth:`KVCacheManager.acquire`, :meth:`KVCacheManager.commit` after each step and
:meth:`KVCacheManager.release`. Each engine step calls :meth:`begin_step`, :meth:`launch_onloads` before the forward
and :meth:`end_step` after it; with ``cache.prefetch`` the engine calls :meth:`prefetch` as requests arrive.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from .config import CacheConfig
from .host_tier import HostTier
from .page_pool import PagePool
from .records import CacheHit, CacheStats, LRUIndex, PoolStats, UserRecord, grown


class KVCacheManager:
    """The GPU page pool, the host chunk tier and per-user records, under a :class:`CacheConfig` mode."""

    def __init__(self, config: CacheConfig, num_layers: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, host_memory: torch.Tensor | None = None) -> None:
        """``host_memory``: optional preallocated memory for the host pool (:class:`~.host_store.HostChunkStore`)."""
        self.config = config
        self.page_size = config.page_size
        self.pool = PagePool(num_layers, config.num_gpu_pages, config.page_size, num_heads, head_dim, dtype, device)
        self.kv_cache = self.pool.kv  #: ``[num_layers, num_pages, 2, page_size, H, D]``
        self.users: dict[Hashable, UserRecord] = {}
        self._lru = LRUIndex()  # unlocked users that hold pages -> their records, least recently used first
        self._evictable_pages = 0  # pages held by users in the LRU
        self._reuses = config.mode != "recompute"  # records persist across requests
        self._evicts = config.mode in ("gpu_only", "hierarchical")  # users in the LRU may lose their pages
        # Generations are unique across records (0 once deleted): a completing copy for a deleted record is never
        # taken for the user's next record's, and needs no lookup to know whether its record is current.
        self._generations = itertools.count(1)
        self._stats = PoolStats()
        self._prefetched: set[Hashable] = set()  # users locked by a prefetch, not yet acquired or handed back
        self._prefetch_events: list[torch.cuda.Event | None] | None = None  # the last prefetch's, until a step waits
        self.host: HostTier | None = None
        if config.mode == "hierarchical":
            self.host = HostTier(config, self.pool.kv, self._release_record, host_memory)

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters since start: the manager's and the host tier's."""
        host = vars(self.host.stats) if self.host is not None else {}
        return CacheStats(**vars(self._stats), **host)

    @property
    def transferred_bytes(self) -> tuple[int, int]:
        """Bytes onloaded (host to GPU) and offloaded (GPU to host) since start."""
        if self.host is None:
            return 0, 0
        return self.host.stats.onloaded_bytes, self.host.stats.offloaded_bytes

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------------ step hooks
    def begin_step(self) -> None:
        """Apply transfers that finished since the last step."""
        if self.host is not None:
            self.host.poll()

    def launch_onloads(self) -> list[torch.cuda.Event | None]:
        """Start this step's onloads; entry ``l`` is what layer ``l`` must wait for (``None``: nothing)."""
        if self.host is None:
            return [None] * self.pool.kv.shape[0]
        events = self.host.launch()
        if self._prefetch_events is not None:  # recorded in order on one stream: a later onload's events cover it
            events = self._prefetch_events if events[-1] is None else events
            self._prefetch_events = None
        if events[-1] is not None and events[-1].query():  # a prefetch already done: nothing to wait for (a step
            return [None] * len(events)  # replayed from CUDA graphs then replays one graph, not one per layer)
        return events

    def prefetch(self, user_ids: Sequence[Hashable], count: int | None = None) -> None:
        """Start loading the host-resident history of the first ``count`` (default: all) users of ``user_ids`` who
        hold no GPU pages, before their requests are validated (docs/design.md section 5, "Prefetch"); all of
        ``user_ids`` become the most recently used, so evictions making room take other users. A loaded record is
        locked and holds pages for its host tokens. Users without room in the pool, unknown, locked or on the GPU are
        skipped."""
        if self.host is None:
            return
        users = self.keep(user_ids)  # about to be used: the evictions below must take other users first
        started = False
        for user_id in users[:count]:
            record = self.users.get(user_id)
            if (record is None or record.locked or record.num_pages or not record.host_tokens
                    or self.host.copying_end(user_id, record) > record.host_tokens):  # its acquire waits for that
                continue
            tokens = record.host_tokens  # evicting may complete copies to host: its host tokens may grow meanwhile
            need = self.pages_for(tokens)
            if need > self.pool.num_free + self._evictable_pages:
                continue
            record.locked = True  # before evicting others: the host LRU must not drop this copy meanwhile
            self._evict_until_free(need)
            self._take_pages(record, need)
            self.host.plan_onload(record, tokens)
            record.num_tokens = record.prefetched = tokens
            self._stats.prefetched_tokens += tokens
            self.host.touch(user_id, record)
            self._prefetched.add(user_id)
            started = True
        if started:
            self._prefetch_events = self.host.launch()

    def keep(self, user_ids: Sequence[Hashable]) -> list[Hashable]:
        """Make ``user_ids`` the most recently used (in their order), so that evictions take other users first (their
        requests are about to be admitted); returns the hashable ones (an unhashable id is the request's validation's
        to report)."""
        users = []
        for user_id in user_ids:
            try:
                if user_id in self._lru:
                    self._lru.move_to_end(user_id)
            except TypeError:
                continue
            users.append(user_id)
        return users

    def hand_back_prefetched(self) -> None:
        """Unlock the prefetched records no request acquired: they stay on the GPU, in the LRU, their prefetched
        tokens still to count as host hits (at the end of each step, and when a step schedules nothing)."""
        for user_id in self._prefetched:
            record = self.users[user_id]
            record.locked = False
            self._lru.touch(user_id, record)
            self._evictable_pages += record.num_pages
        self._prefetched.clear()

    def end_step(self) -> None:
        """Hand back the step's prefetched records and start offloads of chunks that became full."""
        if self.host is not None:
            self.hand_back_prefetched()
            self.host.finish_step()

    def warm_transfers(self) -> None:
        """Before serving, with no transfer in flight (``hierarchical`` on CUDA; else nothing): create the onloads'
        launcher and staging buffer and run each transfer kernel once (:meth:`.host_tier.HostTier.warm`) on free
        pages, so that no step compiles one."""
        if self.host is None:
            return
        pages = np.empty(min(self.config.chunk_pages, self.pool.num_free), dtype=np.int32)
        if not len(pages):
            self.host.prepare()
            return
        self.pool.allocate(pages)
        try:
            self.host.warm(pages)
        finally:
            self.pool.free(pages)

    def close(self) -> None:
        """Finish all transfers and stop background work."""
        if self.host is not None:
            self.host.close()

    # ------------------------------------------------------------------ request lifecycle
    def acquire(self, user_id: Hashable, token_hashes: np.ndarray | None, reuse_limit: int,
                num_tokens: int | None = None) -> CacheHit | None:
        """Lock ``user_id``'s record for a request and give it pages for the whole history.

        Args:
            user_id: the request's user.
            token_hashes: uint64 ``[n]``, :func:`~cache_engine.prefix_hash.page_prefix_hashes` of the request's full
                history (``n`` events). ``None`` for a user with no hashed tokens (:meth:`hashed_tokens`), whose
                hashes nothing here reads; ``num_tokens`` then gives ``n``.
            reuse_limit: most cached tokens to reuse (``n``, or ``n - 1`` when the last token must be recomputed).
            num_tokens: ``n`` (needed only without ``token_hashes``).

        Returns:
            The leading history tokens reused from GPU pages and from host chunks, or ``None`` if the pages cannot
            be found now (nothing was changed).
        """
        record = self.users.get(user_id)
        if token_hashes is None and record is not None and record.hashed_tokens:
            raise RuntimeError(f"user {user_id!r} has hashed tokens: acquire needs the request's token_hashes")
        n = len(token_hashes) if token_hashes is not None else num_tokens
        gpu = host = held = prefetched = copying = 0
        waiting = user_id in self._prefetched  # locked by a prefetch for this request
        if record is not None:
            if record.locked and not waiting:
                raise RuntimeError(f"user {user_id!r} already has a running request")
            held, prefetched = record.num_pages, record.prefetched
            if record.hashed_tokens and self._reuses:
                reuse = min(self._verified_prefix(record, token_hashes), reuse_limit)
                gpu = min(reuse, record.num_tokens)
                if not held and self.host is not None:
                    host = min(reuse, record.host_tokens)
                    copying = min(reuse, self.host.copying_end(user_id, record))
        # An unlocked record holding pages is in the LRU (``check_invariants``), so ``held`` tells membership.
        deficit = -(-n // self.page_size) - held
        if deficit > self.pool.num_free:
            reclaimable = self._evictable_pages - (0 if waiting else held) if self._evicts else 0
            if deficit > self.pool.num_free + reclaimable:
                return None

        if record is None:
            record = self.users[user_id] = UserRecord(generation=next(self._generations))
        elif held and not waiting:
            del self._lru[user_id]
            self._evictable_pages -= held
        record.locked, record.prefetched = True, 0
        self._prefetched.discard(user_id)
        if copying > host:  # left the GPU moments ago: wait for its copy to host rather than recompute it
            self.host.finish_copies(user_id, record)
            self._stats.unfinished_copy_tokens += copying - host
            host = min(copying, record.host_tokens)
        if gpu + host < record.hashed_tokens:
            self._cut(user_id, record, gpu + host, token_hashes)
        if deficit > 0:
            self._evict_until_free(deficit)  # (nothing if enough pages are free)
            self._take_pages(record, deficit)
        elif deficit < 0:
            if waiting:
                self.host.wait_for_onloads()  # the pages given back may still be being written
            self._drop_pages(record, held + deficit)
        if prefetched:  # tokens the prefetch brought from host count as host hits
            moved = min(gpu, prefetched)
            gpu, host = gpu - moved, moved
        elif host:
            self.host.plan_onload(record, host)
            record.num_tokens = host
        if self.host is not None and (host or record.host_slots):
            self.host.touch(user_id, record)
        return CacheHit(gpu, host)

    def commit(self, user_id: Hashable, num_tokens: int, token_hashes: np.ndarray) -> None:
        """The user's pages now hold the first ``num_tokens`` history tokens of the running request
        (``token_hashes``: uint64 ``[n >= num_tokens]``, the request's, as given to :meth:`acquire`)."""
        record = self.users[user_id]
        ps = self.page_size
        if not record.locked or not record.num_tokens <= num_tokens <= record.num_pages * ps:
            raise RuntimeError(f"commit of {num_tokens} tokens for user {user_id!r}: not locked, shrinking "
                               f"from {record.num_tokens}, or beyond its {record.num_pages} pages")
        # Pages before ``first`` keep their (verified) hashes; the others get the request's, in place.
        first = record.num_tokens // ps
        full, part = divmod(num_tokens, ps)
        if full + (part > 0) > len(record.hash_buffer):
            record.hash_buffer = grown(record.hash_buffer, first, full + (part > 0))
        if full > first:
            record.hash_buffer[first:full] = token_hashes[first * ps + ps - 1: full * ps: ps]
        if part:
            record.hash_buffer[full] = token_hashes[num_tokens - 1]
        record.num_tokens = record.hashed_tokens = num_tokens
        if self.host is not None:
            self.host.plan_offload(user_id, record)

    def release(self, user_id: Hashable) -> None:
        """Unlock the record after its request finished (or failed); keep it for the next visit."""
        record = self.users[user_id]
        record.locked = False
        keep = -(-record.num_tokens // self.page_size) if self._reuses else 0
        if keep < record.num_pages:
            self._drop_pages(record, keep)
        if record.num_pages:
            self._lru.touch(user_id, record)
            self._evictable_pages += record.num_pages
        elif not record.host_slots:
            self._release_record(user_id, record)

    def why_no_room(self, num_tokens: int) -> str | None:
        """Why a history of ``num_tokens`` can never get pages while nothing else runs (``None``: waiting may help)."""
        need = self.pages_for(num_tokens)
        if need > self.pool.num_pages:
            return (f"a history of {num_tokens} tokens needs {need} KV pages but the pool has only "
                    f"{self.pool.num_pages}; raise cache.num_gpu_pages")
        if self.config.mode == "unlimited" and need > self.pool.num_free:
            return (f"unlimited mode ran out of KV pages ({need} needed, {self.pool.num_free} free, "
                    "and this mode never evicts); raise cache.num_gpu_pages or use hierarchical")
        return None

    # ------------------------------------------------------------------ metadata
    def page_table(self, user_ids: Sequence[Hashable], seq_lens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """CSR page table of the first ``seq_lens[b]`` tokens of each user's pages.

        Returns:
            ``(kv_indptr [B + 1], kv_indices [nnz])``, int32, FlashInfer semantics.
        """
        ps, users = self.page_size, self.users
        if isinstance(seq_lens, np.ndarray):
            seq_lens = seq_lens.tolist()
        arrays, offsets = [], [0]
        for uid, seq_len in zip(user_ids, seq_lens, strict=True):
            record = users[uid]
            count = -(-seq_len // ps)
            if count > record.num_pages:
                raise ValueError(f"user {uid!r} holds {record.num_pages} pages, fewer than the {count} asked")
            arrays.append(record.page_buffer[:count])  # a view of the user's own page ids: nothing is rebuilt
            offsets.append(offsets[-1] + count)
        indices = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)
        return np.array(offsets, dtype=np.int32), indices

    def hashed_tokens(self, user_id: Hashable) -> int:
        """History tokens of the user whose hashes the cache holds (0: :meth:`acquire` reads no hashes for it)."""
        record = self.users.get(user_id)
        return 0 if record is None else record.hashed_tokens

    def cached_tokens(self, user_id: Hashable) -> int:
        """History tokens of the user the cache can serve (GPU, or host when not on the GPU)."""
        record = self.users.get(user_id)
        if record is None:
            return 0
        return record.num_tokens if record.num_pages else record.host_tokens

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a page or slot is owned twice or leaked, or a counter is off."""
        owned = [p for r in self.users.values() for p in r.pages.tolist()]
        free = self.pool.free_page_ids()
        assert len(owned) == len(set(owned)), "a page is owned by two users"
        assert not set(owned) & set(free), "a page is both owned and free"
        assert len(owned) + len(free) == self.pool.num_pages, "a page leaked"
        assert all(self.users[u] is r for u, r in self._lru.items()), "LRU holds a stale record"
        assert self._evictable_pages == sum(r.num_pages for r in self._lru.values())
        for uid, r in self.users.items():
            assert (uid in self._lru) == (r.num_pages > 0 and not r.locked), f"user {uid!r}: LRU disagrees"
            assert len(r.page_buffer) >= r.num_pages and len(r.hash_buffer) >= self.pages_for(r.hashed_tokens)
            assert r.num_tokens <= r.hashed_tokens and r.host_tokens <= r.hashed_tokens
            assert r.locked or r.num_pages == self.pages_for(r.num_tokens)
            assert len(r.host_slots) == -(-r.host_tokens // self.config.chunk_tokens)
            assert r.generation > 0, f"user {uid!r}: a deleted record is still listed"
        if self.host is not None:
            self.host.check(self.users)

    # ------------------------------------------------------------------ internals
    def _verified_prefix(self, record: UserRecord, token_hashes: np.ndarray) -> int:
        """Known tokens of ``record`` whose pages match the request's history, page by page."""
        ps, known, n = self.page_size, record.hashed_tokens, len(token_hashes)
        full = min(known, n) // ps  # pages the request can verify in full
        ends, cached = token_hashes[ps - 1: full * ps: ps], record.hash_buffer[:full]
        if ends.tobytes() != cached.tobytes():  # one memcmp decides the usual case: all pages match
            return int(np.argmin(ends == cached)) * ps
        if full * ps == known:
            return known
        # The record's partly filled last page, when the request covers it (else the request cuts a page).
        if known <= n and token_hashes.item(known - 1) == record.hash_buffer.item(full):
            return known
        return full * ps

    def _cut(self, user_id: Hashable, record: UserRecord, num_tokens: int, token_hashes: np.ndarray) -> None:
        """Cut ``record`` back to its first ``num_tokens < hashed_tokens`` tokens, verified against ``token_hashes``."""
        if num_tokens < max(record.num_tokens, record.host_tokens):
            self._stats.truncated_tokens += max(record.num_tokens, record.host_tokens) - num_tokens
        record.generation = next(self._generations)  # transfers in flight beyond the cut are now stale
        if num_tokens % self.page_size:
            record.hash_buffer[num_tokens // self.page_size] = token_hashes[num_tokens - 1]
        record.hashed_tokens = num_tokens
        record.num_tokens = min(record.num_tokens, num_tokens)
        if self.host is not None:
            self.host.cut(user_id, record, num_tokens)

    def _take_pages(self, record: UserRecord, count: int) -> None:
        """Append ``count`` pages from the pool to ``record``'s pages."""
        held = record.num_pages
        if held + count > len(record.page_buffer):
            record.page_buffer = grown(record.page_buffer, held, held + count)
        self.pool.allocate(record.page_buffer[held: held + count])
        record.num_pages = held + count

    def _drop_pages(self, record: UserRecord, keep: int) -> None:
        """Give ``record``'s pages after the first ``keep`` back to the pool."""
        self.pool.free(record.page_buffer[keep: record.num_pages])
        if keep:
            record.num_pages = keep
        else:
            record.forget_pages()

    def _evict_until_free(self, count: int) -> None:
        """Evict least recently used users whose pages are not being read until ``count`` pages are free."""
        while self.pool.num_free < count:
            for victim, record in self._lru.items():  # least recently used first
                if not record.readers:
                    self._evict(victim, record)
                    break  # the LRU changed: walk it again from the start
            else:
                self.host.poll(wait=True)  # only users whose pages are being copied to host: let that finish

    def _evict(self, user_id: Hashable, record: UserRecord) -> None:
        del self._lru[user_id]
        self._evictable_pages -= record.num_pages
        persisting = self.host is not None and self.host.plan_persist(user_id, record)
        self._drop_pages(record, 0)
        self._stats.evicted_users += 1
        self._stats.evicted_tokens += record.num_tokens
        record.num_tokens = 0
        if not record.host_slots and not persisting:
            self._release_record(user_id, record)

    def _release_record(self, user_id: Hashable, record: UserRecord) -> None:
        """Delete ``record``, which holds nothing any more (copies in flight for it are discarded on completion)."""
        if self.users.get(user_id) is record:
            del self.users[user_id]
        record.generation = 0
