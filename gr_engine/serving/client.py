"""``AsyncGREngine``: the asyncio client of an engine-core process (docs/serving.md).

The client validates each request's types, lengths and candidates (:mod:`gr_engine.validation`) in its own
process, sends it to the core as raw bytes, and resolves the caller's await when the core reports its output.
Admission is bounded (``serving.max_pending_requests`` and ``max_pending_tokens`` of requests sent and not yet
answered by the core): beyond it a call raises :class:`EngineOverloaded` at once. A call with ``timeout_ms`` returns,
for each request that has not finished by then, an output whose ``error`` says so (never a late answer), and the
core drops it if it has not started; a cancelled call's requests are dropped the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from ..config import EngineConfig
from ..outputs import GenerateOutput, RankOutput, output_user_id
from ..request import GenerateParams, GenerateRequest, RankRequest
from ..validation import RequestError, check_candidates, parse_fields
from .core import run_core_process
from .protocol import Abort, CoreOutput, CoreReport, CoreRequest, CoreStats, Shutdown, engine_output, to_core

logger = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """More work is pending than ``serving.max_pending_requests`` / ``max_pending_tokens`` allow: retry later."""


class EngineDead(RuntimeError):
    """The engine-core process is not running (it exited, or the client was closed)."""


#: Called with each answered request's output, its error kind (``None`` on success) and the core's queue seconds;
#: requests refused by validation in the client are answered too (kind ``"invalid"``).
OutputObserver = Callable[[RankOutput | GenerateOutput, str | None, float], None]
#: Called with each report's counters.
StatsObserver = Callable[[CoreStats], None]


@dataclass
class _Pending:
    future: asyncio.Future
    request: RankRequest | GenerateRequest
    ranking: bool
    tokens: int
    sent_s: float


class AsyncGREngine:
    """Serve requests through an engine-core process.

    Args:
        config: the engine's configuration (the core builds its engine from it; ``config.serving`` sets batching
            and admission).

    Use ``async with AsyncGREngine(config) as engine:`` (or :meth:`start` and :meth:`close`); :meth:`start` returns
    once the core has warmed up.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.serving = config.serving
        self.state = "stopped"  # "starting", "warming", "ready", "stopping", "stopped" or "dead"
        self.stats: CoreStats | None = None  # the core's latest counters
        self.observers: list[OutputObserver] = []
        self.stats_observers: list[StatsObserver] = []
        self.last_report_s = 0.0  # time.monotonic() of the core's latest report
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._pending_tokens = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreReport)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: asyncio.Task | None = None
        self._ready = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> AsyncGREngine:
        """Start the core process and wait until it has warmed up.

        Raises:
            EngineDead: the core exited before it was ready (its log says why).
        """
        self._dir = tempfile.TemporaryDirectory(prefix="gr-engine-")
        # Sends never wait (a plain socket, NOBLOCK; no high-water mark: admission bounds what is queued), so that a
        # dead core cannot stall a caller; receives are awaited.
        self._send_context, self._context = zmq.Context(), zmq.asyncio.Context()
        self._to_core = self._send_context.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        self._from_core = self._context.socket(zmq.PULL)
        to_address, from_address = f"ipc://{self._dir.name}/in", f"ipc://{self._dir.name}/out"
        self._to_core.bind(to_address)
        self._from_core.bind(from_address)
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_core_process, name="gr-engine-core", daemon=True,
            args=(msgspec.json.encode(self.config), to_address, from_address))
        self.state = "starting"
        self._process.start()
        self._reader = asyncio.create_task(self._read_reports())
        ready = asyncio.create_task(self._ready.wait())
        await asyncio.wait([ready, self._reader], return_when=asyncio.FIRST_COMPLETED)
        if not self._ready.is_set():
            ready.cancel()
            code = self._process.exitcode
            await self.close()
            raise EngineDead(f"the engine core exited before it was ready (exit code {code})")
        return self

    async def close(self, timeout_s: float = 60.0) -> None:
        """Let the core finish every accepted request and its pending offloads, then stop it (a core that takes
        longer than ``timeout_s`` is killed)."""
        if self._process is None:
            return
        if self._process.is_alive() and self.state not in ("dead", "stopped"):
            self.state = "stopping"
            with contextlib.suppress(EngineDead):
                self._send(Shutdown())
            if self._reader is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(self._reader), timeout_s)
                except asyncio.TimeoutError:
                    logger.error("the engine core did not stop within %.0f s: killing it", timeout_s)
        if self._reader is not None:
            self._reader.cancel()
        await asyncio.to_thread(self._process.join, 5)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join)
        self._fail_all(EngineDead("the engine was closed"))
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._context.term()
        self._send_context.term()
        self._dir.cleanup()
        self._process = None
        if self.state != "dead":
            self.state = "stopped"

    async def __aenter__(self) -> AsyncGREngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def core_pid(self) -> int | None:
        """The engine-core process's id (``None`` when not started)."""
        return self._process.pid if self._process is not None else None

    def is_healthy(self) -> bool:
        """Whether the core process is alive and, once ready, has reported within ``serving.health_timeout_s``."""
        if self._process is None or not self._process.is_alive() or self.state in ("dead", "stopped"):
            return False
        return self.state != "ready" or time.monotonic() - self.last_report_s < self.serving.health_timeout_s

    @property
    def num_pending(self) -> int:
        """Requests sent to the core and not yet answered by it."""
        return len(self._pending)

    # ------------------------------------------------------------------ requests
    async def rank(self, request: RankRequest, timeout_ms: float | None = None) -> RankOutput:
        """Score one request's candidates (as :meth:`~gr_engine.GREngine.rank`); see :meth:`rank_many`."""
        return (await self.rank_many([request], timeout_ms))[0]

    async def generate(self, request: GenerateRequest, params: GenerateParams | None = None,
                       timeout_ms: float | None = None) -> GenerateOutput:
        """Retrieve items for one request (as :meth:`~gr_engine.GREngine.generate`); see :meth:`rank_many`."""
        return (await self.generate_many([request], params, timeout_ms))[0]

    async def rank_many(self, requests: Sequence[RankRequest], timeout_ms: float | None = None) -> list[RankOutput]:
        """Score several requests; outputs in input order, a bad request's output carries its ``error``.

        Args:
            requests: the requests (admitted together or not at all).
            timeout_ms: a request unfinished this many ms after the call gets a ``deadline exceeded`` error.

        Raises:
            EngineOverloaded: admitting them would exceed the pending bounds.
            EngineDead: the core is not running.
        """
        return await self._submit(requests, None, timeout_ms)

    async def generate_many(self, requests: Sequence[GenerateRequest], params: GenerateParams | None = None,
                            timeout_ms: float | None = None) -> list[GenerateOutput]:
        """Retrieve items for several requests; as :meth:`rank_many`."""
        return await self._submit(requests, params or GenerateParams(), timeout_ms)

    async def _submit(self, requests: Sequence[RankRequest | GenerateRequest], params: GenerateParams | None,
                      timeout_ms: float | None) -> list:
        if self.state == "ready" and not self._process.is_alive():
            self._core_died()
        if self.state != "ready":
            raise EngineDead(f"the engine is {self.state}, not serving")
        ranking = params is None
        failed_type = RankOutput if ranking else GenerateOutput
        now = time.monotonic()
        deadline = now + timeout_ms / 1000 if timeout_ms is not None else None
        results: list = [None] * len(requests)
        messages, waits = [], {}
        tokens = 0
        for i, request in enumerate(requests):
            try:
                arrays = parse_fields(request, self.config, ranking=ranking)
                check_candidates(arrays, self.config)
            except RequestError as exc:
                results[i] = failed_type(request_id=str(getattr(request, "request_id", "")), error=str(exc),
                                         user_id=output_user_id(getattr(request, "user_id", None)))
                for observe in self.observers:
                    observe(results[i], "invalid", 0.0)
                continue
            size = arrays.num_history + len(arrays.candidate_item_ids)
            core_id = next(self._ids)
            messages.append((core_id, to_core(core_id, request, arrays, params, deadline), request, size))
            tokens += size
            waits[core_id] = i
        if messages and (len(self._pending) + len(messages) > self.serving.max_pending_requests
                         or self._pending_tokens + tokens > self.serving.max_pending_tokens):
            raise EngineOverloaded(f"{len(self._pending)} requests ({self._pending_tokens} tokens) pending: "
                                   "over serving.max_pending_requests / max_pending_tokens")
        loop = asyncio.get_running_loop()
        futures = {}
        for core_id, message, request, size in messages:
            future = loop.create_future()
            self._pending[core_id] = _Pending(future, request, ranking, size, now)
            self._pending_tokens += size
            futures[future] = core_id
            self._send(message)
        try:
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            done, late = await asyncio.wait(futures, timeout=timeout) if futures else (set(), set())
        except asyncio.CancelledError:
            self._abort([c for f, c in futures.items() if not f.done()], "cancelled by the caller", "cancelled")
            raise
        for future in done:
            results[waits[futures[future]]] = future.result()
        if late:
            self._abort([futures[f] for f in late], f"deadline exceeded ({timeout_ms:g} ms)", "timeout")
            for future in late:
                request = requests[waits[futures[future]]]
                results[waits[futures[future]]] = failed_type(
                    request_id=request.request_id, user_id=request.user_id,
                    error=f"deadline exceeded ({timeout_ms:g} ms)", latency_s=time.monotonic() - now)
        return results

    def _abort(self, core_ids: list[int], reason: str, kind: str) -> None:
        """Tell the core to drop these requests if they have not started; their outputs are no longer awaited
        (the core's answer for them still releases their admission)."""
        for core_id in core_ids:
            pending = self._pending.get(core_id)
            if pending is not None and not pending.future.done():
                pending.future.cancel()
        if core_ids and self._process is not None and self.state != "dead":
            with contextlib.suppress(EngineDead):  # then nothing is pending any more
                self._send(Abort(core_ids=core_ids, reason=reason, kind=kind))

    def _send(self, message: CoreRequest | Abort | Shutdown) -> None:
        """Queue a message for the core; with no core connected (it died), fail every pending call instead."""
        try:
            self._to_core.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self._core_died()
            raise EngineDead("the engine core is not running") from None

    # ------------------------------------------------------------------ reports
    async def _read_reports(self) -> None:
        """Deliver the core's outputs; notice when the core dies (every pending call then fails)."""
        while True:
            if not await self._from_core.poll(500):
                if not self._process.is_alive():
                    self._core_died()
                    return
                continue
            report = self._decoder.decode(await self._from_core.recv())
            self.last_report_s = time.monotonic()
            if report.stats is not None:
                self.stats = report.stats
                for observe_stats in self.stats_observers:
                    observe_stats(report.stats)
            for message in report.outputs:
                self._deliver(message)
            if report.state == "stopped":
                self.state = "stopped"
                return
            if self.state in ("starting", "warming"):
                self.state = report.state
                if report.state == "ready":
                    self._ready.set()

    def _deliver(self, message: CoreOutput) -> None:
        pending = self._pending.pop(message.core_id, None)
        if pending is None:
            return
        self._pending_tokens -= pending.tokens
        output = engine_output(message, pending.request, pending.ranking, time.monotonic() - pending.sent_s)
        for observe in self.observers:
            observe(output, message.error_kind, message.queue_s)
        if not pending.future.done():
            pending.future.set_result(output)

    def _core_died(self) -> None:
        code = self._process.exitcode if self._process is not None else None
        logger.error("the engine core exited (exit code %s); failing %d pending requests", code, len(self._pending))
        self.state = "dead"
        self._fail_all(EngineDead(f"the engine core exited (exit code {code})"))

    def _fail_all(self, error: Exception) -> None:
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(error)
        self._pending.clear()
        self._pending_tokens = 0
