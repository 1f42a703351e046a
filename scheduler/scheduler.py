"""Which requests run in the next step, by the rules of docs/design.md section 3, step 1 (Schedule): budgets per
step, one request per user at a time in arrival order, first come first served across users, running requests
first, and admission only once the cache has pages for the whole history.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Hashable
from typing import Protocol

import numpy as np

from .config import SchedulerConfig
from .request_state import RequestState, RequestStatus, ScheduledChunk, SchedulerOutput


class KVAllocator(Protocol):
    """What the scheduler needs from the KV cache (implemented by ``cache_engine.KVCacheManager``)."""

    def acquire(self, user_id: Hashable, token_hashes: np.ndarray | None, reuse_limit: int,
                num_tokens: int | None = None) -> tuple[int, int] | None:
        """Lock the user and find pages for the whole history (``num_tokens`` events, hashed in ``token_hashes``:
        ``None`` only for a user with no hashed tokens); ``(gpu_hits, host_hits)`` or ``None``."""

    def commit(self, user_id: Hashable, num_tokens: int, token_hashes: np.ndarray) -> None:
        """The user's pages now hold ``num_tokens`` history tokens."""

    def release(self, user_id: Hashable) -> None:
        """The user's request is over."""

    def keep(self, user_ids: list[Hashable]) -> list[Hashable]:
        """Make these users the most recently used: evictions take others first."""

    def why_no_room(self, num_tokens: int) -> str | None:
        """Why ``num_tokens`` can never get pages (``None``: waiting may help)."""


