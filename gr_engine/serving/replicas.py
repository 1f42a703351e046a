"""``ReplicaSet``: the engine-core replicas behind a :class:`~.router.ReplicaRouter`, kept alive and on the ring
(docs/scale_out.md, "Replicas").

Each replica is an :class:`~.client.AsyncGREngine` with an engine-core process of its own, on a device of its own
(:func:`replica_devices`), with its own KV tiers and its own admission bounds. The set starts and stops them, keeps
the :class:`~gr_engine.routing.HashRing` of the live ones that the router sends users by, and changes it: a replica
whose core has died is taken off the ring (its users go on to their next replica; its KV is gone with it); one whose
core is alive but has stopped reporting (``"unresponsive"``, :func:`~.client.reported_state`) is off the ring while
it stays silent, and back on it with its KV once it reports again; a dead replica can be started again
(:meth:`ReplicaSet.restart`; the API server does so by itself, :meth:`ReplicaSet.supervise`), and its users then
return to it; a live one can be taken off and put back (:meth:`ReplicaSet.suspend`, :meth:`ReplicaSet.resume`); one
more can be added (:meth:`ReplicaSet.add_replica`).
Routing requests over the ring is :class:`~.router.ReplicaRouter`'s job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import torch

from ..config import EngineConfig
from ..outputs import GenerateOutput, RankOutput
from ..routing import DEFAULT_VIRTUAL_NODES, HashRing
from .client import AsyncGREngine, EngineDead, OutputObserver, reported_state

logger = logging.getLogger(__name__)

#: :meth:`ReplicaSet.supervise`: how often it looks for dead replicas (s), and its wait after a failed restart (s),
#: doubled at each further failure.
SUPERVISE_POLL_S = 0.5
RESTART_BACKOFF_S = 5.0

_Set = TypeVar("_Set", bound="ReplicaSet")


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
        restarts: dead replicas started again (:meth:`ReplicaSet.restart`).
    """

    requests: dict[int, int] = field(default_factory=dict)
    reroutes: int = 0
    retries: int = 0
    restarts: int = 0


