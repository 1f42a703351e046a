"""The replica router on Ray Serve (docs/scale_out.md, "On Ray Serve").

:func:`build_app` gives a Ray Serve application of ``N + 1`` deployments:

- ``engine-0 .. engine-{N-1}``: one engine replica each (:class:`EngineReplica`, one Ray Serve replica), an
  :class:`~.client.AsyncGREngine` with an engine-core process of its own, on a GPU of its own when the configured
  device is CUDA (``ray_actor_options={"num_gpus": 1}``), else on the CPU;
- ``ingress``: the HTTP server of :mod:`.server` (same endpoints, bodies, errors and metrics) over a
  :class:`~.router.ReplicaRouter` whose replicas are the engine deployments' handles: each user's requests go to
  one deployment (a :class:`~gr_engine.routing.HashRing` of ``user_id``), a body is split by replica and the
  outputs merged in input order. A handle call that fails because its replica's actor died takes that replica off
  the ring, and its requests are sent once more, to their users' next replica (else each output carries the
  error), as the router does for a dead engine core; once Ray Serve has replaced the actor, the replica is back on
  the ring (:meth:`~.router.ReplicaRouter.supervise`). The ingress polls each deployment's engine state and core
  figures (:meth:`EngineReplica.health`): a deployment whose core is alive but has stopped reporting is
  ``"unresponsive"`` in ``/health`` and off the ring while it stays silent (its users go to their next replica; the
  requests it had accepted keep their deadlines and are never sent again), and back on it, with its KV, once it
  reports again, as with local replicas (:mod:`.replicas`); Ray Serve's health check fails only for a dead core, so
  Serve does not replace a silent one. ``/metrics`` has each replica's core figures.

Ray is an optional dependency (``pip install 'gr-engine[ray]'``): ``import gr_engine`` never imports this module.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Awaitable, Sequence
from typing import Any

import msgspec
import ray
from ray import serve
from ray.exceptions import RayError, RayTaskError
from starlette.applications import Starlette

from ..config import EngineConfig
from ..outputs import GenerateOutput, RankOutput
from ..request import GenerateParams, GenerateRequest, RankRequest
from .admission import EngineOverloaded
from .client import AsyncGREngine, EngineDead, OutputObserver, reported_state
from .protocol import CoreStats
from .router import ReplicaRouter
from .server import build_app as build_starlette_app

Output = RankOutput | GenerateOutput
#: How long :meth:`_HandleReplica.recover` waits for a dead replica's deployment to answer again (s).
RECOVER_TIMEOUT_S = 10.0
#: What an engine replica answers for each request: its output, its error kind (``None`` when served; as
#: :data:`~.client.OutputObserver` is given) and the seconds it spent queued in the core.
Answer = tuple[Output, str | None, float]


class EngineReplica:
    """One engine replica (a Ray Serve deployment of one replica): an :class:`~.client.AsyncGREngine` whose engine
    core is started, and warmed up, in the constructor and stopped when Ray Serve stops the replica.

    Args:
        config: the engine's configuration (its device as seen inside this replica's actor).
    """

    async def __init__(self, config: EngineConfig) -> None:
        self.engine = AsyncGREngine(config)
        self._observed: dict[int, tuple[str | None, float]] = {}  # id(output) -> (error kind, queue s), in flight
        self._calls = 0  # calls in flight: once none is, no observation is still waited for
        self.engine.observers.append(self._observe)
        await self.engine.start()

    async def rank_many(self, requests: Sequence[RankRequest], timeout_ms: float | None = None) -> list[Answer]:
        """Score ``requests`` (:meth:`AsyncGREngine.rank_many`): an :data:`Answer` per request, in input order.

        Raises:
            EngineOverloaded: the requests would exceed the engine's pending bounds (none is served).
            EngineDead: the engine core has died.
        """
        return await self._answers(self.engine.rank_many(requests, timeout_ms))

    async def generate_many(self, requests: Sequence[GenerateRequest], params: GenerateParams | None = None,
                            timeout_ms: float | None = None) -> list[Answer]:
        """Retrieve items for ``requests`` (:meth:`AsyncGREngine.generate_many`); as :meth:`rank_many`."""
        return await self._answers(self.engine.generate_many(requests, params, timeout_ms))

    def health(self) -> tuple[str, CoreStats | None]:
        """What the ingress polls: the engine's state as ``/health`` gives it (:func:`~.client.reported_state`:
        ``"ready"``; ``"unresponsive"`` while its core is alive but has not reported within
        ``serving.health_timeout_s``; ``"dead"`` once the core has died) and the core's latest counters."""
        return reported_state(self.engine), self.engine.stats

    def check_health(self) -> None:
        """Ray Serve's health check: raises ``RuntimeError`` once the engine core has died (Serve then replaces
        this replica; the ingress has taken it off its ring at its first failed call or poll). A core that is
        alive but silent (``"unresponsive"``) passes: replacing the replica would lose its KV cache for what may be
        a pause; the ingress takes it off its ring instead, for as long as it stays silent (:meth:`health`)."""
        if not self.engine.is_alive():
            raise RuntimeError(f"the engine core is {self.engine.state}")

    async def __del__(self) -> None:
        await self.engine.close()

    def _observe(self, output: Output, kind: str | None, queue_s: float) -> None:
        self._observed[id(output)] = (kind, queue_s)

    async def _answers(self, call: Awaitable[list[Output]]) -> list[Answer]:
        """``call``'s outputs with their observations. A call that raises (overloaded, cancelled) may leave
        observations of outputs nobody will ask for (requests refused as invalid): dropped once no call is in
        flight."""
        self._calls += 1
        try:
            outputs = await call
            return [(output, *self._observed.pop(id(output), (None, 0.0))) for output in outputs]
        finally:
            self._calls -= 1
            if not self._calls:
                self._observed.clear()


