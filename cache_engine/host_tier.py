"""The host tier: which chunks to persist or load, and what to do when transfers finish.

docs/design.md section 5 describes its policies and how the manager drives it each step (plan, launch, finish, poll);
:meth:`HostTier.poll` discards a transfer whose record's ``generation`` changed meanwhile.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from .config import CacheConfig
from .host_store import HostChunkStore
from .jobs import OffloadJob, OnloadJob, is_done
from .records import HostStats, LRUIndex, UserRecord
from .transfer import TransferEngine


@dataclass(eq=False, slots=True)
class _Persist(OffloadJob):
    """One chunk copy, decided or in flight, and its transfer job: tokens ``[chunk * C, end)`` of ``user`` (its
    ``record`` at ``generation``) into slot ``slot_id``."""

    user: Hashable
    record: UserRecord
    generation: int
    chunk: int
    end: int


class HostTier:
    """Host chunk persistence for the users of a :class:`~cache_engine.KVCacheManager`.

    Args:
        config: the cache configuration (its host-tier settings).
        kv: the page pool, ``[L, num_pages, 2, page_size, H, D]``.
        release_record: called with a user and its record once the record holds no pages, host slots or lock.
        host_memory: optional preallocated memory for the slots: :class:`~.host_store.HostChunkStore`'s ``memory``.
    """

    def __init__(self, config: CacheConfig, kv: torch.Tensor,
                 release_record: Callable[[Hashable, UserRecord], None],
                 host_memory: torch.Tensor | None = None) -> None:
        num_layers, _, _, page_size, num_heads, head_dim = kv.shape
        slot_shape = (num_layers, config.chunk_pages, 2, page_size, num_heads, head_dim)
        host_dtype = kv.dtype if config.host_dtype == "kv" else getattr(torch, config.host_dtype)
        slot_bytes = math.prod(slot_shape) * host_dtype.itemsize
        self.store = HostChunkStore(config.host_budget_bytes // slot_bytes, slot_shape, host_dtype,
                                    config.host_segment_bytes // slot_bytes, pin=kv.device.type == "cuda",
                                    memory=host_memory)
        scales = None  # FP8 host chunks: dequantisation scales per (slot, layer, K/V, head), on the device
        if config.host_dtype != "kv":
            scales = torch.ones(self.store.num_slots, num_layers, 2, num_heads, dtype=torch.float32, device=kv.device)
        self.transfer = TransferEngine(kv.device, scales, self.store.addresses, config.staging_pages)
        self.config = config
        self.kv = kv
        self.stats = HostStats()
        self._release_record = release_record
        self.chunk = config.chunk_tokens
        self.page_size = page_size
        self._page_bytes = page_size * kv[:, 0, :, 0].numel() * host_dtype.itemsize  # all layers, K and V
        self._chunk_pages = config.chunk_pages
        self._lru = LRUIndex()  # users with host data -> their records, least recently used first
        self._queue: deque[tuple[Hashable, UserRecord, int, int]] = deque()  # (user, record, generation, chunk)
        self._pending: set[tuple[Hashable, int, int]] = set()  # (user, generation, chunk) queued or in flight
        # (done event, chunk copies, records whose pages the copy reads)
        self._in_flight: deque[tuple[torch.cuda.Event | None, list[_Persist], list[UserRecord]]] = deque()
        self._in_flight_chunks = 0  # chunk copies in ``_in_flight``
        self._writing: dict[Hashable, list[_Persist]] | None = None  # those per user, built when first needed
        self._onloads: deque[tuple[list[torch.cuda.Event | None], list[int]]] = deque()
        self._batch: list[_Persist] = []  # chunk copies decided, issued by the next _flush
        self._planned: list[OnloadJob] = []
        self._busy: dict[int, int] = {}  # slot -> onloads in flight reading it
        self._deferred: set[int] = set()  # freed while busy

    @property
    def pending_chunks(self) -> int:
        """Chunk copies launched and not finished, or decided and not launched yet."""
        return self._in_flight_chunks + len(self._batch)

    def prepare(self) -> None:
        """Before a step, create what transfers need (on CUDA: the onload kernel's launcher, the staging buffer)."""
        self.transfer.prepare(self.kv, self.store.slot_shape, self.store.dtype)

    def warm(self, pages: np.ndarray, timeout_s: float = 120.0) -> None:
        """Before serving: run the transfer kernels once (:meth:`.transfer.TransferEngine.warm`) through a free slot
        (waiting up to ``timeout_s`` for the first pinned segment) and ``pages``, int64 ``[chunk_pages]`` free pool
        pages; the slot is free again afterwards (with no slot free, nothing runs)."""
        self.prepare()
        store, deadline = self.store, time.monotonic() + timeout_s
        slot_id = store.allocate()
        while slot_id is None and store.num_allocated < store.num_slots and time.monotonic() < deadline:
            time.sleep(0.01)
            store.adopt_ready_segments()
            slot_id = store.allocate()
        if slot_id is None:
            return
        try:
            self.transfer.warm(self.kv, OffloadJob(pages, slot_id, store.slot(slot_id), len(pages) * self.page_size))
        finally:
            store.free([slot_id])

    # ------------------------------------------------------------------ plans
    def touch(self, user: Hashable, record: UserRecord) -> None:
        """Mark the user's host copy most recently used (host LRU)."""
        self._lru.touch(user, record)

    def plan_onload(self, record: UserRecord, tokens: int) -> None:
        """Plan copying the user's first ``tokens`` host tokens into its (new) pages at the next :meth:`launch`."""
        busy, store_slot, planned, chunk_pages = self._busy, self.store.slot, self._planned, self._chunk_pages
        num_pages = -(-tokens // self.page_size)
        # Views of the locked user's page ids, unchanged until the onload is launched; chunk ``i`` gets pages
        # ``[i * chunk_pages, (i + 1) * chunk_pages)`` of them.
        pages = record.page_buffer[:num_pages]
        slots = record.host_slots[: -(-tokens // self.chunk)]
        for i, slot in enumerate(slots):
            planned.append(OnloadJob(slot, store_slot(slot), pages[i * chunk_pages: (i + 1) * chunk_pages]))
            busy[slot] = busy.get(slot, 0) + 1
        self.stats.onloaded_bytes += num_pages * self._page_bytes
        self.stats.onloaded_tokens += tokens

    def plan_offload(self, user: Hashable, record: UserRecord) -> None:
        """Queue the user's chunks that are full on the GPU and not yet on host (issued by :meth:`finish_step`)."""
        for chunk in range(record.host_tokens // self.chunk, record.num_tokens // self.chunk):
            key = (user, record.generation, chunk)
            if key not in self._pending:
                self._pending.add(key)
                self._queue.append((user, record, record.generation, chunk))

    def plan_persist(self, user: Hashable, record: UserRecord) -> bool:
        """The user's GPU pages are about to be reclaimed: plan copying its GPU history not yet on host (nothing
        without ``persist_tails``: that is lost), issued by the next :meth:`launch`, which must precede any write to
        the pages. Returns whether any copy is now pending for the user."""
        size, tokens, on_host = self.chunk, record.num_tokens, record.host_tokens
        if not self.config.persist_tails:
            self.stats.lost_tokens += tokens - on_host
            return False
        writing = self._copies_in_flight(user) if self._in_flight else None
        in_flight = {(e.chunk, e.end) for e in writing if e.generation == record.generation} if writing else ()
        added = False
        for chunk in range(on_host // size, -(-tokens // size)):
            end = min((chunk + 1) * size, tokens)
            if end <= on_host or (chunk, end) in in_flight:
                continue
            slot = self._allocate_slot(user)
            if slot is None:
                self.stats.lost_tokens += tokens - chunk * size
                break
            self._add(user, record, chunk, end, slot)
            added = True
            if end % size:
                self.stats.tail_persisted_tokens += end - chunk * size
        return added or bool(in_flight)

    # ------------------------------------------------------------------ launches
    def launch(self) -> list[torch.cuda.Event | None]:
        """Issue the copies to host decided so far, then the planned onloads; one entry per layer (see
        :meth:`TransferEngine.onload`)."""
        self._flush()
        self.transfer.before_writes()
        events = self.transfer.onload(self.kv, self._planned)
        if self._planned:
            self._onloads.append((events, [job.slot_id for job in self._planned]))
        self._planned = []
        return events

    def finish_step(self) -> None:
        """After the step's forward is queued: start the queued chunk offloads, within the cap on chunks in flight."""
        while self._queue and self.pending_chunks < self.config.max_pending_offloads:
            user, record, generation, chunk = self._queue.popleft()
            end = (chunk + 1) * self.chunk
            if (record.generation != generation or record.num_tokens < end or record.host_tokens >= end
                    or record.num_pages * self.page_size < end):
                self._pending.discard((user, generation, chunk))
                continue  # already persisted, cut back, evicted or gone
            slot = self._allocate_slot(user)
            if slot is None:
                self._queue.appendleft((user, record, generation, chunk))
                break
            self._add(user, record, chunk, end, slot)
        self.stats.deferred_offloads += len(self._queue)  # chunk-steps spent waiting for admission
        self._flush()

    def poll(self, wait: bool = False) -> None:
        """Apply finished transfers (all of them, waiting, if ``wait``)."""
        self.store.adopt_ready_segments()
        pending, busy = self._pending, self._busy
        while self._in_flight and (wait or is_done(self._in_flight[0][0])):  # in order on one stream
            done, entries, readers = self._in_flight.popleft()
            if wait and done is not None:
                done.synchronize()
            for record in readers:
                record.readers -= 1
            self._in_flight_chunks -= len(entries)
            self._writing = None
            for entry in entries:
                pending.discard((entry.user, entry.generation, entry.chunk))
                self._finish_persist(entry)
        # An onload's layer events are recorded in layer order on one stream: its last one done, all are.
        while self._onloads and (wait or is_done(self._onloads[0][0][-1])):
            events, slots = self._onloads.popleft()
            if wait and events[-1] is not None:
                events[-1].synchronize()
            for slot in slots:
                busy[slot] -= 1
                if not busy[slot]:
                    del busy[slot]
                    if slot in self._deferred:
                        self._deferred.remove(slot)
                        self.store.free([slot])

    def wait_for_onloads(self) -> None:
        """Block until every onload launched so far has written its pages (a rare path: pages given back)."""
        if self._onloads and self._onloads[-1][0][-1] is not None:
            self._onloads[-1][0][-1].synchronize()

    def close(self) -> None:
        """Finish all transfers and stop background work."""
        self.poll(wait=True)
        self.store.close()

    # ------------------------------------------------------------------ slots
    def cut(self, user: Hashable, record: UserRecord, tokens: int) -> None:
        """Keep only the host copy of the first ``tokens`` tokens."""
        keep = -(-min(tokens, record.host_tokens) // self.chunk)
        if keep < len(record.host_slots):
            self._release(record.host_slots[keep:])
            del record.host_slots[keep:]
        record.host_tokens = min(record.host_tokens, tokens)
        if not record.host_slots:
            self._lru.remove(user)

    def check(self, records: dict[Hashable, UserRecord]) -> None:
        """Raise ``AssertionError`` unless every allocated slot is free, owned by one of ``records``, being written or
        awaiting a deferred free, and the host LRU lists current records only."""
        owned = [s for r in records.values() for s in r.host_slots]
        writing = [e.slot_id for _, entries, _ in self._in_flight for e in entries] + [e.slot_id for e in self._batch]
        every = owned + writing + self.store.free_slot_ids() + list(self._deferred)
        assert len(every) == len(set(every)), "a host slot is used twice"
        assert len(every) == self.store.num_allocated, "a host slot leaked"
        assert all(records[u] is r and r.host_slots for u, r in self._lru.items()), "host LRU is stale"
        assert self._in_flight_chunks == sum(len(entries) for _, entries, _ in self._in_flight)

    # ------------------------------------------------------------------ internals
    def _add(self, user: Hashable, record: UserRecord, chunk: int, end: int, slot: int) -> None:
        """Decide to copy tokens ``[chunk * chunk_tokens, end)`` of ``record`` into ``slot``. The job's pages are a
        view of the record's page buffer, unwritten until the next :meth:`_flush` reads it (an evicted record
        abandons its buffer, :meth:`~cache_engine.records.UserRecord.forget_pages`)."""
        page_size, start = self.page_size, chunk * self.chunk
        first, count = start // page_size, -(-(end - start) // page_size)  # within the record's pages
        pages = record.page_buffer[first: first + count]
        self._batch.append(_Persist(pages, slot, self.store.slot(slot), end - start, user, record, record.generation,
                                    chunk, end))
        self.stats.offloaded_tokens += end - start
        self.stats.offloaded_bytes += count * self._page_bytes

    def _flush(self) -> None:
        """Issue the chunk copies decided so far, as one offload (the only place copies to host are issued)."""
        if not self._batch:
            return
        readers = list({id(p.record): p.record for p in self._batch if p.record.num_pages}.values())
        for record in readers:
            record.readers += 1
        done = self.transfer.offload(self.kv, self._batch)
        self._in_flight.append((done, self._batch, readers))
        self._in_flight_chunks += len(self._batch)
        self._writing = None
        self._batch = []

    def _finish_persist(self, entry: _Persist) -> None:
        record = entry.record  # generations are unique, and 0 once deleted: no lookup needed
        if (record.generation != entry.generation or record.host_tokens < entry.chunk * self.chunk
                or entry.end <= record.host_tokens):
            self._release((entry.slot_id,))
            if record.generation and not (record.num_pages or record.host_slots or record.locked):
                self._release_record(entry.user, record)  # evicted, and its copy came too late to be used
            return
        slots = record.host_slots
        if entry.chunk < len(slots):
            old = slots[entry.chunk]
            slots[entry.chunk] = entry.slot_id
            self._release((old,))
        else:
            slots.append(entry.slot_id)
        record.host_tokens = entry.end
        self._lru.touch(entry.user, record)

    def copying_end(self, user: Hashable, record: UserRecord) -> int:
        """The furthest token of ``record``'s current generation that a copy to host decided or in flight (not
        finished) holds; 0 if none."""
        copies = [*self._copies_in_flight(user), *(p for p in self._batch if p.user == user)] if (
            self._in_flight or self._batch) else ()
        return max((p.end for p in copies if p.generation == record.generation), default=0)

    def finish_copies(self, user: Hashable, record: UserRecord) -> None:
        """Issue ``record``'s copies to host still only decided, block until those of its current generation in flight
        have finished (copies finish in issue order, on one stream), and apply them: its ``host_tokens`` then count
        them."""
        if any(p.user == user for p in self._batch):
            self._flush()
        last = None
        for done, entries, _ in self._in_flight:
            if any(e.user == user and e.generation == record.generation for e in entries):
                last = done
        if last is not None:
            last.synchronize()
        self.poll()

    def _copies_in_flight(self, user: Hashable) -> list[_Persist]:
        """The user's chunk copies launched and not finished (indexed per user once per change of ``_in_flight``)."""
        if self._writing is None:
            self._writing = {}
            for _, entries, _ in self._in_flight:
                for entry in entries:
                    self._writing.setdefault(entry.user, []).append(entry)
        return self._writing.get(user, [])

    def _allocate_slot(self, user: Hashable) -> int | None:
        """A free slot, taking the host copy of the least recently used other unlocked user if none is free."""
        while True:
            slot = self.store.allocate()
            if slot is not None:
                return slot
            for victim, record in self._lru.items():  # least recently used first
                if victim != user and not record.locked:
                    break
            else:
                return None
            self.cut(victim, record, 0)  # forget its host copy
            self.stats.host_evicted_users += 1
            if not record.num_pages:
                self._release_record(victim, record)

    def _release(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if slot in self._busy:
                self._deferred.add(slot)
            else:
                self.store.free([slot])

