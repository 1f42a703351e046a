"""The HTTP server (Starlette on uvicorn) in front of an :class:`~.client.AsyncGREngine` (docs/serving.md).

Endpoints: ``POST /v1/rank``, ``POST /v1/generate``, ``GET /health``, ``GET /ready``, ``GET /v1/config``,
``GET /metrics``. Bodies are JSON decoded by msgspec; each request of a body is decoded on its own, so a malformed
one gets its ``error`` in its output while its batch-mates are served. A body that is not JSON, or has no
``requests`` list, is a 400; one over ``serving.max_body_bytes`` a 413; work beyond the admission bounds a 503 with
``Retry-After``. SIGTERM stops accepting connections, finishes what was accepted, lets the core complete its pending
offloads, and exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..config import EngineConfig
from ..io import array_as_lists
from ..outputs import GenerateOutput, RankOutput, output_user_id
from ..request import GenerateParams, GenerateRequest, RankRequest
from .client import AsyncGREngine, EngineDead, EngineOverloaded
from .metrics import CONTENT_TYPE, ServingMetrics

logger = logging.getLogger(__name__)


class RankBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/rank``: ``requests`` (each a :class:`~gr_engine.RankRequest`) and an optional deadline (ms)."""

    requests: list[msgspec.Raw]
    timeout_ms: float | None = None


class GenerateBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/generate``: ``requests`` (each a :class:`~gr_engine.GenerateRequest`), retrieval ``params`` and
    an optional deadline (ms)."""

    requests: list[msgspec.Raw]
    params: GenerateParams = msgspec.field(default_factory=GenerateParams)
    timeout_ms: float | None = None


class _BodyTooLarge(Exception):
    pass


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_ENCODER.encode(data), status_code=status, media_type="application/json", headers=headers)


_ENCODER = msgspec.json.Encoder(enc_hook=array_as_lists)  # ranking scores (numpy) as nested lists


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return _json({"error": message}, status, headers)


def build_app(config: EngineConfig) -> Starlette:
    """The ASGI application; its lifespan starts the engine core (ready once warmed up) and stops it."""
    serving = config.serving
    engine = AsyncGREngine(config)
    metrics = ServingMetrics(engine)
    bodies = {"accepted": 0, "answered": 0}  # request bodies read, and answered (any status)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await engine.start()
        logger.info("gr-engine: the engine core is ready")
        try:
            yield
        finally:
            await engine.close()
            logger.info("gr-engine: stopped; answered %d of %d request bodies accepted", bodies["answered"],
                        bodies["accepted"])

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > serving.max_body_bytes:
            raise _BodyTooLarge
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > serving.max_body_bytes:
                raise _BodyTooLarge
        return bytes(body)

    async def serve(request: Request, body_type: type, request_type: type, failed_type: type) -> Response:
        bodies["accepted"] += 1
        try:
            return await answer(request, body_type, request_type, failed_type)
        finally:
            bodies["answered"] += 1
            metrics.count_body()

    async def answer(request: Request, body_type: type, request_type: type, failed_type: type) -> Response:
        try:
            raw = await read_body(request)
            body = msgspec.json.decode(raw, type=body_type)
        except _BodyTooLarge:
            metrics.count_refused("bad_request")
            return _error(413, f"request body over serving.max_body_bytes ({serving.max_body_bytes})")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            metrics.count_refused("bad_request")
            return _error(400, f"invalid body: {exc}")
        outputs: list[Any] = [None] * len(body.requests)
        parsed, where = [], []
        for i, item in enumerate(body.requests):
            try:
                parsed.append(msgspec.json.decode(item, type=request_type))
                where.append(i)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                fields = _lenient_fields(item)
                outputs[i] = failed_type(request_id=str(fields.get("request_id", f"request-{i}")),
                                         user_id=output_user_id(fields.get("user_id")),
                                         error=f"invalid request: {exc}")
                metrics.observe_output(outputs[i], "invalid", 0.0)
        try:
            if request_type is RankRequest:
                served = await engine.rank_many(parsed, body.timeout_ms)
            else:
                served = await engine.generate_many(parsed, body.params, body.timeout_ms)
        except EngineOverloaded as exc:
            metrics.count_refused("overloaded", len(parsed))
            return _error(503, str(exc), {"Retry-After": "1"})
        except EngineDead as exc:
            metrics.count_refused("unavailable", len(parsed))
            return _error(503, str(exc))
        for i, output in zip(where, served, strict=True):
            outputs[i] = output
        return _json({"outputs": outputs})

    async def rank(request: Request) -> Response:
        return await serve(request, RankBody, RankRequest, RankOutput)

    async def generate(request: Request) -> Response:
        return await serve(request, GenerateBody, GenerateRequest, GenerateOutput)

    async def health(request: Request) -> Response:
        healthy = engine.is_healthy()
        return _json({"status": "ok" if healthy else engine.state, "core_pid": engine.core_pid},
                     200 if healthy else 503)

    async def ready(request: Request) -> Response:
        is_ready = engine.state == "ready" and engine.is_healthy()
        return _json({"status": "ready" if is_ready else engine.state}, 200 if is_ready else 503)

    async def show_config(request: Request) -> Response:
        return _json(config)

    async def show_metrics(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app = Starlette(lifespan=lifespan, routes=[
        Route("/v1/rank", rank, methods=["POST"]),
        Route("/v1/generate", generate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/v1/config", show_config, methods=["GET"]),
        Route("/metrics", show_metrics, methods=["GET"]),
    ])
    app.state.engine, app.state.metrics = engine, metrics
    return app


def _lenient_fields(item: msgspec.Raw) -> dict[str, Any]:
    """A malformed request's fields where they can be read (to label its error output)."""
    with contextlib.suppress(msgspec.DecodeError):
        fields = msgspec.json.decode(item)
        if isinstance(fields, dict):
            return fields
    return {}


def serve(config: EngineConfig, host: str, port: int) -> None:
    """Run the server until SIGTERM or Ctrl-C (uvicorn's graceful shutdown: accepted requests are answered), then
    return. (uvicorn raises the signal it caught again once it has shut down, to the handler that was installed
    before it: a no-op here, so that a graceful stop exits 0.)"""
    import uvicorn

    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, lambda *_: None)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    uvicorn.run(build_app(config), host=host, port=port, log_level="info", access_log=False,
                timeout_graceful_shutdown=None)

