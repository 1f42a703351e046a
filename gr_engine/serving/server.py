"""The HTTP server (Starlette on uvicorn) in front of an :class:`~.client.AsyncGREngine` (docs/serving.md).

Endpoints: ``POST /v1/rank``, ``POST /v1/generate``, ``GET /health``, ``GET /ready``, ``GET /v1/config``,
``GET /metrics``. Bodies are JSON or msgpack (:mod:`.bodies`), decoded by msgspec; each request of a body is decoded
on its own, so a malformed one gets its ``error`` in its output while its batch-mates are served. A body that cannot
be decoded, or has no ``requests`` list, is a 400; one over ``serving.max_body_bytes`` a 413; work beyond the
admission bounds, or a body that would take the bodies being received over ``serving.max_reading_bytes``, a 503 with
``Retry-After``. SIGTERM stops accepting connections, finishes what was accepted, lets
the core complete its pending offloads, and exits 0. Several API-server processes over one core: :mod:`.launcher`;
one API server over several engine-core replicas (``--replicas N``): :mod:`.router`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from ..config import EngineConfig
from ..outputs import GenerateOutput, RankOutput, output_user_id
from ..validation import RequestError
from .admission import CallTooLarge, EngineOverloaded
from .bodies import JSON, BodyFormat, GenerateBody, RankBody, answer_format, request_format
from .client import AsyncGREngine, CoreHandle, EngineDead, reported_state
from .heap import freeze_heap
from .metrics import CONTENT_TYPE, ServingMetrics
from .router import ReplicaRouter

logger = logging.getLogger(__name__)


class _BodyTooLarge(Exception):
    pass


class _ServerBusy(Exception):
    """Receiving the body would take the bodies being received over ``serving.max_reading_bytes``."""


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return _answer(JSON, JSON.encode(data), status, headers)


def _answer(form: BodyFormat, content: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(content, status_code=status, media_type=form.media_type, headers=headers)


def _error(form: BodyFormat, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return _answer(form, form.encode({"error": message}), status, headers)


def build_app(config: EngineConfig, core: CoreHandle | None = None, server: int = 0, replicas: int = 1,
              router: ReplicaRouter | None = None) -> Starlette:
    """The ASGI application; its lifespan starts the engine core (or, given ``core``, attaches to that running
    one; or, with ``replicas > 1``, starts that many cores behind a :class:`~.router.ReplicaRouter`) and is ready
    once it has warmed up; at shutdown it stops the core (or leaves it).

    Args:
        config: the engine's configuration.
        core: a running core shared with other API servers (``gr-engine serve --api-servers N``).
        server: this API server's index among them (log lines, the ``server`` label of ``http_bodies_total``).
        replicas: engine cores to start, each user served by one of them (``gr-engine serve --replicas N``).
        router: serve through this router, over replicas started elsewhere (``replicas`` and ``core`` unused; the
            Ray Serve ingress, :mod:`.ray_serve`).

    Raises:
        ValueError: ``replicas`` below 1, or above 1 with ``core``; a device that cannot hold the replicas.
    """
    serving = config.serving
    if replicas < 1 or (replicas > 1 and core is not None):
        raise ValueError(f"replicas must be 1 with a shared core, at least 1 otherwise; got {replicas}")
    engine = router if router is not None else \
        ReplicaRouter(config, replicas) if replicas > 1 else AsyncGREngine(config, core)
    metrics = ServingMetrics(engine, server)
    # request bodies begun, answered (any status), and abandoned by their client before it sent them whole
    bodies = {"accepted": 0, "answered": 0, "gone": 0}
    receiving = {"bytes": 0}  # of the bodies being received (serving.max_reading_bytes)
    name = "gr-engine" if core is None else f"gr-engine API server {server}"

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await engine.start()
        frozen, _ = freeze_heap()
        logger.info("%s: the engine core is ready; %d objects frozen out of garbage collection", name, frozen)
        # Replicas whose core dies are started again (over Ray Serve's handles: put back once Serve replaced them).
        supervisor = asyncio.create_task(engine.supervise()) if isinstance(engine, ReplicaRouter) else None
        try:
            yield
        finally:
            if supervisor is not None:
                supervisor.cancel()
                await asyncio.gather(supervisor, return_exceptions=True)
            await engine.close()
            logger.info("%s: stopped; answered %d of %d request bodies accepted; %d clients left before sending "
                        "theirs", name, bodies["answered"], bodies["accepted"], bodies["gone"])

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        expected = int(declared) if declared is not None and declared.isdigit() else 0
        if expected > serving.max_body_bytes:
            raise _BodyTooLarge
        reserve(expected)  # the declared length at once: the bytes on their way count before they arrive
        held = expected
        try:
            body = bytearray()
            async with asyncio.timeout(serving.body_timeout_s):  # a client stalled mid-body must not hold shutdown
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > serving.max_body_bytes:
                        raise _BodyTooLarge
                    if len(body) > held:  # a body without a length (chunked) counts as it arrives
                        reserve(len(body) - held)
                        held = len(body)
            return bytes(body)
        finally:
            receiving["bytes"] -= held

    def reserve(size: int) -> None:
        if receiving["bytes"] + size > serving.max_reading_bytes:
            raise _ServerBusy
        receiving["bytes"] += size

    async def serve(request: Request, body_type: type, ranking: bool, failed_type: type) -> Response:
        bodies["accepted"] += 1
        try:
            response = await answer(request, body_type, ranking, failed_type)
        finally:
            metrics.count_body()
        bodies["gone" if response is None else "answered"] += 1
        return Response(status_code=400) if response is None else response  # None: nobody to answer

    async def answer(request: Request, body_type: type, ranking: bool, failed_type: type) -> Response | None:
        """The body's response, or None if its client left before sending it whole."""
        content_type = request.headers.get("content-type")
        decoding = request_format(content_type)
        answering = answer_format(request.headers.get("accept"), content_type)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":  # read as it is, a compressed body would be "malformed"
            metrics.count_refused("bad_request")
            return _error(answering, 415, f"Content-Encoding {encoding!r} is not supported: send the body as it is")
        try:
            body = decoding.decode_body(await read_body(request), body_type)
        except ClientDisconnect:
            return None
        except TimeoutError:
            metrics.count_refused("bad_request")
            return _error(answering, 408, f"request body not received within serving.body_timeout_s "
                                          f"({serving.body_timeout_s:g} s)")
        except _BodyTooLarge:
            metrics.count_refused("bad_request")
            return _error(answering, 413, f"request body over serving.max_body_bytes ({serving.max_body_bytes})")
        except _ServerBusy:
            metrics.count_refused("overloaded")
            return _error(answering, 503, f"the server is receiving {receiving['bytes']} bytes of request bodies, "
                                          f"near serving.max_reading_bytes ({serving.max_reading_bytes}): retry later",
                          {"Retry-After": "1"})
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            metrics.count_refused("bad_request")
            return _error(answering, 400, f"invalid body: {exc}")
        outputs: list[Any] = [None] * len(body.requests)
        parsed, where = [], []
        for i, item in enumerate(body.requests):
            try:
                parsed.append(decoding.decode_request(item, ranking))
                where.append(i)
            except (msgspec.DecodeError, msgspec.ValidationError, RequestError) as exc:
                fields = decoding.fields(item)
                outputs[i] = failed_type(request_id=str(fields.get("request_id", f"request-{i}")),
                                         user_id=output_user_id(fields.get("user_id")),
                                         error=f"invalid request: {exc}")
                metrics.observe_output(outputs[i], "invalid", 0.0)
        try:
            if ranking:
                served = await engine.rank_many(parsed, body.timeout_ms)
            else:
                served = await engine.generate_many(parsed, body.params, body.timeout_ms)
        except EngineOverloaded as exc:
            metrics.count_refused("overloaded", exc.refused)
            return _error(answering, 503, str(exc), {"Retry-After": "1"})
        except CallTooLarge as exc:  # retrying cannot help: not a 503
            metrics.count_refused("bad_request", exc.refused)  # those that failed validation were counted (invalid)
            return _error(answering, 413, str(exc))
        except EngineDead as exc:
            metrics.count_refused("unavailable", len(parsed) if exc.refused is None else exc.refused)
            return _error(answering, 503, str(exc))
        for i, output in zip(where, served, strict=True):
            outputs[i] = output
        return _answer(answering, answering.encode_outputs(outputs))

    async def rank(request: Request) -> Response:
        return await serve(request, RankBody, True, RankOutput)

    async def generate(request: Request) -> Response:
        return await serve(request, GenerateBody, False, GenerateOutput)

    async def health(request: Request) -> Response:
        healthy = engine.is_healthy()
        where = {"replicas": engine.replica_states()} if isinstance(engine, ReplicaRouter) else \
            {"core_pid": engine.core_pid}
        return _json({"status": "ok" if healthy else reported_state(engine), **where, "server": server},
                     200 if healthy else 503)

    async def ready(request: Request) -> Response:
        is_ready = engine.state == "ready" and engine.is_healthy()
        return _json({"status": "ready" if is_ready else reported_state(engine)}, 200 if is_ready else 503)

    async def show_config(request: Request) -> Response:
        return _json(config)

    async def show_metrics(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def http_error(request: Request, exc: HTTPException) -> Response:  # unknown paths and methods: JSON too
        return _json({"error": exc.detail}, exc.status_code, exc.headers)

    app = Starlette(lifespan=lifespan, exception_handlers={HTTPException: http_error}, routes=[
        Route("/v1/rank", rank, methods=["POST"]),
        Route("/v1/generate", generate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/v1/config", show_config, methods=["GET"]),
        Route("/metrics", show_metrics, methods=["GET"]),
    ])
    app.state.engine, app.state.metrics = engine, metrics
    return app


def serve(config: EngineConfig, host: str, port: int, replicas: int = 1) -> None:
    """Run one API server, with a core of its own (or ``replicas`` of them), on ``host``:``port`` until SIGTERM or
    Ctrl-C (:func:`run_app`). The address is bound first: one that cannot be listened on raises ``OSError`` before
    any engine is built (a warm-up of minutes is not spent on a port in use)."""
    [listener] = listen(host, port)
    run_app(build_app(config, replicas=replicas), [listener])


#: Pending connections a listening socket holds (uvicorn's default).
BACKLOG = 2048


def listen(host: str, port: int, count: int = 1) -> list[socket.socket]:
    """``count`` listening sockets on ``host``:``port``; several share it (``SO_REUSEPORT``: the kernel spreads new
    connections over them), one does not (a server already on the port makes it fail). Port 0 picks a free port, the
    same for all. Raises ``OSError`` naming the address when it cannot be listened on (in use, not this host's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    shared = count > 1
    listeners: list[socket.socket] = []
    try:
        for _ in range(count):
            listeners.append(socket.create_server((host, port), family=family, backlog=BACKLOG, reuse_port=shared))
            port = listeners[0].getsockname()[1]
    except OSError as exc:
        for listener in listeners:
            listener.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return listeners


def run_app(app: Starlette, sockets: list[socket.socket]) -> None:
    """Run ``app`` on uvicorn, listening on ``sockets`` (already bound: :func:`listen`), until SIGTERM or Ctrl-C
    (uvicorn's graceful shutdown: accepted requests are answered), then return; exit 3 if the application failed to
    start. (uvicorn raises the signal it caught again once it has shut down, to the handler that was installed before
    it: a no-op here, so that a graceful stop exits 0.)"""
    import uvicorn

    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, lambda *_: None)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=False, timeout_graceful_shutdown=None))
    server.run(sockets=sockets)
    if not server.started:
        sys.exit(3)  # uvicorn's exit status for a failed startup (its log says why)
