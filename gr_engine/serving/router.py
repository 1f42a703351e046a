"""``ReplicaRouter``: N engine-core replicas behind one asyncio API, users kept on their replica (docs/scale_out.md).

Each replica is an :class:`~.client.AsyncGREngine` with an engine-core process of its own, on a device of its own
(:func:`replica_devices`), with its own KV tiers and its own admission bounds. A request goes to the replica that
owns its ``user_id`` on a :class:`~gr_engine.routing.HashRing` of the live replicas, so that a returning user finds
its KV cache there. A call spanning users is split by replica, the parts are served concurrently and the outputs
merged back in input order.

Faults: a replica whose core has died is taken off the ring, and its users go on to their next replica, which
recomputes what it lacks (the engine's prefix checks keep every answer exact; the dead replica's KV is gone with
it). A request that its replica accepted but did not answer before dying is sent once more, to its user's next
replica; if that fails too, its output carries the error (never lost, never waited on past its deadline). A dead
replica can be started again (:meth:`ReplicaRouter.restart`; the API server does so by itself,
:meth:`ReplicaRouter.supervise`), and its users then return to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from ..config import EngineConfig
from ..outputs import GenerateOutput, RankOutput, output_user_id
from ..request import GenerateParams, GenerateRequest, RankRequest
from ..routing import DEFAULT_VIRTUAL_NODES, HashRing
from .client import AsyncGREngine, EngineDead, EngineOverloaded, OutputObserver

logger = logging.getLogger(__name__)

Request = RankRequest | GenerateRequest
Output = RankOutput | GenerateOutput
#: :meth:`ReplicaRouter.supervise`: how often it looks for dead replicas (s), and its wait after a failed restart (s),
#: doubled at each further failure.
SUPERVISE_POLL_S = 0.5
RESTART_BACKOFF_S = 5.0


def replica_devices(device: str, replicas: int, cuda_devices: int | None = None) -> list[str]:
    """The device of each of ``replicas`` replicas for the configured ``device``: ``"cpu"`` -> all on the CPU;
    ``"cuda"`` -> replica ``i`` on ``"cuda:i"``; ``"auto"`` -> as ``"cuda"`` when CUDA is available, else the CPU.

    Args:
        cuda_devices: CUDA devices this machine has (default: ``torch.cuda.device_count()``).

    Raises:
        ValueError: fewer than one replica; fewer CUDA devices than replicas; a single device (``"cuda:N"``) for
            several replicas (they would share it).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    count = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    if device == "auto":
        device = "cuda" if count > 0 else "cpu"
    if device == "cpu" or replicas == 1:
        return [device] * replicas
    if device != "cuda":
        raise ValueError(f"device {device!r} names one device: {replicas} replicas need device 'cuda' (replica i "
                         "on cuda:i) or 'cpu'")
    if count < replicas:
        raise ValueError(f"{replicas} replicas need {replicas} CUDA devices (one each); this machine has {count}")
    return [f"cuda:{i}" for i in range(replicas)]


@dataclass
class RouterCounts:
    """The router's counters since it started.

    Attributes:
        requests: requests sent to each replica, by replica index (first sends and retries).
        reroutes: requests sent to a replica other than their home, the replica owning their user when every
            replica is on the ring (their own was dead or taken off).
        retries: requests whose replica died after accepting them, sent again to their user's next replica.
        restarts: dead replicas started again (:meth:`ReplicaRouter.restart`).
    """

    requests: dict[int, int] = field(default_factory=dict)
    reroutes: int = 0
    retries: int = 0
    restarts: int = 0


def _user_of(request: Any) -> object:
    return getattr(request, "user_id", None)