class _HandleReplica:
    """An engine deployment's handle as one of :class:`~.router.ReplicaRouter`'s replicas (the interface of
    :class:`~.client.AsyncGREngine` that the router uses, and the ``poll`` and ``recover`` of a given engine). Its
    engine's :class:`EngineOverloaded` and :class:`EngineDead` come through as themselves; a call that Ray could not
    complete (the replica's actor died or is unreachable) raises :class:`EngineDead`, and the replica counts as dead
    until :meth:`recover` reaches its deployment again (Ray Serve replaces a dead replica's actor). Its health is its
    engine's as of the last :meth:`poll`: a deployment whose core is alive but silent is ``"unresponsive"``
    (:func:`~.client.reported_state`), which takes it off the router's ring until a poll finds it reporting again.
    """

    core_pid = None  # the core runs in another actor, perhaps on another node

    def __init__(self, handle: Any, config: EngineConfig) -> None:
        self.handle, self.config = handle, config
        self.observers: list[OutputObserver] = []
        self.alive = True
        self.reported = "ready"  # its engine's reported_state, as of the last poll (its constructor awaited start)
        self.stats: CoreStats | None = None  # its core's latest counters, as of the last poll

    async def poll(self, timeout_s: float = RECOVER_TIMEOUT_S) -> None:
        """Fetch the engine's reported state and its core's latest counters (:meth:`EngineReplica.health`, for the
        ring, ``/health`` and ``/metrics``): a replica that answers counts as alive unless its core has died, one Ray
        cannot reach as dead; one that takes over ``timeout_s`` keeps its state and counters."""
        try:
            self.reported, self.stats = await asyncio.wait_for(self.handle.health.remote(), timeout_s)
            self.alive = self.reported not in ("dead", "stopped")
        except RayError:
            self.alive = False
        except asyncio.TimeoutError:
            pass

    async def recover(self, timeout_s: float = RECOVER_TIMEOUT_S) -> bool:
        """Whether the deployment answers again with a live core (Ray Serve has replaced its actor; waits at most
        ``timeout_s``): then it counts as alive, with a new core holding no KV."""
        await self.poll(timeout_s)
        return self.alive

    async def start(self) -> _HandleReplica:
        return self

    async def close(self, timeout_s: float = 60.0) -> None:
        """Nothing to stop here: Ray Serve stops the engine deployments."""

    def is_alive(self) -> bool:
        return self.alive

    def is_healthy(self) -> bool:
        """Whether it is alive and its engine, as of the last poll, was not ``"unresponsive"``."""
        return self.alive and self.reported != "unresponsive"

    @property
    def state(self) -> str:
        """``"ready"`` or ``"dead"`` (:func:`~.client.reported_state` gives ``"unresponsive"`` for a silent one)."""
        return "ready" if self.alive else "dead"

    async def rank_many(self, requests: Sequence[RankRequest], timeout_ms: float | None = None) -> list[RankOutput]:
        return await self._call(self.handle.rank_many.remote(list(requests), timeout_ms))

    async def generate_many(self, requests: Sequence[GenerateRequest], params: GenerateParams | None = None,
                            timeout_ms: float | None = None) -> list[GenerateOutput]:
        return await self._call(self.handle.generate_many.remote(list(requests), params, timeout_ms))

    async def _call(self, response: Any) -> list:
        try:
            answers: list[Answer] = await response
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, EngineDead):
                self.alive = False
            if isinstance(cause, (EngineDead, EngineOverloaded)):
                raise type(cause)(str(cause)) from exc
            raise
        except RayError as exc:
            self.alive = False
            raise EngineDead(f"{type(exc).__name__}: {exc}") from exc
        for output, kind, queue_s in answers:
            for observe in self.observers:
                observe(output, kind, queue_s)
        return [output for output, _, _ in answers]


