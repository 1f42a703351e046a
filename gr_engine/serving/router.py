"""``ReplicaRouter``: N engine-core replicas behind one asyncio API, users kept on their replica (docs/scale_out.md).

A request goes to the replica that owns its ``user_id`` on a :class:`~gr_engine.routing.HashRing` of the live
replicas, so that a returning user finds its KV cache there. A call spanning users is split by replica, the parts are
served concurrently and the outputs merged back in input order. The replicas themselves (their engine cores, devices,
the ring, dead replicas taken off it and started again) are :class:`~.replicas.ReplicaSet`'s, which the router
extends.

Faults: a replica whose core has died is off the ring, and its users go on to their next replica, which recomputes
what it lacks (the engine's prefix checks keep every answer exact). So is a replica whose core is alive but has
stopped reporting (``"unresponsive"`` in ``/health``), for as long as it stays silent: it is back on the ring once it
reports again, and the requests it had accepted keep waiting on it until their deadline (they are never sent twice).
A request that its replica accepted but did not answer before dying is sent once more, to its user's next replica;
if that fails too, its output carries the error (never lost, never waited on past its deadline).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from ..intake import request_labels
from ..outputs import GenerateOutput, RankOutput
from ..request import GenerateParams, GenerateRequest, RankRequest
from ..routing import HashRing
from .admission import EngineOverloaded, deadline_after, deadline_exceeded
from .client import EngineDead
from .replicas import ReplicaSet

Request = RankRequest | GenerateRequest
Output = RankOutput | GenerateOutput


def _user_of(request: Any) -> object:
    return getattr(request, "user_id", None)


class ReplicaRouter(ReplicaSet):
    """Serve requests through ``replicas`` engine cores, each user on one replica (consistent hashing).

    Args and attributes: :class:`~.replicas.ReplicaSet`'s (``engines``, ``devices``, ``ring``, ``home_ring``,
    ``counts``, ``dead``), as are starting, stopping, health, :meth:`suspend`, :meth:`resume`, :meth:`add_replica`,
    :meth:`restart` and :meth:`supervise`.

    Use ``async with ReplicaRouter(config, 3) as router:`` (or :meth:`start` and :meth:`close`); :meth:`rank_many`
    and :meth:`generate_many` behave as :class:`~.client.AsyncGREngine`'s. ``observers`` are called with every
    answered request's output, as the client's are (a request that no replica could answer: kind
    ``"unavailable"``). ``counts`` gets each send (``requests``, ``reroutes``) and retry (``retries``).
    """

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
            ValueError: ``timeout_ms`` is NaN or negative (nothing is sent).
        """
        return await self._submit(requests, None, timeout_ms)

    async def generate_many(self, requests: Sequence[GenerateRequest], params: GenerateParams | None = None,
                            timeout_ms: float | None = None) -> list[GenerateOutput]:
        """Retrieve items for several requests, each on its user's replica; as :meth:`rank_many`."""
        return await self._submit(requests, params or GenerateParams(), timeout_ms)

    async def _submit(self, requests: Sequence[Request], params: GenerateParams | None,
                      timeout_ms: float | None) -> list:
        if not isinstance(requests, Sequence):  # (routing an iterator would consume it: nothing would be sent)
            raise TypeError(f"requests must be a sequence (a list), got {type(requests).__name__}")
        if not self.started:
            raise EngineDead("the router is not started")
        self._prune()
        if not len(self.ring):
            raise EngineDead("no replica is alive")
        if not requests:
            return []
        deadline = deadline_after(time.monotonic(), timeout_ms)
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
            self._prune()  # the retry goes by the ring as it is now (silent replicas off it)
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
            return [self._failed(r, params, deadline_exceeded(timeout_ms), "timeout") for r in requests]
        try:
            left_ms = None if deadline is None else max(deadline - time.monotonic(), 0.0) * 1000  # passed since?
            outputs = await self._send(replica, requests, params, left_ms)
        except (EngineDead, EngineOverloaded) as exc:
            if isinstance(exc, EngineDead):
                self._lose(replica)
            return [self._failed(r, params, f"{lost}; the retry on replica {replica} failed too ({exc})",
                                 "unavailable") for r in requests]
        for output in outputs:  # the client names the time left it was given; the caller gave the call's
            if output.error is not None and output.error.startswith("deadline exceeded"):
                output.error = deadline_exceeded(timeout_ms)
        return outputs

    async def _send(self, replica: int, requests: list[Request], params: GenerateParams | None,
                    timeout_ms: float | None) -> list[Output]:
        """``requests`` through ``replica``'s client, ranked (``params`` None) or retrieved, within ``timeout_ms``."""
        engine = self.engines[replica]
        if params is None:
            return await engine.rank_many(requests, timeout_ms)
        return await engine.generate_many(requests, params, timeout_ms)

    def _count(self, replica: int, requests: list[Request]) -> None:
        """Count ``requests`` as sent to ``replica``, and those of them whose home is another replica as rerouted."""
        self.counts.requests[replica] += len(requests)
        if len(self.ring) < len(self.engines):
            self.counts.reroutes += sum(home != replica for home in self.home_ring.route_many(map(_user_of, requests)))

    def _failed(self, request: Request, params: GenerateParams | None, error: str, kind: str) -> Output:
        """The output of a request that no replica answered, carrying ``error``; observed with error kind ``kind``."""
        request_id, user_id = request_labels(request)
        output = (RankOutput if params is None else GenerateOutput)(request_id=request_id, user_id=user_id, error=error)
        self._observe(output, kind, 0.0)
        return output


async def _cancel(tasks: Any) -> None:
    """Cancel the unfinished ``tasks`` and wait for them (their requests are aborted in the cores)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

