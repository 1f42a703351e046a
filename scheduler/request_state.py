"""What the scheduler knows of a request, and what it hands to the model runner each step."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class RequestStatus(enum.IntEnum):
    """Where a request is: waiting to be scheduled, in running steps, finished with its output, or failed."""

    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    FAILED = 3


@dataclass(eq=False)
class RequestState:
    """One request's progress through the engine.

    Attributes:
        seq_id: arrival order (unique, increasing).
        user_id: whose history this is.
        num_history: history events ``n`` (one token each).
        num_candidates: candidate rows computed with the final chunk (0 for retrieval-only requests).
        reuse_limit: at most this many cached history tokens may be reused (``n`` or ``n - 1``).
        token_hashes: uint64 ``[n]`` page-prefix hashes of the history (cache validation); ``None`` until they are
            computed, for a request whose user has nothing cached: they are first read when its first step commits.
        payload: the engine's own data for the request (arrays, the original request).
        num_gpu_hits, num_host_hits: history tokens served from GPU pages, loaded from host chunks (at admission).
        num_done: history tokens whose K/V are in the user's pages.
        timings: seconds spent per engine phase on this request's steps.
        solo: run alone in its steps (it is being retried after a step failed).
    """

    seq_id: int
    user_id: Hashable
    num_history: int
    num_candidates: int
    reuse_limit: int
    token_hashes: np.ndarray | None
    payload: Any = None
    status: RequestStatus = RequestStatus.WAITING
    num_gpu_hits: int = 0
    num_host_hits: int = 0
    num_done: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    solo: bool = False

    @property
    def num_reused(self) -> int:
        """History tokens not recomputed."""
        return self.num_gpu_hits + self.num_host_hits


@dataclass
class ScheduledChunk:
    """One request's work in one step: history positions ``[start, end)`` and, if ``final``, its candidates."""

    request: RequestState
    start: int
    end: int
    final: bool

    @property
    def num_history_rows(self) -> int:
        """``end - start``."""
        return self.end - self.start

    @property
    def num_candidate_rows(self) -> int:
        """Candidates scored with this chunk: the request's, on its final chunk only."""
        return self.request.num_candidates if self.final else 0

    @property
    def num_tokens(self) -> int:
        """Rows this chunk adds to the step: history and candidates."""
        return self.num_history_rows + self.num_candidate_rows


@dataclass
class SchedulerOutput:
    """One step's plan.

    Attributes:
        chunks: the work of this step, one entry per request (at most one per user).
        admitted: requests that started this step (their cache hits were just decided).
        failed: requests that can never be served, with the reason; already removed.
    """

    chunks: list[ScheduledChunk]
    admitted: list[RequestState]
    failed: list[tuple[RequestState, str]]
