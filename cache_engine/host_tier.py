"""The host tier's policy: which chunks to persist or load, and what to do when transfers finish.

- **Proactive offload**: after each step, every chunk of a user's history that is full on the GPU but
  not yet on host is queued; at most ``max_pending_offloads`` chunks are in flight (admission
  control), the rest wait for a later step. A user is a *reader* while its pages are being gathered,
  and GPU eviction skips readers.
- **Tail persistence**: before a user's GPU pages are reclaimed, everything not yet on host (the
  un-persisted tail, and any queued full chunks) is persisted at once.
- **Onload**: a returning user whose history is on host gets it copied into its new pages. With
  ``onload_first``, when none of the pages handed out since the last launch is read by a copy to host decided or
  in flight (:meth:`HostTier.writes_must_wait`), the onload is launched before those copies and does not wait for
  their gathers; otherwise, and always without the option, after them.
- **Host LRU**: when no slot is free, the least recently used user without a running request loses
  its host copy (it will be recomputed). A slot still being read by an onload is freed only once that onload finishes.
- Completions are applied by :meth:`HostTier.poll` (start of each step); a transfer whose user's
  history was cut back meanwhile, or whose record was deleted (``generation`` changed), is discarded. On
  CPU transfers are synchronous but still take effect at the next poll, so both paths run the same state
  machine.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from .config import CacheConfig
from .host_store import HostChunkStore
from .jobs import OffloadHandle, OffloadJob, OnloadJob
from .lru import LRUIndex
from .records import CacheStats, UserRecord
from .transfer import TransferEngine


@dataclass(eq=False, slots=True)
class _Persist(OffloadJob):
    """One chunk copy decided or in flight: tokens ``[chunk * C, end)`` of ``user`` (its ``record`` at
    ``generation``) into slot ``slot_id``; itself the transfer's job (one object per chunk copy)."""

    user: Hashable
    record: UserRecord
    generation: int
    chunk: int
    end: int


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
        self.page_size = config.page_size
        self.token_bytes = kv[:, 0, :, 0].numel() * store.dtype.itemsize  # host bytes: all layers, K and V
        self._page_bytes = self.page_size * self.token_bytes
        self._chunk_pages = config.chunk_pages
        self.lru = LRUIndex()  # users with host data -> their records, least recently used first
        self._queue: deque[tuple[Hashable, int, int]] = deque()  # (user, generation, chunk) to offload
        self._pending: set[tuple[Hashable, int, int]] = set()  # queued or in flight
        # (handle, chunk copies, records whose pages the copy still reads)
        self._in_flight: deque[tuple[OffloadHandle, list[_Persist], list[UserRecord]]] = deque()
        self._in_flight_chunks = 0  # chunk copies in ``_in_flight``
        self._writing: dict[Hashable, list[_Persist]] | None = None  # those per user, built when first needed
        self._onloads: deque[tuple[list[torch.cuda.Event | None], list[int]]] = deque()
        self._batch: list[_Persist] = []  # chunk copies decided this step, launched by flush()
        self._planned: list[OnloadJob] = []
        self._planned_slots: list[int] = []
        self._busy: dict[int, int] = {}  # slot -> onloads in flight reading it
        self._deferred: set[int] = set()  # freed while busy
        # onload_first: copies to host are numbered from 1 as launched (the ones decided and not launched yet will be
        # the next); per pool page, the number of the last one that reads it. Gathers finish in order (one stream),
        # so a page is still read by some copy iff its last reader's number exceeds that of the last gather known
        # finished: a finished gather touches no page. The launched copies with their numbers, until their gathers
        # finish.
        self._last_reader = np.zeros(kv.shape[1], dtype=np.int64)
        self._num_offloads = 0  # copies launched (onload_first)
        self._gathered = 0  # the number of the last copy whose gather is known finished
        self._gathers: deque[tuple[OffloadHandle, int]] = deque()

    @classmethod
    def create(cls, config: CacheConfig, kv: torch.Tensor, users: dict[Hashable, UserRecord], stats: CacheStats,
               host_memory: torch.Tensor | None = None) -> HostTier:
        """The host tier of the pool ``kv`` (``[L, num_pages, 2, page_size, H, D]``) with its chunk store (slots in
        ``config.host_dtype``, carved from ``host_memory`` if given) and transfer engine."""
        num_layers, _, _, page_size, num_heads, head_dim = kv.shape
        slot_shape = (num_layers, config.chunk_pages, 2, page_size, num_heads, head_dim)
        host_dtype = kv.dtype if config.host_dtype == "kv" else getattr(torch, config.host_dtype)
        slot_bytes = math.prod(slot_shape) * host_dtype.itemsize
        store = HostChunkStore(config.host_budget_bytes // slot_bytes, slot_shape, host_dtype,
                               config.host_segment_bytes // slot_bytes, pin=kv.device.type == "cuda",
                               memory=host_memory)
        scales = None  # FP8 host chunks: dequantisation scales per (slot, layer, K/V, head), on the device
        if config.host_dtype != "kv":
            scales = torch.ones(store.num_slots, num_layers, 2, num_heads, dtype=torch.float32, device=kv.device)
        transfer = TransferEngine(kv.device, scales, config.onload_streams,
                                  kernels=config.onload_engine in ("kernel", "dma"), dma=config.onload_engine == "dma",
                                  graphs=config.onload_graphs, slot_addresses=store.addresses,
                                  onload_sms=config.onload_sms, dma_graphs=config.dma_graphs,
                                  staging_pages=config.staging_pages, group_bytes=config.onload_group_bytes)
        return cls(config, store, transfer, kv, users, stats)

    @property
    def pending_chunks(self) -> int:
        """Chunk copies launched and not finished, or decided and not launched yet."""
        return self._in_flight_chunks + len(self._batch)

    # ------------------------------------------------------------------ completions
    def poll(self, wait: bool = False) -> None:
        """Apply finished transfers (all of them, waiting, if ``wait``: deferred copies out are issued first)."""
        if wait:
            self.transfer.issue_deferred()
        self.store.adopt_ready_segments()
        gathers = self._gathers
        while gathers and (wait or gathers[0][0].gather_done()):  # in order on one stream, like the readers below
            handle, self._gathered = gathers.popleft()
            if wait and handle.gathered is not None:
                handle.gathered.synchronize()
        for handle, _, readers in self._in_flight:
            if not readers:
                continue
            if not (wait or handle.gather_done()):
                break  # gathers run in order on one stream: the later ones are not done either
            if wait and handle.gathered is not None:
                handle.gathered.synchronize()
            for record in readers:
                record.readers -= 1
            readers.clear()
        pending, busy = self._pending, self._busy
        while self._in_flight and (wait or self._in_flight[0][0].copy_done()):
            handle, entries, _ = self._in_flight.popleft()
            if wait and handle.copied is not None:
                handle.copied.synchronize()
            self._in_flight_chunks -= len(entries)
            self._writing = None
            for entry in entries:
                pending.discard((entry.user, entry.generation, entry.chunk))
                self._finish_persist(entry)
        # A step's layer events are recorded in layer order on one stream: its last one done, all are.
        while self._onloads and (wait or self._onloads[0][0][-1] is None or self._onloads[0][0][-1].query()):
            events, slots = self._onloads.popleft()
            if wait and events[-1] is not None:
                events[-1].synchronize()
            for slot in slots:
                readers = busy[slot] - 1
                if readers:
                    busy[slot] = readers
                else:
                    del busy[slot]
                    if slot in self._deferred:
                        self._deferred.discard(slot)
                        self.store.free([slot])

    def _finish_persist(self, entry: _Persist) -> None:
        record = entry.record  # generations are unique, and 0 once deleted: no lookup needed
        if (record.generation != entry.generation or record.host_tokens < entry.chunk * self.chunk
                or entry.end <= record.host_tokens):
            self._release((entry.slot_id,))
            if record.generation and not (record.num_pages or record.host_slots or record.locked):
                del self.users[entry.user]  # evicted, and its copy came too late to be used
                record.retire()
            return
        slots = record.host_slots
        if entry.chunk < len(slots):
            old = slots[entry.chunk]
            slots[entry.chunk] = entry.slot_id
            self._release((old,))
        else:
            slots.append(entry.slot_id)
        record.host_tokens = entry.end
        self.lru.touch(entry.user, record)

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
        while self._queue and self.pending_chunks < self.config.max_pending_offloads:
            user, generation, chunk = self._queue.popleft()
            record = self.users.get(user)
            end = (chunk + 1) * self.chunk
            if (record is None or record.generation != generation or record.num_tokens < end
                    or record.host_tokens >= end or record.num_pages * self.page_size < end):
                self._pending.discard((user, generation, chunk))
                continue  # already persisted, cut back, evicted or gone
            slot = self._allocate_slot(user)
            if slot is None:
                self._queue.appendleft((user, generation, chunk))
                break
            self._add(user, record, chunk, end, slot)
        self.stats.deferred_offloads += len(self._queue)  # chunk-steps spent waiting for admission
        self.flush()

    def persist_all(self, user: Hashable, record: UserRecord) -> bool:
        """Persist everything of the user's GPU history not yet on host (before its pages are reused). The copies
        start at the next :meth:`flush`, which must come before any write to the pages. Returns whether any copy is
        now pending for the user."""
        writing = self._copies_in_flight(user) if self._in_flight else None
        in_flight = {(e.chunk, e.end) for e in writing if e.generation == record.generation} if writing else ()
        added = False
        size, tokens, on_host = self.chunk, record.num_tokens, record.host_tokens
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

    def _add(self, user: Hashable, record: UserRecord, chunk: int, end: int, slot: int) -> None:
        """Decide to copy tokens ``[chunk * chunk_tokens, end)`` of ``record`` into ``slot``. The job's pages are a
        view of the record's page buffer, read by the next :meth:`flush`: until then the buffer's entries are not
        written (an evicted record abandons its buffer, :meth:`~cache_engine.records.UserRecord.forget_pages`, so
        its pages may be handed to another user meanwhile)."""
        page_size, start = self.page_size, chunk * self.chunk
        first, count = start // page_size, -(-(end - start) // page_size)  # within the record's pages
        pages = record.page_buffer[first: first + count]
        self._batch.append(_Persist(pages, slot, self.store.slot(slot), end - start, user, record, record.generation,
                                    chunk, end))
        if self.config.onload_first:
            self._last_reader[pages] = self._num_offloads + 1  # launched by the next flush
        stats = self.stats
        stats.offloaded_tokens += end - start
        stats.offloaded_bytes += count * self._page_bytes

    def flush(self) -> None:
        """Launch the chunk copies collected so far, as one offload."""
        if not self._batch:
            return
        readers = list({id(p.record): p.record for p in self._batch if p.record.num_pages}.values())
        for record in readers:
            record.readers += 1
        handle = self.transfer.offload(self.kv, self._batch)
        if self.config.onload_first:  # its jobs' pages are read until its gather finishes
            self._num_offloads += 1
            self._gathers.append((handle, self._num_offloads))
        self._in_flight.append((handle, self._batch, readers))
        self._in_flight_chunks += len(self._batch)
        self._writing = None
        self._batch = []

    def _copies_in_flight(self, user: Hashable) -> list[_Persist]:
        """The user's chunk copies launched and not finished (the per-user index is rebuilt once after each
        change of ``_in_flight``, so an eviction never scans every copy in flight)."""
        if self._writing is None:
            self._writing = {}
            for _, entries, _ in self._in_flight:
                for entry in entries:
                    self._writing.setdefault(entry.user, []).append(entry)
        return self._writing.get(user, [])

    # ------------------------------------------------------------------ onload
    def plan_onload(self, record: UserRecord, tokens: int) -> None:
        """Queue copying the user's first ``tokens`` host tokens into its (new) pages."""
        busy, store_slot, planned, chunk_pages = self._busy, self.store.slot, self._planned, self._chunk_pages
        num_pages = -(-tokens // self.page_size)
        # Views of the user's page ids: its pages stay as they are until this step's onloads are launched (the
        # user is locked; other users' acquires take or free only their own pages). Chunk ``i`` gets pages
        # ``[i * chunk_pages, (i + 1) * chunk_pages)`` of them (the slice stops at the last page).
        pages = record.page_buffer[:num_pages]
        slots = record.host_slots[: -(-tokens // self.chunk)]
        first = 0
        for slot in slots:
            planned.append(OnloadJob(slot, store_slot(slot), pages[first: first + chunk_pages]))
            busy[slot] = busy.get(slot, 0) + 1
            first += chunk_pages
        self._planned_slots.extend(slots)
        self.stats.onloaded_bytes += num_pages * self._page_bytes
        self.stats.onloaded_tokens += tokens

    def copies_in_flight(self) -> bool:
        """Whether a copy to host is decided or launched and not known to have finished its gather."""
        return bool(self._gathers or self._batch)

    def writes_must_wait(self, pages: np.ndarray) -> bool:
        """Whether any of ``pages`` (int ``[n]``, pool pages handed out to be written) is read by a copy to host
        decided or launched and not known to have finished its gather."""
        return (self.copies_in_flight() and bool(len(pages))
                and bool((self._last_reader[pages] > self._gathered).any()))

    def launch_onloads(self, handed_out: np.ndarray | None = None) -> list[torch.cuda.Event | None]:
        """Start pending chunk copies and the planned onloads; one entry per layer (see :meth:`TransferEngine.onload`).
        ``handed_out``: with ``onload_first``, every pool page handed out since the last call; when none must wait
        (:meth:`writes_must_wait`) the onloads go first and nothing waits for the copies' gathers."""
        if self.config.onload_first and handed_out is not None and not self.writes_must_wait(handed_out):
            events = self.transfer.onload(self.kv, self._planned)
            self.flush()
        else:
            self.flush()
            self.transfer.before_writes()
            events = self.transfer.onload(self.kv, self._planned)
        if self._planned:
            self._onloads.append((events, self._planned_slots))
        self._planned, self._planned_slots = [], []
        return events

    def wait_for_onloads(self) -> None:
        """Block until every onload launched so far has written its pages (before pages an onload may still be
        writing are given back to the pool; a rare path)."""
        if self._onloads and self._onloads[-1][0][-1] is not None:
            self._onloads[-1][0][-1].synchronize()

    # ------------------------------------------------------------------ slots
    def cut(self, user: Hashable, record: UserRecord, tokens: int) -> None:
        """Keep only the host copy of the first ``tokens`` tokens."""
        keep = -(-min(tokens, record.host_tokens) // self.chunk)
        if keep < len(record.host_slots):
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
            for victim, record in self.lru.items():  # least recently used first
                if victim != user and not record.locked:
                    break
            else:
                return None
            self.drop(victim, record)
            self.stats.host_evicted_users += 1
            if not record.num_pages:
                del self.users[victim]
                record.retire()

    def check_slots(self) -> None:
        """Every allocated slot is free, owned by one user, being written, or awaiting a deferred free."""
        owned = [s for r in self.users.values() for s in r.host_slots]
        writing = [e.slot_id for _, entries, _ in self._in_flight for e in entries] + [e.slot_id for e in self._batch]
        free = self.store.free_slot_ids()
        every = owned + writing + free + list(self._deferred)
        assert len(every) == len(set(every)), "a host slot is used twice"
        assert len(every) == self.store.num_allocated, "a host slot leaked"
        assert all(self.users[u] is r and r.host_slots for u, r in self.lru.items()), "host LRU is stale"
        assert self._in_flight_chunks == sum(len(entries) for _, entries, _ in self._in_flight)
        assert self.copies_in_flight() or not (self._last_reader > self._gathered).any(), \
            "a page is counted as read by a finished copy"

    def _release(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if slot in self._busy:
                self._deferred.add(slot)
            else:
                self.store.free([slot])
