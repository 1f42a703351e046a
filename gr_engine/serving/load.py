"""``gr-engine bench-serve``: the load benchmark of the online path (docs/serving.md, "Load benchmark").

The bench's trace (:func:`~gr_engine.bench.trace.generate_trace`) is replayed against a server (``POST /v1/rank``)
or an in-process :class:`~.client.AsyncGREngine`, one request per trace visit:

1. warm-up: every user's first visit, then the first ``skip_steady`` steady visits, closed loop (as fast as answers
   come, ``concurrency`` at a time): the trace starts cold (the GPU tier holds nobody's recent history: in the
   policy simulation of the bench's hierarchical engine its first 10,000 steady visits hit GPU pages for 0-3% of
   their history, against 65% over the whole trace), and a capacity figure must come from the steady state;
2. closed loop: the next ``closed_requests`` visits as batches of 8 back to back (in process: ``rank_many``; over
   HTTP: 8 concurrent clients), its throughput is ``closed_loop_rps``;
3. per offered rate (requests/s): the next visits of the trace, in trace order, as open-loop Poisson arrivals for
   ``duration_s`` seconds. A user's visit is sent only once the user's previous one was answered (the replay
   compresses the trace's minute-long gaps between a user's visits to milliseconds); latency runs from the time a
   request could be sent (its scheduled time, or that answer if later), so a late send by the generator counts
   against it, and is also reported from the scheduled time alone (counting the wait for the previous answer).

Over HTTP the load is spread over ``processes`` generator processes (each an asyncio loop with one
``aiohttp.ClientSession``); a user always goes to the same one, and a user's next visit is sent only once the previous
one was answered (so visits stay in order). Bodies are JSON or msgpack (``body``), encoded before each phase starts,
and only each output's ``error`` is decoded from the answers. Each generator reports its own CPU seconds and its lag
(how late, in ms, it fired requests against their schedule). The HTTP side is :mod:`.load_http`; results:
:mod:`.load_report`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from ..bench.runner import BenchSettings, cache_config, engine_config, quick_settings, unlimited_pages
from ..bench.trace import Trace, generate_trace
from ..config import EngineConfig
from ..request import RankRequest
from .heap import freeze_heap
from .protocol import CACHE_COUNTERS

BATCH = 8  # the bench's batch size: the closed loop's batches
#: The online engine's max_num_seqs: on the H200 (benchmarks/results/serve/README.md) 16 kept p99 <= 25 ms up to
#: 1,780 requests/s offered where 8 did up to 1,576 (same stretch and arrivals).
SERVE_MAX_SEQS = 16


@dataclass(frozen=True)
class LoadSettings:
    """What one ``bench-serve`` run does (rates in requests/s, durations in s, deadlines in ms)."""

    rates: tuple[float, ...] = (50.0,)
    duration_s: float = 10.0
    url: str | None = None  # None: in process
    processes: int = 1
    quick: bool = False
    users: int | None = None
    seed: int = 0
    mode: str = "hierarchical"
    concurrency: int = 8  # warm-up requests in flight (closed loop)
    skip_steady: int = 10_000  # steady visits served in the warm-up (the trace's cold start)
    closed_requests: int = 240
    timeout_ms: float | None = None
    arrival_seed: int = 0
    body: str = "json"  # HTTP bodies and answers: "json" or "msgpack" (raw int64 arrays, raw float32 scores)
    step_log: str | None = None  # the core's step log to profile each rate from (serving.step_log), if any


def bench_settings(quick: bool, users: int | None = None, seed: int = 0) -> BenchSettings:
    """The bench's settings (``--quick``: its CPU-sized ones), with ``users`` and the trace ``seed``."""
    settings = quick_settings() if quick else BenchSettings()
    trace = dataclasses.replace(settings.trace, seed=seed, **({"num_users": users} if users is not None else {}))
    return dataclasses.replace(settings, trace=trace)


def bench_engine_config(settings: BenchSettings, mode: str, trace: Trace | None = None) -> EngineConfig:
    """The bench's engine for ``mode``, admitting up to :data:`SERVE_MAX_SEQS` requests a step (``unlimited``: pages
    for every user of ``trace``)."""
    changes = {"num_gpu_pages": unlimited_pages(settings, trace or generate_trace(settings.trace))} \
        if mode == "unlimited" else {}
    return engine_config(settings, cache_config(settings, mode, **changes), SERVE_MAX_SEQS)


def error_kind(message: str) -> str:
    """A per-request ``error`` as a short kind: its text before any parenthesis (``error: deadline exceeded``)."""
    return "error: " + message.split(" (")[0].split(":")[0][:60]


