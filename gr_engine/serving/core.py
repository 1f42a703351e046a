"""``EngineCore``: the engine in its own process, stepping while work is queued (docs/serving.md).

The core owns a :class:`~gr_engine.GREngine`. It binds a ZeroMQ ROUTER socket that any number of clients (one per
API-server process) connect to; each says :class:`~.protocol.Hello` with the address of its own PULL socket, and the
core connects a PUSH socket there. After every step that finished requests, and at least every
``serving.heartbeat_s`` otherwise, every client gets a :class:`~.protocol.CoreReport`: its own outputs and the
core's counters. Each step batches whatever has arrived before it began. A request past its deadline, or aborted by
the client, is dropped if it has not started; one that has started finishes (the client discards a late answer).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import signal
import time
from dataclasses import asdict, dataclass, field

import msgspec
import zmq

from ..config import EngineConfig
from ..engine import GREngine, LaunchedStep, Output
from ..outputs import StepTimings
from .heap import freeze_heap
from .protocol import (
    CACHE_COUNTERS,
    STEP_BUCKETS,
    Abort,
    CoreInput,
    CoreOutput,
    CoreReport,
    CoreRequest,
    CoreStats,
    Hello,
    Shutdown,
    from_core,
    output_message,
)
from .step_log import StepLog

logger = logging.getLogger(__name__)

_STEP_FAILED = "engine step failed"  # how GREngine's errors for failed steps begin
_CONNECT_TIMEOUT_MS = 10_000  # a client whose report socket cannot be reached this long after its Hello is gone
#: The queue-wait estimate (:attr:`~.protocol.CoreStats.queue_wait_s`) weighs about this many recent answering steps:
#: enough to smooth one slow step, few enough to follow a change of load within a fraction of a second.
SERVICE_STEPS = 32


@dataclass(eq=False)
class _Launch:
    """A step the core launched: the engine's handle, when it began (monotonic s), the host seconds its launch took,
    the engine's step count before it, and whether the step before it was still unfinished (async scheduling)."""

    step: LaunchedStep
    start: float
    seconds: float
    steps: int
    overlapped: bool


@dataclass(eq=False)
class _Client:
    """One connected client: its report socket, its outputs not yet sent, its requests in the engine."""

    identity: bytes  # its input connection's ZeroMQ identity
    number: int  # the core's name for it: its requests are "<number>.<core_id>" in the engine
    socket: zmq.Socket  # PUSH, connected to the client's PULL
    outputs: list[CoreOutput] = field(default_factory=list)
    in_engine: int = 0  # requests queued or running
    leaving: bool = False  # it sent Shutdown
    reached: bool = False  # a report has been delivered (the first one waits for the connection)