class Scheduler:
    """First-come-first-served, per-user ordered, token-budgeted batching with chunked prefill."""

    def __init__(self, config: SchedulerConfig, kv: KVAllocator) -> None:
        self.config = config
        self.kv = kv
        self._queues: dict[Hashable, deque[RequestState]] = {}  # per-user waiting requests
        self._num_waiting = 0  # requests in ``_queues``: a backlog of any size is counted in O(1)
        self._ready: list[tuple[int, Hashable]] = []  # heap of (head seq_id, user) of idle users
        self.running: list[RequestState] = []  # admitted, in admission order

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return self._num_waiting + len(self.running)

    def has_user(self, user_id: Hashable) -> bool:
        """Whether a request of ``user_id`` is waiting or running."""
        return user_id in self._queues or any(r.user_id == user_id for r in self.running)

    def add(self, request: RequestState) -> None:
        """Queue ``request`` behind its user's earlier requests (served in arrival order)."""
        queue = self._queues.setdefault(request.user_id, deque())
        queue.append(request)
        self._num_waiting += 1
        if len(queue) == 1 and all(r.user_id != request.user_id for r in self.running):
            heapq.heappush(self._ready, (request.seq_id, request.user_id))

    def schedule(self) -> SchedulerOutput:
        """Plan the next step: running requests continue first, then idle users' oldest requests are admitted
        (their KV acquired from the cache) while the batch and token budgets allow."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        failed: list[tuple[RequestState, str]] = []
        for request in self.running:
            if len(chunks) == self.config.max_num_seqs or budget <= 0:
                break
            chunk = self._next_chunk(request, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens

        admitted: list[RequestState] = []
        if self._ready and len(chunks) < self.config.max_num_seqs and budget > 0:
            # The users this pass may admit: one's acquire must not evict another's cached history.
            self.kv.keep(self._next_users(self.config.max_num_seqs - len(chunks)))
        while self._ready and len(chunks) < self.config.max_num_seqs and budget > 0:
            _, user_id = self._ready[0]
            request = self._queues[user_id][0]
            if any(r.solo for r in self.running) or (request.solo and self.running):
                break  # a request being retried alone runs alone
            hit = self.kv.acquire(user_id, request.token_hashes, request.reuse_limit, num_tokens=request.num_history)
            if hit is None:
                reason = None if self.running else self.kv.why_no_room(request.num_history)
                if reason is None:
                    break  # wait for running requests to release pages
                self._pop_waiting(user_id, admitted=False)
                request.status = RequestStatus.FAILED
                failed.append((request, reason))
                continue
            self._pop_waiting(user_id, admitted=True)
            request.status = RequestStatus.RUNNING
            request.num_gpu_hits, request.num_host_hits = hit
            request.num_done = request.num_reused
            self.running.append(request)
            admitted.append(request)
            chunk = self._next_chunk(request, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
        return SchedulerOutput(chunks, admitted, failed)

    def _next_users(self, count: int) -> list[Hashable]:
        """The first ``count`` idle users in admission order, read off the heap's top levels in ``O(count log
        count)`` (a walk from the root, smallest first) rather than from the whole heap."""
        heap, users = self._ready, []
        frontier = [(heap[0][0], 0)] if heap else []
        while frontier and len(users) < count:
            _, i = heapq.heappop(frontier)
            users.append(heap[i][1])
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child][0], child))
        return users

    def complete(self, chunks: list[ScheduledChunk]) -> list[RequestState]:
        """Record that ``chunks`` ran; return the requests that finished."""
        finished = []
        for chunk in chunks:
            request = chunk.request
            if chunk.end > request.num_done:
                self.kv.commit(request.user_id, chunk.end, request.token_hashes)
                request.num_done = chunk.end
            if chunk.final:
                request.status = RequestStatus.FINISHED
                self._retire(request)
                finished.append(request)
        return finished

    def abort(self, request: RequestState) -> None:
        """Drop a running request (its step failed); the user's next request may proceed."""
        request.status = RequestStatus.FAILED
        self._retire(request)

    def retry_alone(self, request: RequestState) -> None:
        """Requeue a running request at its user's head, to run alone: a failed step is retried request by
        request, so only the culprit fails. Its committed history tokens stay cached and are reused."""
        self.running.remove(request)
        self.kv.release(request.user_id)
        request.status = RequestStatus.WAITING
        request.solo = True
        request.num_gpu_hits = request.num_host_hits = request.num_done = 0
        self._queues.setdefault(request.user_id, deque()).appendleft(request)  # the user was not ready
        self._num_waiting += 1
        heapq.heappush(self._ready, (request.seq_id, request.user_id))

    def drop_waiting(self, should_drop: Callable[[RequestState], bool]) -> list[RequestState]:
        """Remove and return the waiting (not admitted) requests ``should_drop`` accepts; a pass over all waiting."""
        dropped: list[RequestState] = []
        for user_id in list(self._queues):
            kept: deque[RequestState] = deque()
            gone = []
            for request in self._queues[user_id]:
                (gone if should_drop(request) else kept).append(request)
            if not gone:
                continue
            dropped += gone
            if kept:
                self._queues[user_id] = kept
            else:
                del self._queues[user_id]
        if dropped:
            for request in dropped:
                request.status = RequestStatus.FAILED
            self._num_waiting -= len(dropped)
            running = {r.user_id for r in self.running}
            self._ready = [(q[0].seq_id, u) for u, q in self._queues.items() if u not in running]
            heapq.heapify(self._ready)
        return dropped

    def _next_chunk(self, request: RequestState, budget: int) -> ScheduledChunk | None:
        remaining = request.num_history - request.num_done
        cap = self.config.chunk_tokens
        if remaining <= cap and remaining + request.num_candidates <= budget:
            return ScheduledChunk(request, request.num_done, request.num_history, final=True)
        if remaining == 0:
            return None  # only the candidates are left and they need a larger share of a step
        take = min(remaining, budget, cap)
        return ScheduledChunk(request, request.num_done, request.num_done + take, final=False)

    def _pop_waiting(self, user_id: Hashable, admitted: bool) -> None:
        """Take the user's head request off the waiting structures; if it failed, the user's next becomes ready."""
        heapq.heappop(self._ready)
        queue = self._queues[user_id]
        queue.popleft()
        self._num_waiting -= 1
        if not queue:
            del self._queues[user_id]
        elif not admitted:
            heapq.heappush(self._ready, (queue[0].seq_id, user_id))

    def _retire(self, request: RequestState) -> None:
        self.running.remove(request)
        self.kv.release(request.user_id)
        queue = self._queues.get(request.user_id)
        if queue:
            heapq.heappush(self._ready, (queue[0].seq_id, request.user_id))