class ReplicaSet:
    """``replicas`` engine cores, and the ring of those alive: the lifecycle half of :class:`~.router.ReplicaRouter`.

    Args:
        config: the engine configuration of every replica (each gets its device from :func:`replica_devices`;
            ``config.serving``'s admission bounds hold per replica).
        replicas: how many engine cores to run (replica indices ``0 .. replicas - 1``).
        virtual_nodes: points of each replica on the ring (:class:`~gr_engine.routing.HashRing`).
        engines: the replicas, by index ``0 .. replicas - 1``, instead of starting engine cores here: objects with
            :class:`~.client.AsyncGREngine`'s ``start``, ``close``, ``rank_many``, ``generate_many``, ``is_alive``,
            ``is_healthy``, ``state``, ``core_pid``, ``stats``, ``config`` and ``observers``, and two coroutines
            :meth:`supervise` calls: ``poll()`` (refresh ``stats`` and liveness) and ``recover()`` (whether a dead
            one answers again) (e.g. Ray Serve deployment handles, :mod:`.ray_serve`).

    Use ``async with`` (or :meth:`start` and :meth:`close`). ``observers`` are called with every output that any
    replica answers, as the client's are, whichever core (first, added or restarted) answered it.

    Attributes:
        engines: the replicas' clients, by replica index.
        devices: each replica's device, by index.
        ring: the replicas that take users: the live ones, less the suspended ones and those in ``unresponsive``.
        home_ring: every replica (changed only by :meth:`add_replica`): ``home_ring.route(user)`` is the user's
            home replica and ``home_ring.preference(user)`` the order in which its next replicas take it over.
        counts: :class:`RouterCounts` (each replica's request count from its start; restarts counted here).
        dead: the replicas whose core has died.
        unresponsive: the live replicas taken off the ring because they stopped reporting (their
            :func:`~.client.reported_state` is ``"unresponsive"``, the rule of ``/health``); each goes back on the ring
            once it reports again, and any that dies goes to ``dead``. Kept up to date before every call and by
            :meth:`supervise` (:meth:`_prune`). While none of the live, unsuspended replicas reports, none of them
            is off the ring for it (there is no better replica to send users to).
        started: between a successful :meth:`start` and :meth:`close`.
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
        self.unresponsive: set[int] = set()
        self.started = False
        for engine in self.engines.values():
            engine.observers.append(self._observe)

    async def start(self: _Set) -> _Set:
        """Start every replica's core and wait until all have warmed up; every replica is then on the ring (one that
        died, was suspended or stopped reporting before a :meth:`close` starts afresh).

        Raises:
            EngineDead: a replica's core exited before it was ready (the others are stopped again).
            RuntimeError: the set is started already (:meth:`close` it first).
        """
        if self.started:  # (each replica would refuse, and the failed start would close them all)
            raise RuntimeError("the replicas are started: close() them before starting them again")
        results = await asyncio.gather(*(e.start() for e in self.engines.values()), return_exceptions=True)
        failed = [(i, r) for i, r in zip(self.engines, results) if isinstance(r, BaseException)]
        if failed:
            await self.close()
            i, error = failed[0]
            raise EngineDead(f"replica {i} ({self.devices[i]}) did not start: {error}") from error
        self.dead.clear()
        self.unresponsive.clear()
        for replica in self.engines:
            if replica not in self.ring:
                self.ring.add(replica)
        self.started = True
        return self

    async def close(self, timeout_s: float = 60.0) -> None:
        """Let every replica answer its accepted requests, then stop their cores (:meth:`AsyncGREngine.close`: a core
        that takes longer than ``timeout_s`` seconds is killed)."""
        await asyncio.gather(*(e.close(timeout_s) for e in self.engines.values()))
        self.started = False

    async def __aenter__(self: _Set) -> _Set:
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
        """Each replica: ``replica`` (index), ``device``, ``state`` (its client's; ``"dead"``; or ``"unresponsive"``
        for a ready one that has not reported within ``serving.health_timeout_s``), ``core_pid``, ``on_ring``."""
        self._prune()
        return [{"replica": i, "device": self.devices[i], "state": "dead" if i in self.dead else reported_state(e),
                 "core_pid": e.core_pid, "on_ring": i in self.ring} for i, e in self.engines.items()]

    def suspend(self, replica: int) -> None:
        """Take a live replica off the ring (drain it): its users go on to their next replica; its KV stays. One off
        the ring as ``unresponsive`` then stays off when it reports again."""
        if replica in self.unresponsive:
            self.unresponsive.discard(replica)
            return
        if replica not in self.ring:
            raise ValueError(f"replica {replica} is not on the ring")
        if len(self.ring) == 1:
            raise ValueError(f"replica {replica} is the last one on the ring")
        self.ring.remove(replica)

    def resume(self, replica: int) -> None:
        """Put a suspended replica back on the ring: its users return to it (it validates their older KV).
        An ``unresponsive`` one is refused: it returns by itself once it reports again."""
        self._prune()
        if replica in self.unresponsive:
            raise ValueError(f"replica {replica} is unresponsive: it returns to the ring once it reports again")
        if replica not in self.engines or replica in self.ring or replica in self.dead:
            raise ValueError(f"replica {replica} is not a live replica off the ring")
        self.ring.add(replica)

    async def add_replica(self, device: str | None = None) -> int:
        """Start one more replica, an engine core on ``device`` (default: as :func:`replica_devices` places the
        next replica), and once it has warmed up put it on the ring: it takes over about 1/(N+1) of the users
        (their history is computed there once), and nobody else moves. Returns its index.

        Raises:
            ValueError: the set is over given engines (Ray Serve: deploy more replicas instead), or there is no
                device for one more replica.
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
        self.engines[replica] = await self._start_engine(self.devices[replica], old.observers)  # the set's and users'
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
        cancel it before :meth:`close`), take silent replicas off the ring and put them back once they report
        (:meth:`_prune`, also run before every call), and over given engines poll each live one (``poll()``: its
        core's figures): every :data:`SUPERVISE_POLL_S` seconds; after a failed restart the next try waits
        ``backoff_s`` seconds, doubled at each further failure up to a minute."""
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
        """Bring the ring up to date with the replicas' clients: take every replica whose core has died off it
        (:meth:`_lose`); take every live one whose :func:`~.client.reported_state` is ``"unresponsive"`` off it
        into ``unresponsive``, and put back every one there that reports again; unless none of the replicas that
        would be on the ring reports, in which case they all are (no better replica to send users to)."""
        if not self.started:
            return
        for replica, engine in self.engines.items():
            if replica not in self.dead and not engine.is_alive():
                self._lose(replica)
        serving = [r for r in self.engines if r in self.ring or r in self.unresponsive]  # live, not suspended
        silent = {r for r in serving if reported_state(self.engines[r]) == "unresponsive"}
        if len(silent) == len(serving):
            silent = set()
        for replica in serving:
            if replica in silent and replica in self.ring:
                self.ring.remove(replica)
                self.unresponsive.add(replica)
                logger.warning("replica %d (%s): unresponsive; its users go to their next replica until it reports "
                               "(%d left on the ring)", replica, self.devices[replica], len(self.ring))
            elif replica not in silent and replica in self.unresponsive:
                self.unresponsive.discard(replica)
                self.ring.add(replica)
                logger.info("replica %d (%s): reporting again; its users are back on it", replica,
                            self.devices[replica])

    def _lose(self, replica: int) -> None:
        """Mark ``replica`` dead and take it off the ring (its users go to their next replica); once only."""
        if replica in self.dead:
            return
        self.dead.add(replica)
        self.unresponsive.discard(replica)
        if replica in self.ring:
            self.ring.remove(replica)
        logger.error("replica %d (%s): its engine core is dead; its users go to their next replica (%d left)",
                     replica, self.devices[replica], len(self.ring))

    def _observe(self, output: RankOutput | GenerateOutput, kind: str | None, queue_s: float) -> None:
        """Pass one answered output on to every observer (``kind``: its error kind or None; ``queue_s``: seconds it
        spent in its core outside the steps that served it)."""
        for observe in self.observers:
            observe(output, kind, queue_s)