@dataclass
class Plan:
    """Trace indices of each phase: ``warmup``, ``closed`` and one list per rate (with arrival offsets in s)."""

    warmup: list[int]
    closed: list[int]
    rates: list[tuple[float, np.ndarray, list[int]]]
    exhausted: bool


def plan_run(trace: Trace, load: LoadSettings) -> Plan:
    """Cut the trace into the phases (see the module docstring); Poisson arrivals at each rate over
    ``duration_s``. A trace too short for every rate ends the last segments early (``exhausted``)."""
    rng = np.random.default_rng(load.arrival_seed)
    steady = trace.steady
    skip = min(load.skip_steady, len(steady))
    closed = steady[skip:skip + load.closed_requests]
    cursor, rates, exhausted = skip + len(closed), [], False
    for rate in load.rates:
        count = max(1, int(rate * load.duration_s * 1.5) + 10)
        offsets = np.cumsum(rng.exponential(1.0 / rate, count))
        offsets = offsets[offsets < load.duration_s]
        segment = steady[cursor:cursor + len(offsets)]
        exhausted |= len(segment) < len(offsets)
        rates.append((rate, offsets[:len(segment)], segment))
        cursor += len(segment)
    return Plan(trace.warmup + steady[:skip], closed, rates, exhausted)


# ---------------------------------------------------------------------------------------------- one load loop
#: Sends some requests; returns each one's outcome (None: answered without error, else the error's kind).
Send = Callable[[list[RankRequest]], Awaitable[list[str | None]]]


class Recorder:
    """Per-request latency (ms), outcome and lag (ms) of one phase in one process.

    Two latencies are kept: from the time a request could be sent (its scheduled time, or its user's previous
    answer when that came later: a user's app waits for one feed before it asks for the next) and from its
    scheduled time (which also counts the wait for the user's previous answer)."""

    def __init__(self, start: float = float("inf")) -> None:
        self.latency_ms: list[float] = []
        self.schedule_latency_ms: list[float] = []
        self.outcomes: list[str | None] = []
        self.lag_ms: list[float] = []
        self.user_waits = 0  # requests whose user's previous visit was still unanswered when they were due
        self.cpu0, self.first, self.last = time.process_time(), start, 0.0

    def done(self, scheduled: float, outcomes: list[str | None], released: float | None = None) -> float:
        """Record answers to requests scheduled at ``scheduled`` and sendable from ``released`` (monotonic s;
        default ``scheduled``); returns now."""
        now = time.monotonic()
        self.first, self.last = min(self.first, scheduled), max(self.last, now)
        self.latency_ms += [(now - max(scheduled, released or scheduled)) * 1e3] * len(outcomes)
        self.schedule_latency_ms += [(now - scheduled) * 1e3] * len(outcomes)
        self.outcomes += outcomes
        return now

    def result(self) -> dict:
        """What was recorded: per-request latencies and outcomes, lags, users' waits, CPU seconds, first and last
        arrival (s)."""
        return {"latency_ms": self.latency_ms, "schedule_latency_ms": self.schedule_latency_ms,
                "outcomes": self.outcomes, "lag_ms": self.lag_ms, "user_waits": self.user_waits,
                "cpu_s": time.process_time() - self.cpu0, "first_s": self.first, "last_s": self.last}


async def _guarded(send: Send, batch: list[RankRequest]) -> list[str | None]:
    try:
        return await send(batch)
    except Exception as exc:  # a transport failure or a refusal: every request of the batch failed with it
        return [getattr(exc, "kind", type(exc).__name__)] * len(batch)


async def closed_loop(send: Send, requests: list[RankRequest], clients: int, batch: int = 1) -> dict:
    """Serve ``requests`` in order from ``clients`` concurrent senders of ``batch`` requests each, a user's request
    only after its previous one was answered (latency from when each batch was sent)."""
    rec, queue = Recorder(), deque(requests)
    busy: dict[object, asyncio.Event] = {}

    async def client() -> None:
        while queue:
            chunk = [queue.popleft() for _ in range(min(batch, len(queue)))]
            while (held := next((busy[r.user_id] for r in chunk if r.user_id in busy), None)) is not None:
                await held.wait()
            events = {r.user_id: busy.setdefault(r.user_id, asyncio.Event()) for r in chunk}
            t0 = time.monotonic()
            outcomes = await _guarded(send, chunk)
            rec.done(t0, outcomes)
            for user, event in events.items():
                del busy[user]
                event.set()

    await asyncio.gather(*(client() for _ in range(max(1, clients))))
    return rec.result()


