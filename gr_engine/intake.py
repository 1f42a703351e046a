"""Intake (docs/design.md section 3, step 2's request side): new requests are validated, the new parts of their
histories hashed per page (a first visit's when its first step is launched: :meth:`RequestIntake.hash_deferred`) and
queued in the scheduler; with ``cache.prefetch`` their users' host-resident history starts loading first."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cache_engine import IncrementalHasher, KVCacheManager
from scheduler import RequestState, Scheduler

from .config import EngineConfig
from .metrics import EngineStats
from .model_runner import RequestPayload
from .outputs import output_user_id
from .request import GenerateParams
from .validation import RequestError, check_candidates, check_events, parse_fields, values_valid


def request_labels(request: Any) -> tuple[str, int | str | None]:
    """The ``request_id`` and ``user_id`` that a refused request's output reports: its fields, or its keys where it is
    a mapping (a request given as a dict); ``""`` and ``None`` where it has none (``user_id``: see
    :func:`~.outputs.output_user_id`)."""
    if isinstance(request, Mapping):
        return str(request.get("request_id", "")), output_user_id(request.get("user_id"))
    return str(getattr(request, "request_id", "")), output_user_id(getattr(request, "user_id", None))


class RequestIntake:
    """Takes requests into the engine: owns the prefix hasher, the sequence numbers and the ids in flight, and the
    prefetches' host time and bytes until a step counts them (:meth:`take_prefetch`).

    Args:
        config: the engine configuration.
        kv: the engine's cache manager (prefetches, cached lengths).
        scheduler: where valid requests are queued.
        stats: where each request's intake time is recorded.

    Attributes:
        hasher: the :class:`~cache_engine.IncrementalHasher` of users' last validated histories.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager, scheduler: Scheduler, stats: EngineStats) -> None:
        self._config, self._kv, self._scheduler, self._stats = config, kv, scheduler, stats
        self.hasher = IncrementalHasher(config.cache.page_size)
        self._seq = itertools.count()
        self._in_flight: set[str] = set()
        # Prefetches since the last step: host time (for its onload phase), bytes moved (onloaded, offloaded).
        self._prefetch_s, self._prefetch_bytes = 0.0, (0, 0)

    def finished(self, request_id: str) -> None:
        """A request has its output: its id may be used again."""
        self._in_flight.discard(request_id)

    def take_prefetch(self) -> tuple[float, tuple[int, int]]:
        """The host seconds and bytes (onloaded, offloaded) of the prefetches since the last call."""
        taken = self._prefetch_s, self._prefetch_bytes
        self._prefetch_s, self._prefetch_bytes = 0.0, (0, 0)
        return taken

    def add(self, requests: Sequence[Any], params: GenerateParams | None) -> list[int | RequestError]:
        """Intake (docs/design.md section 3, step 2's request side): validate, hash the new parts of all valid
        histories in one pass, queue; returns each request's sequence number or error. Values are checked for the
        whole batch at once (:func:`values_valid`), request by request only when that finds a problem. ``params``
        that are not :class:`GenerateParams` refuse every request."""
        if params is not None and not isinstance(params, GenerateParams):
            refused = RequestError(f"params must be a GenerateParams, got {type(params).__name__}")
            return [refused] * len(requests)
        if self._config.cache.prefetch and self._kv.host is not None and not self._scheduler.num_unfinished:
            # The coming step's users, before validation: their onloads run while the host validates and schedules.
            t, before = time.perf_counter(), self._kv.transferred_bytes
            users = [getattr(request, "user_id", None) for request in requests]
            self._kv.prefetch(users, self._next_step_size(requests))
            self._prefetch_s += time.perf_counter() - t
            after = self._kv.transferred_bytes
            self._prefetch_bytes = (self._prefetch_bytes[0] + after[0] - before[0],
                                    self._prefetch_bytes[1] + after[1] - before[1])
        t0 = time.perf_counter()
        added: list[int | RequestError | None] = [None] * len(requests)
        parsed, valid, ids, matches = [], [], set(), []
        caching = self._config.cache.mode != "recompute"  # recompute never reads the prefix hashes
        for i, request in enumerate(requests):
            try:
                arrays = parse_fields(request, self._config, ranking=params is None)
            except RequestError as exc:
                added[i] = exc
                continue
            # Events equal to the user's last validated history need no second check.
            match = self.hasher.match(request.user_id, arrays.item_ids, arrays.action_ids,
                                      arrays.timestamps) if caching else None
            parsed.append((i, request, arrays, match, match.length if match else 0))
        checked = values_valid([(arrays, start) for _, _, arrays, _, start in parsed], self._config)
        for i, request, arrays, match, start in parsed:
            try:
                if not checked:
                    check_candidates(arrays, self._config)
                if request.request_id in self._in_flight or request.request_id in ids:
                    raise RequestError(f"request_id {request.request_id!r} is already in flight")
                if not checked:
                    check_events(arrays, self._config, start)
            except RequestError as exc:
                added[i] = exc
                continue
            ids.add(request.request_id)
            valid.append((i, request, arrays))
            matches.append(match)
        if caching:
            # A user with nothing cached, no request in flight and no kept history (a first visit, or one evicted
            # everywhere) is hashed after its first step is launched (hash_deferred): nothing reads its hashes before.
            deferred, users = [], set()
            for (_, request, _), match in zip(valid, matches, strict=True):
                user = request.user_id
                deferred.append(not match.length and user not in users and not self._kv.hashed_tokens(user)
                                and not self._scheduler.has_user(user))
                users.add(user)
            hashed = iter(self.hasher.many(
                [(r.user_id, a.item_ids, a.action_ids, a.timestamps) for (_, r, a), d in zip(valid, deferred) if not d],
                [m for m, d in zip(matches, deferred) if not d]))
            hashes = [None if d else next(hashed) for d in deferred]
        else:
            hashes = [np.zeros(a.num_history, dtype=np.uint64) for _, _, a in valid]
        intake_s = (time.perf_counter() - t0) / max(len(valid), 1)  # each request's share
        for (i, request, arrays), token_hashes in zip(valid, hashes, strict=True):
            n = arrays.num_history
            state = RequestState(
                seq_id=next(self._seq), user_id=request.user_id, num_history=n,
                num_candidates=len(arrays.candidate_item_ids), reuse_limit=n if params is None else n - 1,
                token_hashes=token_hashes, payload=RequestPayload(request, arrays, params, t0),
            )
            state.timings["intake"] = intake_s
            self._stats.record_intake(intake_s)
            self._in_flight.add(request.request_id)
            self._scheduler.add(state)
            added[i] = state.seq_id
        if not self._scheduler.num_unfinished:  # every request was refused: no step will hand prefetches back
            self._kv.hand_back_prefetched()
        return added

    def hash_deferred(self, requests: Sequence[RequestState]) -> None:
        """Hash the histories left unhashed at intake (``token_hashes is None``) among ``requests``, in one pass, and
        keep them as their users' last: called after their step is launched, before it commits (the first read)."""
        pending = [state for state in requests if state.token_hashes is None]
        if not pending:
            return
        fields = [(s.user_id, s.payload.arrays.item_ids, s.payload.arrays.action_ids, s.payload.arrays.timestamps)
                  for s in pending]
        for state, token_hashes in zip(pending, self.hasher.many(fields), strict=True):
            state.token_hashes = token_hashes

    def _next_step_size(self, requests: Sequence[Any]) -> int:
        """An estimate of how many of ``requests`` (unvalidated) the next step admits when nothing else waits: at
        most ``max_num_seqs``, while their uncached history plus candidate rows fit the step's token budget."""
        budget, count = self._config.scheduler.max_num_batched_tokens, 0
        for request in requests[:self._config.scheduler.max_num_seqs]:
            if budget <= 0:
                break
            count += 1
            try:
                cached = self._kv.cached_tokens(request.user_id)
                rows = len(request.item_ids) - cached + len(request.candidate_item_ids)
            except (TypeError, AttributeError):  # malformed: validation will say why
                rows = 0
            budget -= max(rows, 1)
        return count
