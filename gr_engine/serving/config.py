"""``ServingConfig``: the online path's settings (the engine-core process, its client and the HTTP server)."""

from __future__ import annotations

import msgspec


class ServingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How the engine core batches and how much work the client admits (docs/serving.md).

    Attributes:
        max_batch_wait_ms: when the core is idle and fewer than ``scheduler.max_num_seqs`` requests are queued,
            wait at most this long (ms) for more before stepping; 0 steps at once. A request that arrives alone
            waits this long (docs/serving.md says what 1 ms measured).
        async_scheduling: launch each step before waiting for the one on the device, so that the host's work for it
            (taking in requests, scheduling, launching) overlaps the device's work (docs/serving.md says what it
            measured); off, the core waits for each step before taking in the next.
        max_pending_requests: most requests accepted and not yet answered; beyond it a request is refused as
            overloaded (HTTP 503) instead of queued.
        max_pending_tokens: most history events plus candidates of those requests (bounds their memory).
        max_queue_ms: refuse new requests as overloaded (HTTP 503) while one sent now would wait longer than this
            (ms) before a step takes it (the client's estimate, :meth:`~.client.AsyncGREngine.queue_wait_s`):
            a queue much deeper than a step keeps a user's visits apart by more users than the GPU tier holds, so
            cached history turns into onloads and throughput falls as the queue grows; 0 admits up to the two
            bounds above.
        max_body_bytes: largest HTTP request body accepted (HTTP 413 beyond it).
        max_reading_bytes: most bytes of HTTP request bodies one API server receives at once (a body counts from
            its first byte, or its declared ``Content-Length``, until it is whole): a body that would go over it is
            refused as overloaded (HTTP 503 with ``Retry-After``), so that many clients sending large bodies at once
            cannot exhaust the server's memory. At least ``max_body_bytes``.
        body_timeout_s: longest an HTTP request body may take to arrive (HTTP 408 beyond it): a client that stops
            sending mid-body and keeps its connection open would otherwise hold its handler, and a graceful
            shutdown, forever.
        heartbeat_s: the core reports its counters at least this often (s), stepping or idle.
        health_timeout_s: ``/health`` fails when the core has not reported for this long (s) after warm-up.
        warmup: compile and capture everything (:meth:`~gr_engine.GREngine.warmup`) before reporting ready.
        step_log: a file the core writes one JSON line per step to from warm-up's end (:mod:`.step_log`: step and
            idle time, requests, tokens, onloaded bytes, queue length, phase and garbage-collection seconds), the
            profile of the core under load; ``None`` writes none.
    """

    max_batch_wait_ms: float = 1.0
    async_scheduling: bool = True
    max_pending_requests: int = 4096
    max_pending_tokens: int = 64_000_000
    max_queue_ms: float = 50.0
    max_body_bytes: int = 64 * 2**20
    max_reading_bytes: int = 256 * 2**20
    body_timeout_s: float = 30.0
    heartbeat_s: float = 0.5
    health_timeout_s: float = 10.0
    warmup: bool = True
    step_log: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_wait_ms", "max_queue_ms", "heartbeat_s", "health_timeout_s", "body_timeout_s"):
            if not 0 <= getattr(self, name) < float("inf"):  # NaN fails too
                raise ValueError(f"serving.{name} must be a finite number >= 0, got {getattr(self, name)}")
        for name in ("max_pending_requests", "max_pending_tokens", "max_body_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"serving.{name} must be positive, got {getattr(self, name)}")
        if self.max_reading_bytes < self.max_body_bytes:  # else the largest bodies could never be received
            raise ValueError(f"serving.max_reading_bytes ({self.max_reading_bytes}) must be at least "
                             f"serving.max_body_bytes ({self.max_body_bytes})")