async def open_loop(send: Send, requests: list[RankRequest], offsets: np.ndarray, start: float) -> dict:
    """Send each request at ``start + offset`` (``time.monotonic()`` s), or once its user's previous visit is
    answered if that is later. Lag is how late the sender fired a request against its schedule (ms)."""
    rec = Recorder(start)  # the phase's span starts at its start, not at its first arrival
    last: dict[object, asyncio.Task] = {}

    async def one(request: RankRequest, scheduled: float, previous: asyncio.Task | None) -> float:
        released = None if previous is None else await previous  # when the user's previous visit was answered
        return rec.done(scheduled, await _guarded(send, [request]), released)

    tasks = []
    for request, offset in zip(requests, offsets.tolist(), strict=True):
        scheduled = start + offset
        wait = scheduled - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        rec.lag_ms.append(max(time.monotonic() - scheduled, 0.0) * 1e3)
        previous = last.get(request.user_id)
        rec.user_waits += previous is not None and not previous.done()
        task = asyncio.create_task(one(request, scheduled, previous))
        last[request.user_id] = task
        tasks.append(task)
    await asyncio.gather(*tasks)
    return rec.result()


def engine_sender(engine: object, timeout_ms: float | None) -> Send:
    """Send requests through an :class:`~.client.AsyncGREngine` (``rank_many``)."""
    from .admission import EngineOverloaded
    from .client import EngineDead

    async def send(batch: list[RankRequest]) -> list[str | None]:
        try:
            outputs = await engine.rank_many(batch, timeout_ms)
        except EngineOverloaded:
            return ["overloaded"] * len(batch)
        except EngineDead:
            return ["engine_dead"] * len(batch)
        return [None if o.error is None else error_kind(o.error) for o in outputs]
    return send


# ---------------------------------------------------------------------------------------------- runs
#: The core's counters of stalls (:meth:`~gr_engine.GREngine.stalls`), by their names in :class:`.protocol.CoreStats`.
STALL_COUNTERS = ("kernel_compilations", "kernel_cache_loads", "graph_captures")
#: The core's counters whose change over each phase the report gives (:func:`.load_report.cache_stats`), by their
#: names in :class:`.protocol.CoreStats` (``gr_engine_<name>_total`` on ``/metrics``): the requests the engine
#: finished, their history and its GPU and host hits, the tokens computed, onloads, and the cache's counters.
PHASE_COUNTERS = ("finished_requests", "history_tokens", "gpu_hit_tokens", "host_hit_tokens", "computed_tokens",
                  "onloaded_bytes", *CACHE_COUNTERS)
#: Every counter a run reads from the core.
COUNTERS = (*PHASE_COUNTERS, *STALL_COUNTERS)


def counters_of(stats: object | None) -> dict[str, int]:
    """The :data:`COUNTERS` of a :class:`.protocol.CoreStats` (all 0 for ``None``: no report yet)."""
    return {name: int(getattr(stats, name)) if stats is not None else 0 for name in COUNTERS}


