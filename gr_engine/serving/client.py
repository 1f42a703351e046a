"""``AsyncGREngine``: the asyncio client of an engine-core process (docs/serving.md).

The client validates each request's types, lengths and candidates (:mod:`gr_engine.validation`) in its own
process, sends it to the core as raw bytes, and resolves the caller's await when the core reports its output.
Admission is bounded (:mod:`.admission`: ``serving.max_pending_requests`` and ``max_pending_tokens`` of requests
sent and not yet answered by the core, split evenly among the clients of a shared core), and so is the core's queue
(``serving.max_queue_ms`` of estimated wait, from the core's latest report): beyond either a call raises
:class:`~.admission.EngineOverloaded` at once. A client starts a core of its own, or attaches to a running one
(:class:`CoreHandle`, as each API server of ``gr-engine serve --api-servers N`` does). A call with ``timeout_ms``
returns, for each request that has not finished by then, an output whose ``error`` says so (never a late answer),
and the core drops it if it has not started; a cancelled call's requests are dropped the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ..config import EngineConfig
from ..intake import request_labels
from ..outputs import GenerateOutput, RankOutput
from ..request import GenerateParams, GenerateRequest, RankRequest
from ..validation import RequestError, check_candidates, check_params, parse_fields
from .admission import Admission, Pending, deadline_after, deadline_exceeded
from .core import start_core
from .process_watch import ProcessWatch
from .protocol import Abort, CoreOutput, CoreReport, CoreRequest, CoreStats, Hello, Shutdown, engine_output, to_core

logger = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    """The engine-core process is not running (it exited, or the client was closed). ``refused``: the call's requests
    it left unanswered when the core died during the call (those that failed validation, or were answered, got their
    outputs); ``None``: the call's every request (it was refused before any was looked at)."""

    def __init__(self, message: str, refused: int | None = None) -> None:
        super().__init__(message)
        self.refused = refused


def reported_state(engine: Any) -> str:
    """What ``/health`` and replica listings say of ``engine`` (anything with ``state`` and ``is_healthy()``): its
    ``state``, or ``"unresponsive"`` for a ready one that is not healthy (silent past ``serving.health_timeout_s``)."""
    return "unresponsive" if engine.state == "ready" and not engine.is_healthy() else engine.state


#: Called with each answered request's output, its error kind (``None`` on success) and the core's queue seconds;
#: requests refused by validation in the client are answered too (kind ``"invalid"``).
OutputObserver = Callable[[RankOutput | GenerateOutput, str | None, float], None]


@dataclass(frozen=True)
class CoreHandle:
    """A running engine core for an :class:`AsyncGREngine` to attach to (``gr-engine serve --api-servers N``
    starts one for N API-server processes: :mod:`.launcher`).

    Attributes:
        address: the core's input socket (``ipc://...``, :func:`~.core.start_core`'s ``address``).
        pid: the core's process id: the client watches it, and a core that exits fails every pending call.
        clients: how many clients share the core (its ``clients``); each admits ``1/clients`` of
            ``serving.max_pending_requests`` and ``serving.max_pending_tokens`` (rounded down, at least 1).
    """

    address: str
    pid: int
    clients: int = 1


