"""``gr-engine bench-serve`` over HTTP: the load-generator processes and their sender (docs/serving.md, "Load
benchmark"; the phases and loops are :mod:`.load`'s).

Each generator process runs one asyncio loop with one ``aiohttp.ClientSession`` (about a ninth of
``httpx.AsyncClient``'s CPU time a request for the bench's ~234 KB bodies, measured on a development CPU: the
generators share the server's machine); user ``u`` always goes to process
``u % processes``. Bodies are JSON or msgpack (:mod:`.bodies`; msgpack with raw int64 arrays, answers with raw
float32 scores), each phase's encoded before the phase starts, and only each output's ``error`` is decoded from the
answers, so that the generators' own work stays small beside the server's.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from ..bench.trace import Trace, generate_trace
from ..request import RankRequest
from .bodies import JSON, packed_request
from .heap import freeze_heap
from .load import BATCH, COUNTERS, LoadSettings, Marks, Send, closed_loop, error_kind, open_loop, plan_run


def rank_body(requests: Sequence[RankRequest], timeout_ms: float | None = None, body: str = "json") -> bytes:
    """The body of ``POST /v1/rank`` for ``requests``: JSON, or msgpack with raw int64 arrays (``body``)."""
    if body == "msgpack":
        return msgspec.msgpack.encode({"requests": [packed_request(r) for r in requests], "timeout_ms": timeout_ms})
    return JSON.encode({"requests": list(requests), "timeout_ms": timeout_ms})


class _Outcome(msgspec.Struct):
    error: str | None = None


class _Answer(msgspec.Struct):
    """What the load generator reads of an answer (the rest, scores included, is skipped)."""

    outputs: list[_Outcome]


_ANSWERS = {"json": msgspec.json.Decoder(_Answer), "msgpack": msgspec.msgpack.Decoder(_Answer)}
_HEADERS = {"json": {"content-type": "application/json"},
            "msgpack": {"content-type": "application/msgpack", "accept": "application/msgpack"}}


def http_sender(session: object, url: str, body: str, bodies: dict[str, bytes]) -> Send:
    """POST each request's body, taken from ``bodies`` (by ``request_id``, encoded before the phase began), to
    ``url``/v1/rank with an ``aiohttp.ClientSession``; one request per body; non-200 is ``http_<status>``."""
    answers, headers = _ANSWERS[body], _HEADERS[body]

    async def send(batch: list[RankRequest]) -> list[str | None]:
        [request] = batch
        async with session.post(f"{url}/v1/rank", data=bodies.pop(request.request_id), headers=headers) as response:
            content = await response.read()
        if response.status != 200:
            return [f"http_{response.status}"]
        return [None if o.error is None else error_kind(o.error) for o in answers.decode(content).outputs]
    return send


def _generator_main(conn: object, trace_config: object, url: str, timeout_ms: float | None, body: str) -> None:
    """A generator process: builds the trace once, then runs the phases it is sent until told to stop, on one
    event loop and one ``aiohttp.ClientSession`` (its connections stay open between phases, as many as requests
    in flight). A phase's bodies are encoded before it starts."""
    import aiohttp

    trace = generate_trace(trace_config)
    freeze_heap()

    async def main() -> None:
        bodies: dict[str, bytes] = {}
        connector = aiohttp.TCPConnector(limit=0)  # no cap: open-loop arrivals must not queue in the client
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            send = http_sender(session, url, body, bodies)
            conn.send("ready")
            while (command := await asyncio.to_thread(conn.recv))[0] != "stop":
                requests = [trace.rank_request(i) for i in command[1]]
                bodies.update((r.request_id, rank_body([r], timeout_ms, body)) for r in requests)
                if command[0] == "closed":
                    conn.send(await closed_loop(send, requests, command[2]))
                else:
                    conn.send(await open_loop(send, requests, command[2], command[3]))

    asyncio.run(main())


class Generators:
    """``processes`` generator processes; user ``u`` always goes to process ``u % processes``."""

    def __init__(self, trace: Trace, url: str, processes: int, timeout_ms: float | None, body: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.trace, self.pipes, self.procs = trace, [], []
        for k in range(processes):
            mine, theirs = context.Pipe()
            proc = context.Process(target=_generator_main, name=f"bench-serve-{k}", daemon=True,
                                   args=(theirs, trace.config, url, timeout_ms, body))
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
        """Stop the generator processes (each is given 10 s to exit)."""
        for pipe in self.pipes:
            pipe.send(("stop",))
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def core_counters(url: str, finished_at_least: float = 0.0, wait_s: float = 5.0) -> dict[str, float]:
    """The core's :data:`~.load.COUNTERS` from the server's ``/metrics`` (``gr_engine_<name>_total``; 0 before the
    core's first report, or for a counter the server does not export), summed over the ``replica`` labels of a
    ``--replicas N`` server.

    ``/metrics`` gives the answering API server's latest core report; with several API servers another one than the
    one that answered a phase's last request may not hold that report yet. With ``finished_at_least``, the server is
    scraped again (for up to ``wait_s`` seconds) until its ``finished_requests`` reaches it (at once if the server
    does not export that counter)."""
    import httpx

    names = {f"gr_engine_{name}_total": name for name in COUNTERS}
    deadline = time.monotonic() + wait_s
    while True:
        counters, found = dict.fromkeys(names.values(), 0.0), set()
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            sample, _, value = line.rpartition(" ")
            name = sample.partition("{")[0]
            if name in names:
                counters[names[name]] += float(value)
                found.add(names[name])
        if ("finished_requests" not in found or counters["finished_requests"] >= finished_at_least
                or time.monotonic() >= deadline):
            return counters
        time.sleep(0.05)


def _answered(parts: list[dict]) -> int:
    """Requests of a phase answered without error (each one a request the engine finished)."""
    return sum(o is None for p in parts for o in p["outcomes"])


def run_http(trace: Trace, load: LoadSettings, echo: Callable[[str], None]) -> dict:
    """Every phase against the server at ``load.url``; each phase's per-generator results and the change of the
    core's counters over it (:class:`~.load.Marks`)."""
    plan = plan_run(trace, load)
    gens = Generators(trace, load.url, load.processes, load.timeout_ms, load.body)
    phases: dict = {"exhausted": plan.exhausted}
    marks = Marks(core_counters(load.url))

    def counters(parts: list[dict]) -> dict[str, float]:
        return core_counters(load.url, marks.snapshots[-1]["finished_requests"] + _answered(parts))

    try:
        echo(f"warm-up: {len(plan.warmup)} visits (first visits, then the trace's cold start), "
             f"{load.concurrency} in flight")
        parts = gens.closed(plan.warmup, load.concurrency)
        phases["warmup"] = marks.phase(parts, counters(parts))
        echo(f"closed loop: {len(plan.closed)} requests from {BATCH} clients")
        parts = gens.closed(plan.closed, BATCH)
        phases["closed"] = marks.phase(parts, counters(parts))
        phases["rates"] = []
        for rate, offsets, indices in plan.rates:
            echo(f"rate {rate:g} requests/s: {len(indices)} requests over {load.duration_s:g} s")
            parts = gens.open(indices, offsets)
            phases["rates"].append({"rate": rate, **marks.phase(parts, counters(parts))})
        marks.finish(phases)
    finally:
        gens.close()
    return phases
