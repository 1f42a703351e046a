"""``EngineCore``: the engine in its own process, stepping while work is queued (docs/serving.md).

The core owns a :class:`~gr_engine.GREngine`. It receives :mod:`.protocol` messages on a ZeroMQ PULL socket and
sends a :class:`~.protocol.CoreReport` on a PUSH socket after every step that finished requests, and at least every
``serving.heartbeat_s`` otherwise. Each step batches whatever has arrived; while a step's forward runs on the
device (after its requests are committed, before scoring waits for the device), the core takes in, validates and
queues the requests that arrived meanwhile, so that their host work overlaps the device's
(:meth:`~gr_engine.GREngine.step`'s ``between``). A request past its deadline, or aborted by the client, is dropped
if it has not started; one that has started finishes (the client discards a late answer).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import asdict

import msgspec
import zmq

from ..config import EngineConfig
from ..engine import GREngine, Output
from ..outputs import StepTimings
from .protocol import (
    Abort,
    CoreInput,
    CoreOutput,
    CoreReport,
    CoreRequest,
    CoreStats,
    Shutdown,
    from_core,
    output_message,
)

logger = logging.getLogger(__name__)

_STEP_FAILED = "engine step failed"  # how GREngine's errors for failed steps begin


class EngineCore:
    """The stepping loop over one engine and its two sockets.

    Args:
        engine: the engine (its requests come only through this core; ``engine.config.serving`` sets batching and
            reporting).
        inputs: a PULL socket delivering :data:`~.protocol.CoreInput` messages.
        outputs: a PUSH socket for :class:`~.protocol.CoreReport` messages.
    """

    def __init__(self, engine: GREngine, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        self.engine = engine
        self.serving = engine.config.serving
        self._inputs, self._outputs = inputs, outputs
        self._decoder = msgspec.msgpack.Decoder(CoreInput)
        self._encoder = msgspec.msgpack.Encoder()
        self._deadlines: dict[int, float] = {}  # core_id -> deadline of queued requests that have one
        self._finished: list[CoreOutput] = []  # since the last report
        self._step_seconds: list[float] = []
        self._stopping = False  # a Shutdown arrived: finish what is queued, then exit
        self._client_gone = False  # nobody reads the outputs: exit now
        self._last_report = 0.0
        self._batch_opened = 0.0  # when the first request of an idle engine arrived

    def run(self) -> None:
        """Warm up, then step until a :class:`~.protocol.Shutdown` has arrived and every request is answered;
        then let pending transfers finish and report ``"stopped"``."""
        self._report("warming")
        if self.serving.warmup:
            self.engine.warmup(use_tqdm=False)
        self._report("ready")
        parent = os.getppid()
        while not (self._stopping and not self.engine.has_unfinished_requests()):
            busy = self.engine.has_unfinished_requests()
            self._receive(0 if busy else self.serving.heartbeat_s)
            if self._client_gone or os.getppid() != parent:
                logger.error("engine core: the client process is gone; stopping")
                break
            self._wait_for_batch()
            self._expire()
            if self.engine.has_unfinished_requests():
                t0 = time.perf_counter()
                outputs = self.engine.step(between=(lambda: self._receive(0)) if self.serving.overlap_intake else None)
                self._step_seconds.append(time.perf_counter() - t0)
                self._finish(outputs)
            if self._finished or time.monotonic() - self._last_report >= self.serving.heartbeat_s:
                self._report("ready")
        self.engine.close()
        self._report("stopped")

    # ------------------------------------------------------------------ intake
    def _receive(self, timeout_s: float) -> None:
        """Take in every message that has arrived, waiting up to ``timeout_s`` for the first one."""
        if not self._inputs.poll(int(timeout_s * 1000)):
            return
        requests: list[CoreRequest] = []
        while True:
            try:
                frame = self._inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            message = self._decoder.decode(frame.buffer)
            if isinstance(message, CoreRequest):
                requests.append(message)
            elif isinstance(message, Abort):
                self._add(requests)
                requests = []
                self._abort(message.core_ids, message.reason, message.kind)
            elif isinstance(message, Shutdown):
                self._stopping = True
        self._add(requests)

    def _add(self, messages: list[CoreRequest]) -> None:
        """Validate and queue requests, runs of the same kind and parameters together (one intake pass each)."""
        if not messages:
            return
        if not self.engine.has_unfinished_requests():
            self._batch_opened = time.monotonic()
        start = 0
        for end in range(1, len(messages) + 1):
            if end < len(messages) and _kind(messages[end]) == _kind(messages[start]):
                continue
            run = messages[start:end]
            params = run[0].params
            added = self.engine.add_requests([from_core(m) for m in run], params)
            for message, result in zip(run, added, strict=True):
                if isinstance(result, Exception):
                    self._finished.append(_failed(message.core_id, str(result), "invalid"))
                elif message.deadline is not None:
                    self._deadlines[message.core_id] = message.deadline
            start = end

    def _wait_for_batch(self) -> None:
        """With ``max_batch_wait_ms``, let a batch that is not full gather arrivals before an idle engine steps."""
        wait_s = self.serving.max_batch_wait_ms / 1000
        if wait_s <= 0 or self.engine.scheduler.running:
            return
        full = self.engine.config.scheduler.max_num_seqs
        while self.engine.scheduler.num_unfinished < full and not self._stopping:
            remaining = self._batch_opened + wait_s - time.monotonic()
            if remaining <= 0:
                return
            self._receive(remaining)

    def _expire(self) -> None:
        """Drop queued requests whose deadline has passed."""
        if not self._deadlines:
            return
        now = time.monotonic()
        late = [core_id for core_id, deadline in self._deadlines.items() if deadline <= now]
        if late:
            self._abort(late, "deadline exceeded before the request started", "timeout")

    def _abort(self, core_ids: list[int], reason: str, kind: str) -> None:
        for output in self.engine.abort_waiting([str(c) for c in core_ids], reason):
            self._finished.append(output_message(int(output.request_id), output, kind))
            self._deadlines.pop(int(output.request_id), None)

    # ------------------------------------------------------------------ outputs
    def _finish(self, outputs: list[Output]) -> None:
        for output in outputs:
            core_id = int(output.request_id)
            self._deadlines.pop(core_id, None)
            kind = None
            if output.error is not None:
                kind = "engine" if output.error.startswith(_STEP_FAILED) else "unservable"
            self._finished.append(output_message(core_id, output, kind))

    def _report(self, state: str) -> None:
        report = CoreReport(outputs=self._finished, stats=self._stats(), state=state)
        try:  # the first report waits for the connection; later ones never wait
            self._outputs.send(self._encoder.encode(report), 0 if state == "warming" else zmq.NOBLOCK, copy=False)
        except zmq.Again:  # no client connected (no high-water mark: nothing else refuses a send)
            logger.error("engine core: the client is gone; stopping")
            self._client_gone = True
        self._finished, self._step_seconds = [], []
        self._last_report = time.monotonic()

    def _stats(self) -> CoreStats:
        engine, kv = self.engine, self.engine.kv
        running = len(engine.scheduler.running)
        onloaded, offloaded = kv.transferred_bytes
        host_used = 0
        if kv.host is not None:
            store = kv.host.store
            host_used = (store.num_allocated - store.num_free) * store.slot_bytes
        return CoreStats(
            running=running, waiting=engine.scheduler.num_unfinished - running, step_seconds=self._step_seconds,
            computed_tokens=engine.stats.num_computed_step_tokens, gpu_hit_tokens=engine.stats.gpu_hit_tokens,
            host_hit_tokens=engine.stats.host_hit_tokens, gpu_pages_used=kv.pool.num_pages - kv.pool.num_free,
            gpu_pages_free=kv.pool.num_free, host_bytes_used=host_used, onloaded_bytes=onloaded,
            offloaded_bytes=offloaded, **asdict(engine.stalls()),
        )


def _kind(message: CoreRequest) -> tuple[bool, int, bool]:
    """Requests that one intake pass may take together: ranking, or retrieval with the same parameters."""
    params = message.params
    return (params is None, params.top_k if params else 0, params.exclude_history if params else False)


def _failed(core_id: int, error: str, kind: str) -> CoreOutput:
    return CoreOutput(core_id=core_id, error=error, error_kind=kind, scores=b"", item_ids=b"", num_tasks=0,
                      num_gpu_cached_tokens=0, num_host_cached_tokens=0, num_computed_tokens=0,
                      timings=StepTimings(), latency_s=0.0, queue_s=0.0)


def run_core_process(config_json: bytes, input_address: str, output_address: str) -> None:
    """The core process's entry point: build the engine, connect to the client's sockets, run the loop.

    Ctrl-C in a terminal reaches the whole process group: the core ignores SIGINT and SIGTERM and stops when its
    client sends :class:`~.protocol.Shutdown` (or exits)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    config = msgspec.json.decode(config_json, type=EngineConfig)
    context = zmq.Context()
    inputs, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inputs.connect(input_address)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(output_address)
    try:
        EngineCore(GREngine(config), inputs, outputs).run()
    finally:
        outputs.close(linger=2000)
        inputs.close(linger=0)
        context.term()