def counter_change(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """How much each of :data:`PHASE_COUNTERS` grew from ``before`` to ``after`` (two snapshots of :data:`COUNTERS`)."""
    return {name: round(after[name] - before[name]) for name in PHASE_COUNTERS}


def stall_count(counters: dict[str, float] | object) -> int:
    """Compilations, cache loads and captures in a :func:`.load_http.core_counters` dict or a
    :class:`.protocol.CoreStats`."""
    if isinstance(counters, dict):
        return int(sum(counters[name] for name in STALL_COUNTERS))
    return sum(getattr(counters, name) for name in STALL_COUNTERS)


class Marks:
    """The core's counters (:data:`COUNTERS`) at each phase boundary of a run, from its start."""

    def __init__(self, start: dict[str, float]) -> None:
        self.snapshots = [start]

    def phase(self, parts: list[dict], counters: dict[str, float]) -> dict:
        """A phase's entry: its generators' ``parts``, the change of :data:`PHASE_COUNTERS` over it (``counters``:
        the snapshot at its end) and its ``onloaded_bytes``."""
        self.snapshots.append(counters)
        change = counter_change(self.snapshots[-2], counters)
        return {"parts": parts, "counters": change, "onloaded_bytes": change["onloaded_bytes"]}

    def finish(self, phases: dict) -> None:
        """Add the core's stalls after the warm-up (``stalls``) and its counters at the run's start and end
        (``core_counters``) to ``phases``."""
        phases["stalls"] = stall_count(self.snapshots[-1]) - stall_count(self.snapshots[1])
        phases["core_counters"] = {"start": self.snapshots[0], "end": self.snapshots[-1]}


def run_in_process(trace: Trace, load: LoadSettings, config: EngineConfig, echo: Callable[[str], None]) -> dict:
    """Every phase through an :class:`~.client.AsyncGREngine` in this process (the same arrivals as over HTTP)."""
    from .client import AsyncGREngine

    plan = plan_run(trace, load)

    async def run() -> dict:
        phases: dict = {"exhausted": plan.exhausted, "rates": []}
        async with AsyncGREngine(config) as engine:
            send = engine_sender(engine, load.timeout_ms)
            # The core's counters arrive with the outputs they count: read after a phase, they cover all of it.
            marks = Marks(counters_of(engine.stats))
            echo(f"warm-up: {len(plan.warmup)} visits (first visits, then the trace's cold start) in batches of "
                 f"{BATCH}")
            phases["warmup"] = marks.phase([await closed_loop(send, [trace.rank_request(i) for i in plan.warmup], 1,
                                                              BATCH)], counters_of(engine.stats))
            echo(f"closed loop: {len(plan.closed)} requests in batches of {BATCH}")
            phases["closed"] = marks.phase([await closed_loop(send, [trace.rank_request(i) for i in plan.closed], 1,
                                                              BATCH)], counters_of(engine.stats))
            for rate, offsets, indices in plan.rates:
                echo(f"rate {rate:g} requests/s: {len(indices)} requests over {load.duration_s:g} s")
                requests = [trace.rank_request(i) for i in indices]
                part = await open_loop(send, requests, offsets, time.monotonic() + 0.2)
                phases["rates"].append({"rate": rate, **marks.phase([part], counters_of(engine.stats))})
            marks.finish(phases)
        return phases

    return asyncio.run(run())


def pcie_peak_GBps(device: str) -> float | None:
    """The pinned host-to-device copy peak (GB/s) measured here when ``device`` is CUDA and this process has it."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    from ..bench.experiments import peak_h2d_GBps

    return peak_h2d_GBps(str(device))


def attach_profile(phases: dict, step_log: str) -> None:
    """Add the core's profile (:func:`.step_log.summarize`) over each rate's span (from its start to its last
    answer) and over the closed loop's to ``phases``, and the log's header."""
    from .step_log import read_step_log, summarize

    header, steps = read_step_log(step_log)
    phases["heap"] = None if header is None else msgspec.to_builtins(header)
    for entry in [phases["closed"], *phases["rates"]]:
        busy = [p for p in entry["parts"] if p["outcomes"]]
        if busy:
            entry["core"] = summarize(steps, min(p["first_s"] for p in busy), max(p["last_s"] for p in busy))


def run_bench(load: LoadSettings, config: EngineConfig | None, echo: Callable[[str], None] = print) -> dict:
    """One whole run (``config``: the in-process engine; ``None``: against ``load.url``); the JSON-able result
    of :func:`~.load_report.build_result` plus the settings and the trace's summary."""
    from .load_report import build_result

    # the engine that serves (the server's: to compare runs by), known before the trace is generated
    served = msgspec.to_builtins(config) if config is not None else server_config(load.url)
    settings = bench_settings(load.quick, load.users, load.seed)
    trace = generate_trace(settings.trace)
    echo(f"trace: {trace.summary()}")
    freeze_heap()  # this process's generator (and, in process, client) runs alongside the trace's objects
    if config is not None:
        phases, device = run_in_process(trace, load, config, echo), config.device
    else:
        device = served.get("device", "cpu")
        from .load_http import run_http

        phases = run_http(trace, load, echo)
    if load.step_log:
        attach_profile(phases, load.step_log)
    result = build_result(phases, pcie_peak_GBps(device))
    result["settings"] = {**msgspec.to_builtins(dataclasses.asdict(load)), "in_process": config is not None,
                          "device": device}
    result["trace"] = trace.summary()
    result["engine_config"] = served
    return result


def server_config(url: str) -> dict:
    """The engine configuration of the server at ``url`` (``GET /v1/config``) once ``GET /ready`` answers 200;
    ``ValueError`` saying why not (not ready, not reachable, not a URL)."""
    import httpx

    try:
        ready = httpx.get(f"{url}/ready", timeout=30)
        if ready.status_code != 200:
            raise ValueError(f"{url} is not ready (GET /ready answered {ready.status_code})")
        return httpx.get(f"{url}/v1/config", timeout=30).json()
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise ValueError(f"cannot reach {url}: {exc}") from exc
