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
   ``duration_s`` seconds. Latency runs from each request's *scheduled* send time, so a late send counts against it.

Over HTTP the load is spread over ``processes`` generator processes (each an asyncio loop with one
``httpx.AsyncClient``); a user always goes to the same one, and a user's next visit is sent only once the previous
one was answered (so visits stay in order). Each generator reports its own CPU seconds and its lag (how late, in ms,
it fired requests against their schedule). Results: :mod:`.load_report`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from ..bench.runner import BenchSettings, cache_config, engine_config, quick_settings, unlimited_pages
from ..bench.trace import Trace, generate_trace
from ..config import EngineConfig
from ..request import RankRequest

BATCH = 8  # the bench's batch size: the engine's max_num_seqs and the closed-loop batch


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


def bench_settings(quick: bool, users: int | None = None, seed: int = 0) -> BenchSettings:
    """The bench's settings (``--quick``: its CPU-sized ones), with ``users`` and the trace ``seed``."""
    settings = quick_settings() if quick else BenchSettings()
    trace = dataclasses.replace(settings.trace, seed=seed, **({"num_users": users} if users else {}))
    return dataclasses.replace(settings, trace=trace)


def bench_engine_config(settings: BenchSettings, mode: str, trace: Trace | None = None) -> EngineConfig:
    """The bench's engine for ``mode`` at batch size 8 (``unlimited``: pages for every user of ``trace``)."""
    changes = {"num_gpu_pages": unlimited_pages(settings, trace or generate_trace(settings.trace))} \
        if mode == "unlimited" else {}
    return engine_config(settings, cache_config(settings, mode, **changes), BATCH)


def _as_list(value: object) -> object:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot encode a {type(value).__name__}")


_ENCODER = msgspec.json.Encoder(enc_hook=_as_list)