class EngineCore:
    """The stepping loop over one engine, its input socket and one report socket per client.

    Args:
        engine: the engine (its requests come only through this core; ``engine.config.serving`` sets batching and
            reporting).
        inputs: a ROUTER socket delivering ``[client identity, CoreInput]`` messages (:data:`~.protocol.CoreInput`).
        context: the ZeroMQ context for the clients' report sockets.
        clients: how many clients the core serves; it stops once that many have left (or are gone).
    """

    def __init__(self, engine: GREngine, inputs: zmq.Socket, context: zmq.Context, clients: int = 1) -> None:
        self.engine = engine
        self.serving = engine.config.serving
        self._inputs, self._context, self._expected = inputs, context, clients
        self._decoder = msgspec.msgpack.Decoder(CoreInput)
        self._encoder = msgspec.msgpack.Encoder()
        self._clients: dict[bytes, _Client] = {}  # by ZeroMQ identity
        self._owners: dict[str, tuple[_Client, int]] = {}  # engine request id -> (client, its core_id)
        self._deadlines: dict[str, float] = {}  # engine request id -> deadline of queued requests that have one
        self._departed = 0  # clients that left or are gone
        self._numbers = itertools.count()
        self._state = "warming"  # then "ready", then "stopped"
        self._steps, self._step_seconds = 0, 0.0
        self._step_buckets = [0] * len(STEP_BUCKETS)
        self._last_report = 0.0
        self._batch_opened = 0.0  # when the first request of an idle engine arrived (0 once a step has run)
        self._busy_from = 0.0  # since when the wall time of the next answering step's requests counts
        self._served_s, self._served = 0.0, 0.0  # decayed sums: busy wall seconds, requests answered
        self._log: StepLog | None = None  # the step log (serving.step_log), open from warm-up's end
        self._launched: _Launch | None = None  # the step on the device, not yet finished

    def run(self) -> None:
        """Warm up, then step until every client has left and every request is answered; then let pending
        transfers finish and report ``"stopped"``."""
        self._receive(0)
        self._report()  # "warming", to the clients that said hello already
        if self.serving.warmup:
            self.engine.warmup(use_tqdm=False)
        frozen, full_s = freeze_heap()
        logger.info("engine core: %d objects frozen out of garbage collection (a full collection took %.1f ms)",
                    frozen, full_s * 1e3)
        if self.serving.step_log:
            self._log = StepLog(self.serving.step_log)
            self._log.header(frozen, full_s)
        self._state = "ready"
        self._report()
        try:
            self._serve()
        finally:
            if self._log is not None:
                self._log.close()
        self.engine.close()
        self._state = "stopped"
        self._report()

    def _serve(self) -> None:
        parent = os.getppid()
        engine = self.engine
        while not (self._finishing() and not engine.has_unfinished_requests()):
            self._receive(0 if engine.has_unfinished_requests() else self.serving.heartbeat_s)
            if self._departed >= self._expected or os.getppid() != parent:
                logger.error("engine core: the client processes are gone; stopping")
                break
            if self._launched is None:
                self._wait_for_batch()
            self._expire()
            # Async scheduling: the next step is launched before the one on the device is waited for, so the host's
            # work for it (intake above, scheduling, launching) overlaps the device's.
            launched = self._launch() if engine.scheduler.num_unfinished else None
            if self._launched is not None:
                self._finish(self._launched)
            self._launched = launched
            if launched is not None and not self.serving.async_scheduling:
                self._finish(launched)
                self._launched = None
            self._release()
            if any(c.outputs for c in self._clients.values()) or \
                    time.monotonic() - self._last_report >= self.serving.heartbeat_s:
                self._report()

    def _launch(self) -> _Launch:
        """Launch one engine step (:meth:`~gr_engine.GREngine.launch_step`)."""
        start, t0, steps = time.monotonic(), time.perf_counter(), self.engine.stats.num_steps
        step = self.engine.launch_step()
        return _Launch(step, start, time.perf_counter() - t0, steps, self._launched is not None)

    def _finish(self, launch: _Launch) -> None:
        """Wait for a launched step; count and log it, and file its outputs for their clients."""
        t0 = time.perf_counter()
        outputs = self.engine.finish_step(launch.step)
        seconds = launch.seconds + time.perf_counter() - t0
        self._count_step(seconds)
        self._count_service(len(outputs))
        self._batch_opened = 0.0  # what a step left queued runs next without waiting for a fuller batch
        if self._log is not None:
            stats = self.engine.stats
            self._log.step(launch.start, seconds, stats.recent_steps[-1] if stats.num_steps > launch.steps else None,
                           self.engine.num_waiting, launch.overlapped)
        for output in outputs:
            kind = None
            if output.error is not None:
                kind = "engine" if output.error.startswith(_STEP_FAILED) else "unservable"
            self._answer(output, kind)

    def _finishing(self) -> bool:
        """Whether every client the core serves has left or is leaving."""
        return self._departed + sum(c.leaving for c in self._clients.values()) >= self._expected

    # ------------------------------------------------------------------ intake
    def _receive(self, timeout_s: float) -> None:
        """Take in every message that has arrived, waiting up to ``timeout_s`` for the first one."""
        if not self._inputs.poll(int(timeout_s * 1000)):
            return
        requests: list[tuple[_Client, CoreRequest]] = []
        while True:
            try:
                identity, *body = self._inputs.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:  # a client sends one frame, a message of this version; anything else has nobody to answer
                if len(body) != 1:
                    raise msgspec.DecodeError(f"{len(body)} frames, not 1")
                message = self._decoder.decode(body[0].buffer)
            except msgspec.DecodeError as error:
                logger.error("engine core: an undecodable message dropped: %s", error)
                continue
            if isinstance(message, Hello):
                self._join(identity.bytes, message.address)
                continue
            client = self._clients.get(identity.bytes)
            if client is None:  # a client that has been dropped: nobody to answer
                continue
            if isinstance(message, CoreRequest):
                requests.append((client, message))
            elif isinstance(message, Abort):
                self._add(requests)
                requests = []
                self._abort([f"{client.number}.{c}" for c in message.core_ids], message.reason, message.kind)
            elif isinstance(message, Shutdown):
                client.leaving = True
        self._add(requests)

    def _join(self, identity: bytes, address: str) -> None:
        """A new client: connect to its report socket and tell it the core's state."""
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)  # admission in the client bounds what is queued
        socket.setsockopt(zmq.IMMEDIATE, 1)  # a client that is gone refuses sends instead of queueing them
        socket.connect(address)
        client = _Client(identity, next(self._numbers), socket)
        self._clients[identity] = client
        self._send(client, CoreReport(outputs=[], stats=self._stats(), state=self._state))

    def _add(self, messages: list[tuple[_Client, CoreRequest]]) -> None:
        """Validate and queue requests, runs of the same kind and parameters together (one intake pass each)."""
        if not messages:
            return
        if not self.engine.has_unfinished_requests():
            self._batch_opened = self._busy_from = time.monotonic()
        start = 0
        for end in range(1, len(messages) + 1):
            if end < len(messages) and _kind(messages[end][1]) == _kind(messages[start][1]):
                continue
            run = messages[start:end]
            names = [f"{client.number}.{message.core_id}" for client, message in run]
            added = self.engine.add_requests([from_core(m, n) for (_, m), n in zip(run, names)], run[0][1].params)
            for (client, message), name, result in zip(run, names, added, strict=True):
                if isinstance(result, Exception):
                    client.outputs.append(_failed(message.core_id, str(result), "invalid"))
                    continue
                self._owners[name] = (client, message.core_id)
                client.in_engine += 1
                if message.deadline is not None:
                    self._deadlines[name] = message.deadline
            start = end

    def _wait_for_batch(self) -> None:
        """With ``max_batch_wait_ms``, let a batch that is not full gather arrivals before an idle engine's first step
        (the requests a step leaves queued, e.g. a user's second, run at once)."""
        wait_s = self.serving.max_batch_wait_ms / 1000
        if wait_s <= 0 or self.engine.scheduler.running:
            return
        full = self.engine.config.scheduler.max_num_seqs
        while self.engine.scheduler.num_unfinished < full and not self._finishing():
            remaining = self._batch_opened + wait_s - time.monotonic()
            if remaining <= 0:
                return
            self._receive(remaining)

    def _expire(self) -> None:
        """Drop queued requests whose deadline has passed."""
        if not self._deadlines:
            return
        now = time.monotonic()
        late = [name for name, deadline in self._deadlines.items() if deadline <= now]
        if late:
            self._abort(late, "deadline exceeded before the request started", "timeout")

    def _abort(self, names: list[str], reason: str, kind: str) -> None:
        for output in self.engine.abort_waiting(names, reason):
            self._answer(output, kind)

    # ------------------------------------------------------------------ outputs
    def _answer(self, output: Output, kind: str | None) -> None:
        """File a finished request's output for its client (dropped if the client is gone)."""
        self._deadlines.pop(output.request_id, None)
        client, core_id = self._owners.pop(output.request_id)
        client.in_engine -= 1
        client.outputs.append(output_message(core_id, output, kind))

    def _count_step(self, seconds: float) -> None:
        self._steps += 1
        self._step_seconds += seconds
        for i, bound in enumerate(STEP_BUCKETS):
            self._step_buckets[i] += seconds <= bound

    def _count_service(self, answered: int) -> None:
        """Add the busy wall time since the last answering step (or since an idle engine took requests) to the
        queue-wait estimate, with the ``answered`` requests it served."""
        if not answered:
            return  # a step that answered nothing (a long history's first chunks): its time counts with the next
        now, decay = time.monotonic(), 1 - 1 / SERVICE_STEPS
        self._served_s = self._served_s * decay + (now - self._busy_from)
        self._served = self._served * decay + answered
        self._busy_from = now

    def _release(self) -> None:
        """Report ``"stopped"`` to each leaving client whose requests are all answered, except the last client
        (it hears after the engine has closed)."""
        for client in [c for c in self._clients.values() if c.leaving and not c.in_engine]:
            if self._departed + 1 >= self._expected:
                return
            if self._send(client, CoreReport(outputs=client.outputs, stats=self._stats(), state="stopped")):
                self._drop(client, linger_ms=2000)

    def _report(self) -> None:
        """Send every client its finished outputs and the counters."""
        stats = self._stats()
        for client in list(self._clients.values()):
            self._send(client, CoreReport(outputs=client.outputs, stats=stats, state=self._state))
            client.outputs = []
        self._last_report = time.monotonic()

    def _send(self, client: _Client, report: CoreReport) -> bool:
        """Send one report (the first to a client waits up to ``_CONNECT_TIMEOUT_MS`` for the connection; later ones
        never wait); a client that cannot be reached is gone (dropped: ``False``)."""
        if not client.reached:
            client.socket.setsockopt(zmq.SNDTIMEO, _CONNECT_TIMEOUT_MS)
        try:
            client.socket.send(self._encoder.encode(report), 0 if not client.reached else zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.error("engine core: client %d is gone", client.number)
            self._drop(client, linger_ms=0)
            return False
        client.reached = True
        return True

    def _drop(self, client: _Client, linger_ms: int) -> None:
        del self._clients[client.identity]
        client.socket.close(linger=linger_ms)
        self._departed += 1

    def _stats(self) -> CoreStats:
        engine, kv = self.engine, self.engine.kv
        running, waiting = engine.num_running, engine.num_waiting
        service = self._served_s / self._served if self._served else 0.0
        onloaded, offloaded = kv.transferred_bytes
        host_used = 0
        if kv.host is not None:
            store = kv.host.store
            host_used = (store.num_allocated - store.num_free) * store.slot_bytes
        cache, totals = kv.stats, engine.stats
        return CoreStats(
            running=running, waiting=waiting, steps=self._steps,
            step_seconds=self._step_seconds, step_buckets=list(self._step_buckets),
            computed_tokens=totals.num_computed_step_tokens, gpu_hit_tokens=totals.gpu_hit_tokens,
            host_hit_tokens=totals.host_hit_tokens, gpu_pages_used=kv.pool.num_pages - kv.pool.num_free,
            gpu_pages_free=kv.pool.num_free, host_bytes_used=host_used, onloaded_bytes=onloaded,
            offloaded_bytes=offloaded, **asdict(engine.stalls()),
            queue_wait_s=waiting * service, service_s=service, finished_requests=totals.num_requests,
            history_tokens=totals.history_tokens, **{name: getattr(cache, name) for name in CACHE_COUNTERS},
        )


def _kind(message: CoreRequest) -> tuple[bool, int, bool]:
    """Requests that one intake pass may take together: ranking, or retrieval with the same parameters."""
    params = message.params
    return (params is None, params.top_k if params else 0, params.exclude_history if params else False)


def _failed(core_id: int, error: str, kind: str) -> CoreOutput:
    return CoreOutput(core_id=core_id, error=error, error_kind=kind, scores=b"", item_ids=b"", num_tasks=0,
                      num_gpu_cached_tokens=0, num_host_cached_tokens=0, num_computed_tokens=0,
                      timings=StepTimings(), latency_s=0.0, queue_s=0.0)


def run_core_process(config_json: bytes, address: str, clients: int) -> None:
    """The core process's entry point: bind the input socket at ``address``, build the engine, run the loop for
    ``clients`` clients.

    Ctrl-C in a terminal reaches the whole process group: the core ignores SIGINT and SIGTERM and stops when its
    clients have sent :class:`~.protocol.Shutdown` (or exited)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    config = msgspec.json.decode(config_json, type=EngineConfig)
    context = zmq.Context()
    inputs = context.socket(zmq.ROUTER)
    inputs.bind(address)  # first, so that clients connect while the engine is built
    try:
        EngineCore(GREngine(config), inputs, context, clients).run()
    finally:
        inputs.close(linger=0)
        context.destroy(linger=2000)  # reports still queued (the last "stopped") get this long to leave


def start_core(config: EngineConfig, address: str, clients: int = 1) -> multiprocessing.process.BaseProcess:
    """Start an engine-core process (``spawn``) serving ``clients`` clients on ``address`` (``ipc://...``)."""
    process = multiprocessing.get_context("spawn").Process(
        target=run_core_process, name="gr-engine-core", daemon=True,
        args=(msgspec.json.encode(config), address, clients))
    process.start()
    return process