class ReplicaRouter:
    """Serve requests through ``replicas`` engine cores, each user on one replica (consistent hashing).

    Args:
        config: the engine configuration of every replica (each gets its device from :func:`replica_devices`;
            ``config.serving``'s admission bounds hold per replica).
        replicas: how many engine cores to run (replica indices ``0 .. replicas - 1``).
        virtual_nodes: points of each replica on the ring (:class:`~gr_engine.routing.HashRing`).
        engines: the replicas to route over, by index ``0 .. replicas - 1``, instead of starting engine cores here:
            objects with :class:`~.client.AsyncGREngine`'s ``start``, ``close``, ``rank_many``, ``generate_many``,
            ``is_alive``, ``is_healthy``, ``state``, ``core_pid``, ``stats``, ``config`` and ``observers``, and
            two coroutines :meth:`supervise` calls: ``poll()`` (refresh ``stats`` and liveness) and ``recover()``
            (whether a dead one answers again) (e.g. Ray Serve deployment handles, :mod:`.ray_serve`).

    Use ``async with ReplicaRouter(config, 3) as router:`` (or :meth:`start` and :meth:`close`); :meth:`rank_many`
    and :meth:`generate_many` behave as :class:`~.client.AsyncGREngine`'s. ``observers`` are called with every
    answered request's output, as the client's are (a request that no replica could answer: kind
    ``"unavailable"``).

    Attributes:
        engines: the replicas' clients, by replica index.
        devices: each replica's device, by index.
        ring: the live replicas on the ring (a dead or suspended one is off it).
        home_ring: every replica (changed only by :meth:`add_replica`): ``home_ring.route(user)`` is the user's
            home replica and ``home_ring.preference(user)`` the order in which its next replicas take it over.
        counts: :class:`RouterCounts`.
        dead: the replicas whose core has died.
    """

    def __init__(self, config: EngineConfig, replicas: int, virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
                 engines: Mapping[int, Any] | None = None) -> None:
        self.config = config
        self._owns_engines = engines is None
        if engines is None:
            self.devices = replica_devices(config.device, replicas)
            self.engines = {i: AsyncGREngine(msgspec.structs.replace(config, device=d))
                            for i, d in enumerate(self.devices)}
        else:
            if sorted(engines) != list(range(replicas)):
                raise ValueError(f"engines must be keyed by replica index 0 .. {replicas - 1}, got {sorted(engines)}")
            self.engines = dict(sorted(engines.items()))
            self.devices = [engine.config.device for engine in self.engines.values()]
        self.ring = HashRing(self.engines, virtual_nodes)  # the live replicas that take users
        self.home_ring = HashRing(self.engines, virtual_nodes)  # every replica: each user's home
        self.counts = RouterCounts(requests=dict.fromkeys(self.engines, 0))
        self.observers: list[OutputObserver] = []
        self.dead: set[int] = set()
        self.started = False
        for engine in self.engines.values():
            engine.observers.append(self._observe)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> ReplicaRouter:
        """Start every replica's core and wait until all have warmed up.

        Raises:
            EngineDead: a replica's core exited before it was ready (the others are stopped again).
        """
        results = await asyncio.gather(*(e.start() for e in self.engines.values()), return_exceptions=True)
        failed = [(i, r) for i, r in zip(self.engines, results) if isinstance(r, BaseException)]
        if failed:
            await self.close()
            i, error = failed[0]
            raise EngineDead(f"replica {i} ({self.devices[i]}) did not start: {error}") from error
        self.started = True
        return self

    async def close(self, timeout_s: float = 60.0) -> None:
        """Let every replica answer its accepted requests, then stop their cores (:meth:`AsyncGREngine.close`)."""
        await asyncio.gather(*(e.close(timeout_s) for e in self.engines.values()))
        self.started = False

    async def __aenter__(self) -> ReplicaRouter:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def state(self) -> str:
        """``"ready"`` while started with a replica alive, ``"dead"`` once none is, else ``"stopped"``."""
        if not self.started:
            return "stopped"
        self._prune()
        return "ready" if len(self.ring) else "dead"

    def is_healthy(self) -> bool:
        """Whether at least one replica on the ring is healthy (:meth:`AsyncGREngine.is_healthy`)."""
        self._prune()
        return any(self.engines[r].is_healthy() for r in self.ring.replicas)

    def replica_states(self) -> list[dict[str, Any]]:
        """Each replica: ``replica`` (index), ``device``, ``state`` (its client's, or ``"dead"``), ``core_pid``,
        ``on_ring``."""
        self._prune()
        return [{"replica": i, "device": self.devices[i], "state": "dead" if i in self.dead else e.state,
                 "core_pid": e.core_pid, "on_ring": i in self.ring} for i, e in self.engines.items()]

    def suspend(self, replica: int) -> None:
        """Take a live replica off the ring (drain it): its users go on to their next replica; its KV stays."""
        if replica not in self.ring:
            raise ValueError(f"replica {replica} is not on the ring")
        if len(self.ring) == 1:
            raise ValueError(f"replica {replica} is the last one on the ring")
        self.ring.remove(replica)

    def resume(self, replica: int) -> None:
        """Put a suspended replica back on the ring: its users return to it (it validates their older KV)."""
        self._prune()
        if replica not in self.engines or replica in self.ring or replica in self.dead:
            raise ValueError(f"replica {replica} is not a live replica off the ring")
        self.ring.add(replica)

    async def add_replica(self, device: str | None = None) -> int:
        """Start one more replica, an engine core on ``device`` (default: as :func:`replica_devices` places the
        next replica), and once it has warmed up put it on the ring: it takes over about 1/(N+1) of the users
        (their history is computed there once), and nobody else moves. Returns its index.

        Raises:
            ValueError: the router routes over given engines (Ray Serve: deploy more replicas instead), or there
                is no device for one more replica.
            EngineDead: its core exited before it was ready (nothing changed).
        """
        if not self._owns_engines:
            raise ValueError("a router over given engines cannot start replicas")
        replica = len(self.engines)
        device = device or replica_devices(self.config.device, replica + 1)[replica]
        self.engines[replica] = await self._start_engine(device, [self._observe])
        self.devices.append(device)
        self.counts.requests[replica] = 0
        self.home_ring.add(replica)
        self.ring.add(replica)
        logger.info("replica %d (%s) added; %d on the ring", replica, device, len(self.ring))
        return replica

    async def restart(self, replica: int) -> None:
        """Start a new engine core for a dead replica, on its device, and once it has warmed up put it back on the
        ring: its users return to it, where their history is computed once more (the new core holds no KV). Over
        given engines, the replica is put back once its ``recover()`` says it answers again (Ray Serve replaces a
        dead deployment replica itself).

        Raises:
            ValueError: the replica is not dead.
            EngineDead: the new core exited before it was ready, or the given engine does not answer yet (the
                replica stays dead).
        """
        self._prune()
        if replica not in self.dead:
            raise ValueError(f"replica {replica} is not dead")
        if not self._owns_engines:
            if not await self.engines[replica].recover():
                raise EngineDead(f"replica {replica} cannot be reached yet")
            self._revive(replica)
            return
        old = self.engines[replica]
        await old.close()  # the dead core's sockets
        self.engines[replica] = await self._start_engine(self.devices[replica], old.observers)  # router's and users'
        self._revive(replica)

    async def _start_engine(self, device: str, observers: list[OutputObserver]) -> AsyncGREngine:
        """A started (warmed-up) engine core on ``device`` with these ``observers``; none is left behind if its
        start fails or is cancelled."""
        engine = AsyncGREngine(msgspec.structs.replace(self.config, device=device))
        engine.observers[:] = observers
        try:
            await engine.start()
        except BaseException:
            await engine.close()
            raise
        return engine

    def _revive(self, replica: int) -> None:
        self.dead.discard(replica)
        self.ring.add(replica)
        self.counts.restarts += 1
        logger.info("replica %d (%s): restarted; its users are back on it", replica, self.devices[replica])

    async def supervise(self, backoff_s: float = RESTART_BACKOFF_S) -> None:
        """Restart dead replicas (:meth:`restart`) for as long as it runs (the API server runs it beside the router;
        cancel it before :meth:`close`), and over given engines poll each live one (``poll()``: its core's figures):
        every :data:`SUPERVISE_POLL_S` seconds; after a failed restart the next try waits ``backoff_s`` seconds,
        doubled at each further failure up to a minute."""
        wait = backoff_s
        while True:
            await asyncio.sleep(SUPERVISE_POLL_S)
            if not self.started:
                continue
            if not self._owns_engines:
                await asyncio.gather(*(self.engines[r].poll() for r in self.engines if r not in self.dead))
            self._prune()
            for replica in sorted(self.dead):
                try:
                    await self.restart(replica)
                    wait = backoff_s
                except EngineDead:
                    logger.warning("replica %d: not restarted (next try in %.0f s)", replica, wait, exc_info=True)
                    await asyncio.sleep(wait)
                    wait = min(wait * 2, 60.0)
                    break

    def _prune(self) -> None:
        """Take every replica whose core has died off the ring."""
        for replica, engine in self.engines.items():
            if self.started and replica not in self.dead and not engine.is_alive():
                self._lose(replica)

    def _lose(self, replica: int) -> None:
        if replica in self.dead:
            return
        self.dead.add(replica)
        if replica in self.ring:
            self.ring.remove(replica)
        logger.error("replica %d (%s): its engine core is dead; its users go to their next replica (%d left)",
                     replica, self.devices[replica], len(self.ring))

    # ------------------------------------------------------------------ requests
    async def rank(self, request: RankRequest, timeout_ms: float | None = None) -> RankOutput:
        """Score one request's candidates on its user's replica; see :meth:`rank_many`."""
        return (await self.rank_many([request], timeout_ms))[0]

    async def generate(self, request: GenerateRequest, params: GenerateParams | None = None,
                       timeout_ms: float | None = None) -> GenerateOutput:
        """Retrieve items for one request on its user's replica; see :meth:`rank_many`."""
        return (await self.generate_many([request], params, timeout_ms))[0]

    async def rank_many(self, requests: Sequence[RankRequest], timeout_ms: float | None = None) -> list[RankOutput]:
        """Score several requests, each on its user's replica; outputs in input order (a failed request's output
        carries its ``error``).

        Raises:
            EngineOverloaded: a replica would exceed its pending bounds (nothing of the call is served).
            EngineDead: no replica is alive.
        """
        return await self._submit(requests, None, timeout_ms)

    async def generate_many(self, requests: Sequence[GenerateRequest], params: GenerateParams | None = None,
                            timeout_ms: float | None = None) -> list[GenerateOutput]:
        """Retrieve items for several requests, each on its user's replica; as :meth:`rank_many`."""
        return await self._submit(requests, params or GenerateParams(), timeout_ms)

    async def _submit(self, requests: Sequence[Request], params: GenerateParams | None,
                      timeout_ms: float | None) -> list:
        if not self.started:
            raise EngineDead("the router is not started")
        self._prune()
        if not len(self.ring):
            raise EngineDead("no replica is alive")
        if not requests:
            return []
        deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms is not None else None
        parts = self.ring.split(requests, _user_of)
        tasks = {}
        for replica, part in parts.items():
            self._count(replica, [r for _, r in part])
            tasks[replica] = asyncio.create_task(self._serve_part(replica, part, params, deadline, timeout_ms))
        try:
            await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            await _cancel(tasks.values())
            raise
        failed = [t for t in tasks.values() if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:  # overloaded: the other parts are withdrawn (the client aborts what has not started)
            await _cancel(tasks.values())
            raise failed[0].exception()
        return HashRing.merge({replica: task.result() for replica, task in tasks.items()})

    async def _serve_part(self, replica: int, part: list[tuple[int, Request]], params: GenerateParams | None,
                          deadline: float | None, timeout_ms: float | None) -> list[tuple[int, Output]]:
        """One replica's share of a call: ``(index in the call, output)`` pairs; retried once elsewhere if the
        replica dies (raises :class:`EngineOverloaded` only from the first send)."""
        indices, requests = [i for i, _ in part], [r for _, r in part]
        try:
            return list(zip(indices, await self._send(replica, requests, params, timeout_ms)))
        except EngineDead as exc:
            self._lose(replica)
            lost = f"replica {replica} died before answering ({exc})"
        self.counts.retries += len(requests)
        if not len(self.ring):
            return [(i, self._failed(r, params, f"{lost}; no replica is left", "unavailable"))
                    for i, r in zip(indices, requests)]
        retried = self.ring.split(requests, _user_of)
        answers = await asyncio.gather(*(self._retry(r, [q for _, q in p], params, deadline, timeout_ms, lost)
                                         for r, p in retried.items()))
        outputs = HashRing.merge({r: list(zip([k for k, _ in p], a)) for (r, p), a in zip(retried.items(), answers)})
        return list(zip(indices, outputs))

    async def _retry(self, replica: int, requests: list[Request], params: GenerateParams | None,
                     deadline: float | None, timeout_ms: float | None, lost: str) -> list[Output]:
        """The second and last send of requests whose replica died: their outputs, or errors saying both why."""
        self._count(replica, requests)
        if deadline is not None and deadline <= time.monotonic():
            return [self._failed(r, params, f"deadline exceeded ({timeout_ms:g} ms)", "timeout") for r in requests]
        try:
            outputs = await self._send(replica, requests, params, (deadline - time.monotonic()) * 1000
                                       if deadline is not None else None)
        except (EngineDead, EngineOverloaded) as exc:
            if isinstance(exc, EngineDead):
                self._lose(replica)
            return [self._failed(r, params, f"{lost}; the retry on replica {replica} failed too ({exc})",
                                 "unavailable") for r in requests]
        for output in outputs:  # the client names the time left it was given; the caller gave the call's
            if output.error is not None and output.error.startswith("deadline exceeded"):
                output.error = f"deadline exceeded ({timeout_ms:g} ms)"
        return outputs

    async def _send(self, replica: int, requests: list[Request], params: GenerateParams | None,
                    timeout_ms: float | None) -> list[Output]:
        engine = self.engines[replica]
        if params is None:
            return await engine.rank_many(requests, timeout_ms)
        return await engine.generate_many(requests, params, timeout_ms)

    def _count(self, replica: int, requests: list[Request]) -> None:
        self.counts.requests[replica] += len(requests)
        if len(self.ring) < len(self.engines):
            self.counts.reroutes += sum(home != replica for home in self.home_ring.route_many(map(_user_of, requests)))

    def _failed(self, request: Request, params: GenerateParams | None, error: str, kind: str) -> Output:
        output = (RankOutput if params is None else GenerateOutput)(
            request_id=str(getattr(request, "request_id", "")), user_id=output_user_id(_user_of(request)), error=error)
        self._observe(output, kind, 0.0)
        return output

    def _observe(self, output: Output, kind: str | None, queue_s: float) -> None:
        for observe in self.observers:
            observe(output, kind, queue_s)


async def _cancel(tasks: Any) -> None:
    """Cancel the unfinished ``tasks`` and wait for them (their requests are aborted in the cores)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