class AsyncGREngine:
    """Serve requests through an engine-core process.

    Args:
        config: the engine's configuration (the core builds its engine from it; ``config.serving`` sets batching
            and admission).
        core: attach to this running core (shared with other clients) instead of starting one of its own.

    Use ``async with AsyncGREngine(config) as engine:`` (or :meth:`start` and :meth:`close`); :meth:`start` returns
    once the core has warmed up. Without ``core``, :meth:`start` starts a core process for this client alone and
    :meth:`close` stops it; with ``core``, :meth:`close` only leaves it (the core stops once all its clients have).
    """

    def __init__(self, config: EngineConfig, core: CoreHandle | None = None) -> None:
        self.config = config
        self.serving = config.serving
        self.state = "stopped"  # "starting", "warming", "ready", "stopping", "stopped" or "dead"
        self.stats: CoreStats | None = None  # the core's latest counters
        self.observers: list[OutputObserver] = []
        self.last_report_s = 0.0  # time.monotonic() of the core's latest report
        self.admission = Admission(self.serving, core.clients if core is not None else 1)  # its pending requests
        self._handle = core
        self._ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreReport)
        self._process: multiprocessing.process.BaseProcess | None = None  # the core, when this client started it
        self._watch: ProcessWatch | None = None  # the core, when attached
        self._to_core: zmq.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._ready: asyncio.Event | None = None  # set once the core is ready (a new one each start)
        self._closing: asyncio.Future | None = None  # set while (and after) close() runs: concurrent calls wait

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> AsyncGREngine:
        """Start the core process (or attach to ``core``) and wait until it has warmed up.

        Raises:
            EngineDead: the core exited before it was ready (its log says why).
            RuntimeError: the client is started already (:meth:`close` it first; it may start again then).
        """
        if self._to_core is not None:
            raise RuntimeError(f"the engine client is {self.state}: close() it before starting it again")
        self._closing = None
        self._ready = asyncio.Event()  # (not the last start's: set, and maybe bound to another event loop)
        if self._handle is not None:
            try:
                self._watch = ProcessWatch(self._handle.pid)
            except ProcessLookupError:
                raise EngineDead(f"no engine core runs as process {self._handle.pid}") from None
        self._dir = tempfile.TemporaryDirectory(prefix="gr-engine-")
        if self._handle is None:
            address = f"ipc://{self._dir.name}/core"
            self._process = start_core(self.config, address)
        else:
            address = self._handle.address
        # Sends never wait (a plain socket, NOBLOCK; no high-water mark: admission bounds what is queued, and a core
        # that has exited fails every call once noticed); receives are awaited.
        self._send_context, self._context = zmq.Context(), zmq.asyncio.Context()
        self._to_core = self._send_context.socket(zmq.DEALER)
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        self._to_core.connect(address)
        self._from_core = self._context.socket(zmq.PULL)
        reports = f"ipc://{self._dir.name}/reports"
        self._from_core.bind(reports)
        self.state = "starting"
        self._send(Hello(address=reports))
        self._reader = asyncio.create_task(self._read_reports())
        ready = asyncio.create_task(self._ready.wait())
        await asyncio.wait([ready, self._reader], return_when=asyncio.FIRST_COMPLETED)
        if not self._ready.is_set():
            ready.cancel()
            status = self._exit_status()
            await self.close()
            raise EngineDead(f"the engine core exited before it was ready ({status})")
        return self

    async def close(self, timeout_s: float = 60.0) -> None:
        """Let the core answer every accepted request, then leave it; a core this client started then completes its
        pending offloads and stops (one that takes longer than ``timeout_s`` is killed)."""
        if self._closing is not None:  # a close already under way (or done): wait for it
            await asyncio.shield(self._closing)
            return
        if self._to_core is None:
            return
        self._closing = asyncio.get_running_loop().create_future()
        try:
            await self._close(timeout_s)
        finally:
            self._closing.set_result(None)

    async def _close(self, timeout_s: float) -> None:
        if self._core_alive() and self.state not in ("dead", "stopped"):
            self.state = "stopping"
            self._send(Shutdown())
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), timeout_s)
            except asyncio.TimeoutError:
                logger.error("the engine core did not answer within %.0f s", timeout_s)
        self._reader.cancel()
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 5)
            if self._process.is_alive():
                logger.error("killing the engine core")
                self._process.kill()
                await asyncio.to_thread(self._process.join)
        self.admission.fail_all(EngineDead("the engine was closed"))
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._context.term()
        self._send_context.term()
        if self._watch is not None:
            self._watch.close()
        self._dir.cleanup()
        self._to_core = self._process = self._watch = None
        if self.state != "dead":
            self.state = "stopped"

    async def __aenter__(self) -> AsyncGREngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def core_pid(self) -> int | None:
        """The engine-core process's id (``None`` when not started)."""
        if self._process is not None:
            return self._process.pid
        return self._watch.pid if self._watch is not None else None

    def _core_alive(self) -> bool:
        if self._process is not None:
            return self._process.is_alive()
        return self._watch is not None and self._watch.alive()

    def _exit_status(self) -> str:
        if self._process is not None:
            return f"exit code {self._process.exitcode}"
        return f"pid {self.core_pid}"

    def is_alive(self) -> bool:
        """Whether the core process runs and has not been found dead or stopped (a stalled core counts as alive)."""
        return self._core_alive() and self.state not in ("dead", "stopped")

    def is_healthy(self) -> bool:
        """Whether the core process is alive and, once ready, has reported within ``serving.health_timeout_s``."""
        if not self._core_alive() or self.state in ("dead", "stopped"):
            return False
        return self.state != "ready" or time.monotonic() - self.last_report_s < self.serving.health_timeout_s

    @property
    def num_pending(self) -> int:
        """Requests sent to the core and not yet answered by it."""
        return len(self.admission.pending)

    # ------------------------------------------------------------------ requests
    def queue_wait_s(self) -> float:
        """How long a request sent now would wait in the core before a step takes it (s; calls are refused while it
        is over ``serving.max_queue_ms``): :meth:`.admission.Admission.queue_wait_s` of the core's latest counters."""
        return self.admission.queue_wait_s(self.stats)

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
            timeout_ms: a request unfinished this many ms after the call gets a ``deadline exceeded`` error
                (>= 0; ``None`` or infinite: none).

        Raises:
            EngineOverloaded: admitting them would exceed the pending bounds.
            CallTooLarge: they exceed the pending bounds by themselves.
            EngineDead: the core is not running.
            ValueError: ``timeout_ms`` is NaN or negative (nothing is sent).
        """
        return await self._submit(requests, None, timeout_ms)

    async def generate_many(self, requests: Sequence[GenerateRequest], params: GenerateParams | None = None,
                            timeout_ms: float | None = None) -> list[GenerateOutput]:
        """Retrieve items for several requests; as :meth:`rank_many`."""
        return await self._submit(requests, params or GenerateParams(), timeout_ms)

    async def _submit(self, requests: Sequence[RankRequest | GenerateRequest], params: GenerateParams | None,
                      timeout_ms: float | None) -> list:
        if self.state == "ready" and not self._core_alive():
            self._core_died()
        if self.state != "ready":
            raise EngineDead(f"the engine is {self.state}, not serving")
        ranking = params is None
        failed_type = RankOutput if ranking else GenerateOutput
        now = time.monotonic()
        deadline = deadline_after(now, timeout_ms)
        results: list = [None] * len(requests)
        messages, waits = [], {}
        tokens = 0
        try:  # once a call (the core could not decode a GenerateParams changed in Python: top_k=1.5)
            check_params(params)
            bad_params = None
        except RequestError as exc:
            bad_params = exc  # each request fails with it, as GREngine's do
        for i, request in enumerate(requests):
            try:
                if bad_params is not None:
                    raise bad_params
                arrays = parse_fields(request, self.config, ranking=ranking)
                check_candidates(arrays, self.config)
            except RequestError as exc:
                request_id, user_id = request_labels(request)
                results[i] = failed_type(request_id=request_id, user_id=user_id, error=str(exc))
                for observe in self.observers:
                    observe(results[i], "invalid", 0.0)
                continue
            size = arrays.num_history + len(arrays.candidate_item_ids)
            core_id = next(self._ids)
            messages.append((core_id, to_core(core_id, request, arrays, params, deadline), request, size))
            tokens += size
            waits[core_id] = i
        self.admission.check(len(messages), tokens, self.stats)
        loop = asyncio.get_running_loop()
        futures = {}
        for core_id, message, request, size in messages:
            future = loop.create_future()
            self.admission.add(core_id, Pending(future, request, ranking, size, now))
            futures[future] = core_id
            self._send(message)
        try:
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            done, late = await asyncio.wait(futures, timeout=timeout) if futures else (set(), set())
        except asyncio.CancelledError:
            self._abort([c for f, c in futures.items() if not f.done()], "cancelled by the caller", "cancelled")
            raise
        failed = [future.exception() for future in done if future.exception() is not None]  # each one retrieved
        if failed:
            if isinstance(failed[0], EngineDead):  # one instance fails every pending call: this call's count
                raise EngineDead(str(failed[0]), refused=len(failed)) from failed[0]
            raise failed[0]
        for future in done:
            results[waits[futures[future]]] = future.result()
        if late:
            self._abort([futures[f] for f in late], deadline_exceeded(timeout_ms), "timeout")
            for future in late:
                request = requests[waits[futures[future]]]
                results[waits[futures[future]]] = failed_type(
                    request_id=request.request_id, user_id=request.user_id,
                    error=deadline_exceeded(timeout_ms), latency_s=time.monotonic() - now)
        return results

    def _abort(self, core_ids: list[int], reason: str, kind: str) -> None:
        """Tell the core to drop these requests if they have not started; their outputs are no longer awaited
        (the core's answer for them still releases their admission). The observers see each as the caller does:
        its error ``reason``, of kind ``kind``, now (not the core's later answer)."""
        for core_id in core_ids:
            pending = self.admission.pending.get(core_id)
            if pending is not None and not pending.future.done():
                pending.future.cancel()
                failed_type = RankOutput if pending.ranking else GenerateOutput
                output = failed_type(request_id=pending.request.request_id, user_id=pending.request.user_id,
                                     error=reason, latency_s=time.monotonic() - pending.sent_s)
                for observe in self.observers:
                    observe(output, kind, 0.0)
        if core_ids and self._to_core is not None and self.state != "dead":
            self._send(Abort(core_ids=core_ids, reason=reason, kind=kind))

    def _send(self, message: Hello | CoreRequest | Abort | Shutdown) -> None:
        """Queue a message for the core (never waits: the socket's queue has no bound)."""
        self._to_core.send(self._encoder.encode(message), zmq.NOBLOCK)

    # ------------------------------------------------------------------ reports
    async def _read_reports(self) -> None:
        """Deliver the core's outputs; notice when the core dies (every pending call then fails)."""
        while True:
            if not await self._from_core.poll(500):
                if not self._core_alive():
                    self._core_died()
                    return
                continue
            report = self._decoder.decode(await self._from_core.recv())
            self.last_report_s = time.monotonic()
            if report.stats is not None:
                self.stats = report.stats
                self.admission.reported()
            for message in report.outputs:
                self._deliver(message)
            if report.state == "stopped":  # after a Shutdown nothing is pending; after its parent died, maybe
                self.state = "stopped"
                self.admission.fail_all(EngineDead("the engine core stopped before answering"))
                return
            if self.state in ("starting", "warming"):
                self.state = report.state
                if report.state == "ready":
                    self._ready.set()

    def _deliver(self, message: CoreOutput) -> None:
        pending = self.admission.answered(message.core_id)
        if pending is None:
            return
        if pending.future.cancelled():  # the caller gave up on it: observed then (_abort)
            return
        output = engine_output(message, pending.request, pending.ranking, time.monotonic() - pending.sent_s)
        for observe in self.observers:
            observe(output, message.error_kind, message.queue_s)
        if not pending.future.done():
            pending.future.set_result(output)

    def _core_died(self) -> None:
        status = self._exit_status()
        logger.error("the engine core exited (%s); failing %d pending requests", status, self.num_pending)
        self.state = "dead"
        self.admission.fail_all(EngineDead(f"the engine core exited ({status})"))