def rank_body(requests: Sequence[RankRequest], timeout_ms: float | None = None) -> bytes:
    """The JSON body of ``POST /v1/rank`` for ``requests``."""
    return _ENCODER.encode({"requests": list(requests), "timeout_ms": timeout_ms})


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
    """Per-request latency (ms, from the scheduled time), outcome and lag (ms) of one phase in one process."""

    def __init__(self, start: float = float("inf")) -> None:
        self.latency_ms: list[float] = []
        self.outcomes: list[str | None] = []
        self.lag_ms: list[float] = []
        self.user_waits = 0  # requests whose user's previous visit was still unanswered when they were due
        self.cpu0, self.first, self.last = time.process_time(), start, 0.0

    def done(self, scheduled: float, outcomes: list[str | None]) -> None:
        now = time.monotonic()
        self.first, self.last = min(self.first, scheduled), max(self.last, now)
        self.latency_ms += [(now - scheduled) * 1e3] * len(outcomes)
        self.outcomes += outcomes

    def result(self) -> dict:
        return {"latency_ms": self.latency_ms, "outcomes": self.outcomes, "lag_ms": self.lag_ms,
                "user_waits": self.user_waits, "cpu_s": time.process_time() - self.cpu0, "first_s": self.first,
                "last_s": self.last}


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
    """Send each request at ``start + offset`` (``time.monotonic()`` s); a user's visit waits for its previous one.
    Lag is how late the sender fired a request against its schedule (ms)."""
    rec = Recorder(start)  # the phase's span starts at its start, not at its first arrival
    last: dict[object, asyncio.Task] = {}

    async def one(request: RankRequest, scheduled: float, previous: asyncio.Task | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        rec.done(scheduled, await _guarded(send, [request]))

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


def http_sender(client: object, url: str, timeout_ms: float | None) -> Send:
    """POST requests to ``url``/v1/rank with an ``httpx.AsyncClient``: non-200 is ``http_<status>``."""
    async def send(batch: list[RankRequest]) -> list[str | None]:
        response = await client.post(f"{url}/v1/rank", content=rank_body(batch, timeout_ms),
                                     headers={"content-type": "application/json"})
        if response.status_code != 200:
            return [f"http_{response.status_code}"] * len(batch)
        outputs = msgspec.json.decode(response.content)["outputs"]
        return [None if o.get("error") is None else error_kind(o["error"]) for o in outputs]
    return send


def engine_sender(engine: object, timeout_ms: float | None) -> Send:
    """Send requests through an :class:`~.client.AsyncGREngine` (``rank_many``)."""
    from .client import EngineDead, EngineOverloaded

    async def send(batch: list[RankRequest]) -> list[str | None]:
        try:
            outputs = await engine.rank_many(batch, timeout_ms)
        except EngineOverloaded:
            return ["overloaded"] * len(batch)
        except EngineDead:
            return ["engine_dead"] * len(batch)
        return [None if o.error is None else error_kind(o.error) for o in outputs]
    return send


# ---------------------------------------------------------------------------------------------- generators
def _generator_main(conn: object, trace_config: object, url: str, timeout_ms: float | None) -> None:
    """A generator process: builds the trace once, then runs the phases it is sent until told to stop, on one
    event loop and one ``httpx.AsyncClient`` (its connections stay open between phases)."""
    import httpx

    trace = generate_trace(trace_config)

    async def main() -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            send = http_sender(client, url, timeout_ms)
            conn.send("ready")
            while (command := await asyncio.to_thread(conn.recv))[0] != "stop":
                requests = [trace.rank_request(i) for i in command[1]]
                if command[0] == "closed":
                    conn.send(await closed_loop(send, requests, command[2]))
                else:
                    conn.send(await open_loop(send, requests, command[2], command[3]))

    asyncio.run(main())


class Generators:
    """``processes`` generator processes; user ``u`` always goes to process ``u % processes``."""

    def __init__(self, trace: Trace, url: str, processes: int, timeout_ms: float | None) -> None:
        context = multiprocessing.get_context("spawn")
        self.trace, self.pipes, self.procs = trace, [], []
        for k in range(processes):
            mine, theirs = context.Pipe()
            proc = context.Process(target=_generator_main, name=f"bench-serve-{k}", daemon=True,
                                   args=(theirs, trace.config, url, timeout_ms))
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)
        for pipe in self.pipes:
            pipe.recv()

    def _of(self, indices: list[int]) -> list[np.ndarray]:
        users = np.array([self.trace.requests[i].user for i in indices], dtype=np.int64)
        return [np.flatnonzero(users % len(self.pipes) == k) for k in range(len(self.pipes))]

    def closed(self, indices: list[int], clients: int) -> list[dict]:
        """Closed loop with ``clients`` senders in all (spread over the processes)."""
        n = len(self.pipes)
        for k, (pipe, mine) in enumerate(zip(self.pipes, self._of(indices), strict=True)):
            pipe.send(("closed", [indices[i] for i in mine], clients // n + (k < clients % n)))
        return [pipe.recv() for pipe in self.pipes]

    def open(self, indices: list[int], offsets: np.ndarray, lead_s: float = 0.5) -> list[dict]:
        """Open loop: every process's share of the arrivals, from ``lead_s`` seconds from now."""
        start = time.monotonic() + lead_s
        for pipe, mine in zip(self.pipes, self._of(indices), strict=True):
            pipe.send(("open", [indices[i] for i in mine], offsets[mine], start))
        return [pipe.recv() for pipe in self.pipes]

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(("stop",))
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


# ---------------------------------------------------------------------------------------------- runs
#: The core's counters of stalls (:meth:`~gr_engine.GREngine.stalls`), by their names in :class:`.protocol.CoreStats`.
STALL_COUNTERS = ("kernel_compilations", "kernel_cache_loads", "graph_captures")


def core_counters(url: str) -> dict[str, float]:
    """The core's ``onloaded_bytes`` and :data:`STALL_COUNTERS` from the server's ``/metrics`` (``*_total``; 0 before
    the core's first report)."""
    import httpx

    names = {f"gr_engine_{name}_total": name for name in ("onloaded_bytes", *STALL_COUNTERS)}
    counters = dict.fromkeys(names.values(), 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            counters[names[name]] = float(value)
    return counters


def stall_count(counters: dict[str, float] | object) -> int:
    """Compilations, cache loads and captures in a :func:`core_counters` dict or a :class:`.protocol.CoreStats`."""
    if isinstance(counters, dict):
        return int(sum(counters[name] for name in STALL_COUNTERS))
    return sum(getattr(counters, name) for name in STALL_COUNTERS)


def run_http(trace: Trace, load: LoadSettings, echo: Callable[[str], None]) -> dict:
    """Every phase against the server at ``load.url``; each phase's per-generator results and onloaded bytes."""
    plan = plan_run(trace, load)
    gens = Generators(trace, load.url, load.processes, load.timeout_ms)
    phases: dict = {"exhausted": plan.exhausted}
    try:
        echo(f"warm-up: {len(plan.warmup)} visits (first visits, then the trace's cold start), "
             f"{load.concurrency} in flight")
        phases["warmup"] = {"parts": gens.closed(plan.warmup, load.concurrency)}
        echo(f"closed loop: {len(plan.closed)} requests from {BATCH} clients")
        first = core_counters(load.url)
        phases["closed"] = {"parts": gens.closed(plan.closed, BATCH)}
        phases["rates"] = []
        for rate, offsets, indices in plan.rates:
            echo(f"rate {rate:g} requests/s: {len(indices)} requests over {load.duration_s:g} s")
            before = core_counters(load.url)["onloaded_bytes"]
            parts = gens.open(indices, offsets)
            phases["rates"].append({"rate": rate, "parts": parts,
                                    "onloaded_bytes": core_counters(load.url)["onloaded_bytes"] - before})
        phases["stalls"] = stall_count(core_counters(load.url)) - stall_count(first)
    finally:
        gens.close()
    return phases


def run_in_process(trace: Trace, load: LoadSettings, config: EngineConfig, echo: Callable[[str], None]) -> dict:
    """Every phase through an :class:`~.client.AsyncGREngine` in this process (the same arrivals as over HTTP)."""
    from .client import AsyncGREngine

    plan = plan_run(trace, load)

    async def run() -> dict:
        phases: dict = {"exhausted": plan.exhausted, "rates": []}
        async with AsyncGREngine(config) as engine:
            send = engine_sender(engine, load.timeout_ms)
            echo(f"warm-up: {len(plan.warmup)} visits (first visits, then the trace's cold start) in batches of "
                 f"{BATCH}")
            phases["warmup"] = {"parts": [await closed_loop(send, [trace.rank_request(i) for i in plan.warmup], 1,
                                                            BATCH)]}
            echo(f"closed loop: {len(plan.closed)} requests in batches of {BATCH}")
            first = stall_count(engine.stats)
            phases["closed"] = {"parts": [await closed_loop(send, [trace.rank_request(i) for i in plan.closed], 1,
                                                            BATCH)]}
            for rate, offsets, indices in plan.rates:
                echo(f"rate {rate:g} requests/s: {len(indices)} requests over {load.duration_s:g} s")
                before = engine.stats.onloaded_bytes if engine.stats else 0
                requests = [trace.rank_request(i) for i in indices]
                part = await open_loop(send, requests, offsets, time.monotonic() + 0.2)
                phases["rates"].append({"rate": rate, "parts": [part],
                                        "onloaded_bytes": (engine.stats.onloaded_bytes if engine.stats else 0)
                                        - before})
            phases["stalls"] = stall_count(engine.stats) - first
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


def run_bench(load: LoadSettings, config: EngineConfig | None, echo: Callable[[str], None] = print) -> dict:
    """One whole run (``config``: the in-process engine; ``None``: against ``load.url``); the JSON-able result
    of :func:`~.load_report.build_result` plus the settings and the trace's summary."""
    from .load_report import build_result

    settings = bench_settings(load.quick, load.users, load.seed)
    trace = generate_trace(settings.trace)
    echo(f"trace: {trace.summary()}")
    if config is not None:
        phases, device = run_in_process(trace, load, config, echo), config.device
    else:
        import httpx

        if httpx.get(f"{load.url}/ready", timeout=30).status_code != 200:
            raise ValueError(f"{load.url} is not ready (GET /ready)")
        device = httpx.get(f"{load.url}/v1/config", timeout=30).json().get("device", "cpu")
        phases = run_http(trace, load, echo)
    result = build_result(phases, pcie_peak_GBps(device))
    result["settings"] = {**msgspec.to_builtins(dataclasses.asdict(load)), "in_process": config is not None,
                          "device": device}
    result["trace"] = trace.summary()
    if config is not None:
        result["engine_config"] = msgspec.to_builtins(config)
    return result
