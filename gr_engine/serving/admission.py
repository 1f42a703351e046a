"""A client's admission (docs/serving.md): the requests it has sent to its engine core and not yet had answered, and
the bounds on them.

:class:`Admission` owns the pending requests (by their client-side ``core_id``) and their tokens (history events plus
candidates). A call is admitted whole or refused whole: :class:`CallTooLarge` when it exceeds the bounds by itself,
:class:`EngineOverloaded` when the requests already pending, or the core's queue (its estimated wait, from its latest
report plus what was sent since), leave no room for it. A call's deadline: :func:`deadline_after`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..request import GenerateRequest, RankRequest
from .config import ServingConfig
from .protocol import CoreStats


class EngineOverloaded(RuntimeError):
    """More work is pending than ``serving.max_pending_requests`` / ``max_pending_tokens`` allow, or the core's queue
    would hold a request longer than ``serving.max_queue_ms``: retry later. ``refused``: the call's requests that
    passed validation (the others got their own error outputs)."""

    def __init__(self, message: str, refused: int = 0) -> None:
        super().__init__(message)
        self.refused = refused


class CallTooLarge(ValueError):
    """One call holds more requests or tokens than ``serving.max_pending_requests`` / ``max_pending_tokens`` admit
    even with nothing pending: retrying cannot help, split the call. ``refused``: the call's requests that passed
    validation (the others got their own error outputs)."""

    def __init__(self, message: str, refused: int = 0) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass
class Pending:
    """A request sent to the core: its caller's future, the request, whether it ranks (else generates), its tokens
    and when it was sent (``time.monotonic()``, s)."""

    future: asyncio.Future
    request: RankRequest | GenerateRequest
    ranking: bool
    tokens: int
    sent_s: float


class Admission:
    """The pending requests of one client of an engine core, and its share of the bounds.

    Args:
        serving: the bounds (``max_pending_requests``, ``max_pending_tokens``, ``max_queue_ms``).
        share: how many clients share the core; each admits ``1/share`` of the request and token bounds (rounded
            down, at least 1).

    Attributes:
        max_requests, max_tokens: this client's bounds on pending requests and their tokens.
        max_queue_s: calls are refused while :meth:`queue_wait_s` is above it (s; 0: no bound).
        pending: the requests sent and not yet answered, by ``core_id``.
        tokens: their tokens.
    """

    def __init__(self, serving: ServingConfig, share: int = 1) -> None:
        self.max_requests = max(1, serving.max_pending_requests // share)
        self.max_tokens = max(1, serving.max_pending_tokens // share)
        self.max_queue_s = serving.max_queue_ms / 1000
        self.pending: dict[int, Pending] = {}
        self.tokens = 0
        self._sent_since_report = 0  # requests sent since the core's latest counters (not in their ``waiting``)

    def queue_wait_s(self, stats: CoreStats | None) -> float:
        """How long a request sent now would wait in the core before a step takes it (s): ``stats.waiting`` (the
        core's latest counters) plus what was sent since them, times their seconds per answered request; 0 before
        the first counters. Between two reports this client's own sends count at once."""
        if stats is None:
            return 0.0
        return (stats.waiting + self._sent_since_report) * stats.service_s

    def check(self, num_requests: int, tokens: int, stats: CoreStats | None) -> None:
        """Whether a call of ``num_requests`` valid requests holding ``tokens`` may be sent now (``stats``: the
        core's latest counters).

        Raises:
            CallTooLarge: the call exceeds the bounds by itself.
            EngineOverloaded: what is pending, or the core's queue, leaves no room for it.
        """
        if num_requests > self.max_requests or tokens > self.max_tokens:
            raise CallTooLarge(f"{num_requests} requests ({tokens} tokens) in one call: over this client's "
                               f"{self.max_requests} requests / {self.max_tokens} tokens even with nothing pending "
                               "(serving.max_pending_requests / max_pending_tokens): split the call", num_requests)
        if not num_requests:
            return
        if len(self.pending) + num_requests > self.max_requests or self.tokens + tokens > self.max_tokens:
            raise EngineOverloaded(f"{len(self.pending)} requests ({self.tokens} tokens) pending: over this client's "
                                   f"{self.max_requests} requests / {self.max_tokens} tokens "
                                   "(serving.max_pending_requests / max_pending_tokens)", num_requests)
        wait_s = self.queue_wait_s(stats)
        if self.max_queue_s and wait_s > self.max_queue_s:
            raise EngineOverloaded(f"the engine core's queue would hold a request ~{wait_s * 1e3:.0f} ms before a step "
                                   f"takes it: over serving.max_queue_ms ({self.max_queue_s * 1e3:g})", num_requests)

    def add(self, core_id: int, pending: Pending) -> None:
        """Count ``pending`` as sent (``core_id``: its client-side id)."""
        self.pending[core_id] = pending
        self.tokens += pending.tokens
        self._sent_since_report += 1

    def answered(self, core_id: int) -> Pending | None:
        """Release the request ``core_id`` that the core has answered: its :class:`Pending`, or ``None`` if it is not
        pending (already failed)."""
        pending = self.pending.pop(core_id, None)
        if pending is not None:
            self.tokens -= pending.tokens
        return pending

    def reported(self) -> None:
        """The core sent new counters: they hold every request sent before them."""
        self._sent_since_report = 0

    def fail_all(self, error: Exception) -> None:
        """Fail every pending request's caller with ``error`` and release them all."""
        for pending in self.pending.values():
            if not pending.future.done():
                pending.future.set_exception(error)
        self.pending.clear()
        self.tokens = 0


def deadline_after(now: float, timeout_ms: float | None) -> float | None:
    """The ``time.monotonic()`` deadline ``timeout_ms`` after ``now`` (s); ``None`` without one (``None`` or an
    infinite ``timeout_ms``). Raises ``ValueError`` for a ``timeout_ms`` that is not a number >= 0 (NaN, negative),
    before anything is sent."""
    if timeout_ms is None or timeout_ms == float("inf"):
        return None
    if not timeout_ms >= 0:  # NaN too
        raise ValueError(f"timeout_ms must be a number >= 0, got {timeout_ms}")
    return now + timeout_ms / 1000


def deadline_exceeded(timeout_ms: float) -> str:
    """The ``error`` of a request unfinished ``timeout_ms`` after its call (``-0.0`` reads as 0)."""
    return f"deadline exceeded ({timeout_ms + 0.0:g} ms)"
