"""The host tier's policy: which chunks to persist or load, and what to do when transfers finish.

- **Proactive offload**: after each step, every chunk of a user's history that is full on the GPU but
  not yet on host is queued; at most ``max_pending_offloads`` chunks are in flight (admission
  control), the rest wait for a later step. A user is a *reader* while its pages are being gathered,
  and GPU eviction skips readers.
- **Tail persistence**: before a user's GPU pages are reclaimed, everything not yet on host (the
  un-persisted tail, and any queued full chunks) is persisted at once.
- **Onload**: a returning user whose history is on host gets it copied into its new pages.
- **Host LRU**: when no slot is free, the least recently used user without a running request loses
  its host copy (it will be recomputed). A slot still being read by an onload is freed only once that onload finishes.
- Completions are applied by :meth:`HostTier.poll` (start of each step); a transfer whose user's
  history was cut back meanwhile (``generation`` changed) is discarded. On CPU transfers are
  synchronous but still take effect at the next poll, so both paths run the same state machine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .config import CacheConfig
from .host_store import HostChunkStore
from .lru import LRUIndex
from .records import CacheStats, UserRecord
from .transfer import OffloadHandle, OffloadJob, OnloadJob, TransferEngine


@dataclass
class _Persist:
    """One chunk copy in flight: tokens ``[chunk * C, end)`` of ``user`` into ``slot``."""

    user: Hashable
    generation: int
    chunk: int
    end: int
    slot: int


class HostTier:
    """Host chunk persistence for the users of a :class:`~cache_engine.KVCacheManager`."""

    def __init__(self, config: CacheConfig, store: HostChunkStore, transfer: TransferEngine,
                 kv: torch.Tensor, users: dict[Hashable, UserRecord], stats: CacheStats) -> None:
        self.config = config
        self.store = store
        self.transfer = transfer
        self.kv = kv
        self.users = users
        self.stats = stats
        self.chunk = config.chunk_tokens
        self.token_bytes = kv[:, 0, :, 0].numel() * store.dtype.itemsize  # host bytes: all layers, K and V
        self.lru = LRUIndex()  # users with host data, least recently used first
        self._queue: deque[tuple[Hashable, int, int]] = deque()  # (user, generation, chunk) to offload
        self._pending: set[tuple[Hashable, int, int]] = set()  # queued or in flight
        # (handle, chunk copies, records whose pages the copy still reads)
        self._in_flight: deque[tuple[OffloadHandle, list[_Persist], list[UserRecord]]] = deque()
        self._onloads: deque[tuple[list[torch.cuda.Event | None], list[int]]] = deque()
        self._batch: list[_Persist] = []  # chunk copies decided this step, launched by flush()
        self._batch_jobs: list[OffloadJob] = []
        self._planned: list[OnloadJob] = []
        self._planned_slots: list[int] = []
        self._busy: dict[int, int] = {}  # slot -> onloads in flight reading it
        self._deferred: set[int] = set()  # freed while busy

    @property
    def pending_chunks(self) -> int:
        return sum(len(entries) for _, entries, _ in self._in_flight) + len(self._batch)

    # ------------------------------------------------------------------ completions
    def poll(self, wait: bool = False) -> None:
        """Apply finished transfers (all of them, waiting, if ``wait``: deferred copies out are issued first)."""
        if wait:
            self.transfer.issue_deferred()
        self.store.adopt_ready_segments()
        for handle, _, readers in self._in_flight:
            if readers and (wait or handle.gather_done()):
                if wait and handle.gathered is not None:
                    handle.gathered.synchronize()
                for record in readers:
                    record.readers -= 1
                readers.clear()
        while self._in_flight and (wait or self._in_flight[0][0].copy_done()):
            handle, entries, _ = self._in_flight.popleft()
            if wait and handle.copied is not None:
                handle.copied.synchronize()
            for entry in entries:
                self._pending.discard((entry.user, entry.generation, entry.chunk))
                self._finish_persist(entry)
        while self._onloads and (wait or all(e is None or e.query() for e in self._onloads[0][0])):
            events, slots = self._onloads.popleft()
            for event in events:
                if wait and event is not None:
                    event.synchronize()
            for slot in slots:
                self._busy[slot] -= 1
                if not self._busy[slot]:
                    del self._busy[slot]
                    if slot in self._deferred:
                        self._deferred.discard(slot)
                        self.store.free([slot])

    def _finish_persist(self, entry: _Persist) -> None:
        record = self.users.get(entry.user)
        stale = (record is None or record.generation != entry.generation
                 or record.host_tokens < entry.chunk * self.chunk or entry.end <= record.host_tokens)
        if stale:
            self._release([entry.slot])
            if record is not None and not (record.pages or record.host_slots or record.locked):
                del self.users[entry.user]  # evicted, and its copy came too late to be used
            return
        if entry.chunk < len(record.host_slots):
            self._release([record.host_slots[entry.chunk]])
            record.host_slots[entry.chunk] = entry.slot
        else:
            record.host_slots.append(entry.slot)
        record.host_tokens = entry.end
        self.lru.touch(entry.user)

    # ------------------------------------------------------------------ offload
    def queue_full_chunks(self, user: Hashable, record: UserRecord) -> None:
        """Queue the user's chunks that are full on the GPU and not yet on host."""
        first = record.host_tokens // self.chunk
        for chunk in range(first, record.num_tokens // self.chunk):
            key = (user, record.generation, chunk)
            if key not in self._pending:
                self._pending.add(key)
                self._queue.append(key)

    def launch_offloads(self) -> None:
        """Start queued chunk offloads, within the cap on chunks in flight."""
        persists: list[_Persist] = []
        while self._queue and self.pending_chunks + len(persists) < self.config.max_pending_offloads:
            user, generation, chunk = self._queue.popleft()
            record = self.users.get(user)
            end = (chunk + 1) * self.chunk
            if (record is None or record.generation != generation or record.num_tokens < end
                    or record.host_tokens >= end or len(record.pages) * self.config.page_size < end):
                self._pending.discard((user, generation, chunk))
                continue  # already persisted, cut back, evicted or gone
            slot = self._allocate_slot(user)
            if slot is None:
                self._queue.appendleft((user, generation, chunk))
                break
            persists.append(_Persist(user, generation, chunk, end, slot))
        self.stats.deferred_offloads += len(self._queue)  # chunk-steps spent waiting for admission
        self._add(persists)
        self.flush()

    def persist_all(self, user: Hashable, record: UserRecord) -> bool:
        """Persist everything of the user's GPU history not yet on host (before its pages are reused).
        The copies start at the next :meth:`flush`, which must come before any write to the pages.
        Returns whether any copy is now pending for the user."""
        in_flight = {(e.chunk, e.end) for _, entries, _ in self._in_flight for e in entries
                     if e.user == user and e.generation == record.generation}
        persists = []
        for chunk in range(record.host_tokens // self.chunk, -(-record.num_tokens // self.chunk)):
            end = min((chunk + 1) * self.chunk, record.num_tokens)
            if end <= record.host_tokens or (chunk, end) in in_flight:
                continue
            slot = self._allocate_slot(user)
            if slot is None:
                self.stats.lost_tokens += record.num_tokens - chunk * self.chunk
                break
            persists.append(_Persist(user, record.generation, chunk, end, slot))
            if end % self.chunk:
                self.stats.tail_persisted_tokens += end - chunk * self.chunk
        self._add(persists)
        return bool(persists or in_flight)

    def _add(self, persists: list[_Persist]) -> None:
        """Resolve the pages of each chunk copy now (they may be handed to another user right after)."""
        page_size = self.config.page_size
        per_chunk = self.chunk // page_size
        for p in persists:
            record = self.users[p.user]
            first = p.chunk * per_chunk
            pages = record.pages[first: first + -(-(p.end - p.chunk * self.chunk) // page_size)]
            self._batch.append(p)
            self._batch_jobs.append(OffloadJob(pages, p.slot, self.store.slot(p.slot)))
            self.stats.offloaded_tokens += p.end - p.chunk * self.chunk
            self.stats.offloaded_bytes += len(pages) * page_size * self.token_bytes

    def flush(self) -> None:
        """Launch the chunk copies collected so far, as one offload."""
        if not self._batch:
            return
        readers = list({id(r): r for p in self._batch if (r := self.users.get(p.user)) and r.pages}.values())
        for record in readers:
            record.readers += 1
        handle = self.transfer.offload(self.kv, self._batch_jobs)
        self._in_flight.append((handle, self._batch, readers))
        self._batch, self._batch_jobs = [], []

    # ------------------------------------------------------------------ onload
    def plan_onload(self, record: UserRecord, tokens: int) -> None:
        """Queue copying the user's first ``tokens`` host tokens into its (new) pages."""
        page_size = self.config.page_size
        per_chunk = self.chunk // page_size
        for chunk in range(-(-tokens // self.chunk)):
            count = -(-(min((chunk + 1) * self.chunk, tokens) - chunk * self.chunk) // page_size)
            slot = record.host_slots[chunk]
            self._planned.append(OnloadJob(slot, self.store.slot(slot), record.pages[chunk * per_chunk:][:count]))
            self._planned_slots.append(slot)
            self._busy[slot] = self._busy.get(slot, 0) + 1
            self.stats.onloaded_bytes += count * page_size * self.token_bytes
        self.stats.onloaded_tokens += tokens

    def launch_onloads(self) -> list[torch.cuda.Event | None]:
        """Start pending chunk copies, then the planned onloads; one entry per layer (see
        :meth:`TransferEngine.onload`)."""
        self.flush()
        self.transfer.before_writes()
        events = self.transfer.onload(self.kv, self._planned)
        if self._planned:
            self._onloads.append((events, self._planned_slots))
        self._planned, self._planned_slots = [], []
        return events

    # ------------------------------------------------------------------ slots
    def cut(self, user: Hashable, record: UserRecord, tokens: int) -> None:
        """Keep only the host copy of the first ``tokens`` tokens."""
        keep = -(-min(tokens, record.host_tokens) // self.chunk)
        self._release(record.host_slots[keep:])
        del record.host_slots[keep:]
        record.host_tokens = min(record.host_tokens, tokens)
        if not record.host_slots:
            self.lru.remove(user)

    def drop(self, user: Hashable, record: UserRecord) -> None:
        """Forget the user's host copy."""
        self._release(record.host_slots)
        record.host_slots = []
        record.host_tokens = 0
        self.lru.remove(user)

    def _allocate_slot(self, user: Hashable) -> int | None:
        while True:
            slot = self.store.allocate()
            if slot is not None:
                return slot
            victim = next((u for u in self.lru if u != user and not self.users[u].locked), None)
            if victim is None:
                return None
            record = self.users[victim]
            self.drop(victim, record)
            self.stats.host_evicted_users += 1
            if not record.pages and not record.locked:
                del self.users[victim]

    def check_slots(self) -> None:
        """Every allocated slot is free, owned by one user, being written, or awaiting a deferred free."""
        owned = [s for r in self.users.values() for s in r.host_slots]
        writing = [e.slot for _, entries, _ in self._in_flight for e in entries] + [e.slot for e in self._batch]
        free = self.store.free_slot_ids()
        every = owned + writing + free + list(self._deferred)
        assert len(every) == len(set(every)), "a host slot is used twice"
        assert len(every) == self.store.num_allocated, "a host slot leaked"
        assert all(self.users[u].host_slots for u in self.lru), "host LRU holds a user without host data"

    def _release(self, slots: list[int]) -> None:
        for slot in slots:
            if slot in self._busy:
                self._deferred.add(slot)
            else:
                self.store.free([slot])