@serve.ingress()
class Ingress:
    """The HTTP ingress: :mod:`.server`'s Starlette app over a :class:`~.router.ReplicaRouter` of the engine
    deployments' handles (``engines[i]`` is replica ``i``)."""

    def __init__(self, config: EngineConfig, *engines: Any) -> None:
        replicas = {i: _HandleReplica(handle, config) for i, handle in enumerate(engines)}
        self.router = ReplicaRouter(config, len(replicas), engines=replicas)
        self.config = config

    def __serve_build_asgi_app__(self) -> Starlette:
        return build_starlette_app(self.config, router=self.router)


def build_app(config: EngineConfig, num_replicas: int) -> Any:
    """The Ray Serve application (a ``ray.serve.Application``) of ``num_replicas`` engine deployments behind one
    HTTP ingress; run it with ``serve.run(build_app(config, n))``.

    Each engine deployment is one Ray Serve replica (a user's KV cache lives in one place), with one GPU when
    ``config.device`` is ``"cuda"`` or ``"cuda:N"`` (its engine then uses the GPU Ray gives it), else none.
    Ray Serve's queue limit per replica (``max_ongoing_requests``) is ``serving.max_pending_requests``, so that the
    engine's own admission bounds (503 with ``Retry-After``) decide.

    Raises:
        ValueError: ``num_replicas`` below 1.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    on_gpu = config.device.startswith("cuda")
    replica_config = msgspec.structs.replace(config, device="cuda") if on_gpu else config
    limit = config.serving.max_pending_requests
    engines = [serve.deployment(EngineReplica, name=f"engine-{i}", num_replicas=1, max_ongoing_requests=limit,
                                ray_actor_options={"num_gpus": 1 if on_gpu else 0}).bind(replica_config)
               for i in range(num_replicas)]
    return serve.deployment(Ingress, name="ingress", max_ongoing_requests=limit).bind(config, *engines)


def serve_until_stopped(config: EngineConfig, host: str, port: int, num_replicas: int,
                        app_name: str = "gr-engine") -> None:
    """``gr-engine serve --ray``: join the Ray cluster that ``RAY_ADDRESS`` names (else start a local one), run
    :func:`build_app` as ``app_name`` with Ray Serve's HTTP proxy on ``host``:``port`` (a Serve instance already
    running on the cluster keeps its own address), and block until SIGTERM or Ctrl-C; then delete the application
    and disconnect (a local cluster stops with it)."""
    ray.init()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(config, num_replicas), name=app_name, route_prefix="/")
        while not stop.wait(1.0):
            pass
        serve.delete(app_name)
    finally:
        ray.shutdown()
