"""``gr-engine serve --api-servers N``: one engine core and N API-server processes on one port (docs/serving.md).

The launcher binds N listening sockets on the one address (``SO_REUSEPORT``), starts the engine core
(:func:`~.core.start_core`, for N clients), then N API-server processes (``spawn``), each handed one socket: each runs
its own uvicorn and Starlette app (:func:`~.server.build_app`) whose :class:`~.client.AsyncGREngine` attaches to the
core (:class:`~.client.CoreHandle`) and admits ``1/N`` of the pending bounds. The kernel spreads new connections over
the sockets (a connection stays with the server that accepted it); the core sends each server the outputs of its
own requests. Metrics are in ``prometheus_client``'s multiprocess mode (a
folder of the launcher's), so any server's ``/metrics`` reports the sums over all of them.

SIGTERM (or Ctrl-C) to the launcher reaches every API server: each stops accepting, answers the bodies it has read,
and leaves the core, which finishes every request, completes pending offloads and exits; the launcher exits 0 when
all did. If an API server exits on its own, the launcher stops the others and exits 1; if the core exits, the API
servers answer 503 (``/health`` too) until stopped, and the launcher's status is 1.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from ..config import EngineConfig
from .client import CoreHandle
from .core import start_core
from .server import build_app, listen, run_app

logger = logging.getLogger(__name__)

_CORE_EXIT_S = 120.0  # how long the core may take to finish after the last API server has gone


def serve_many(config: EngineConfig, host: str, port: int, api_servers: int) -> int:
    """Serve on ``host``:``port`` from ``api_servers`` (>= 2) API-server processes over one engine core until
    SIGTERM or Ctrl-C; the exit status (0: every process stopped cleanly)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    listeners = listen(host, port, api_servers)  # OSError (the address cannot be listened on) before the core starts
    port = listeners[0].getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="gr-engine-") as folder, _multiprocess_metrics(Path(folder, "metrics")):
        address = f"ipc://{folder}/core"
        core = start_core(config, address, clients=api_servers)
        handle = CoreHandle(address, core.pid, api_servers)
        context = multiprocessing.get_context("spawn")
        servers = [context.Process(target=_api_server, name=f"gr-engine-api-{i}", daemon=False,
                                   args=(msgspec.json.encode(config), handle, listener, i))
                   for i, listener in enumerate(listeners)]
        for server in servers:
            server.start()
        for listener in listeners:
            listener.close()  # each server holds its own now: once it has closed it, it gets no more connections
        logger.info("gr-engine: %d API servers on %s:%d, engine core pid %d", api_servers, host, port, core.pid)
        return _supervise(core, servers)


@contextlib.contextmanager
def _multiprocess_metrics(folder: Path) -> Iterator[None]:
    """``PROMETHEUS_MULTIPROC_DIR`` for the processes started meanwhile (set before they import
    ``prometheus_client``, as its multiprocess mode needs)."""
    folder.mkdir()
    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    try:
        yield
    finally:
        if before is None:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = before


def _supervise(core: multiprocessing.process.BaseProcess, servers: list[multiprocessing.process.BaseProcess]) -> int:
    """Forward SIGTERM / SIGINT to the API servers, wait for them and then for the core; the exit status."""
    state = {"stopping": False, "status": 0}

    def stop(*_: object) -> None:
        if state["stopping"]:
            return
        state["stopping"] = True
        logger.info("gr-engine: stopping %d API servers", len(servers))
        for server in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.pid, signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    core_seen, ended = False, set()
    while len(ended) < len(servers):
        watched = [s.sentinel for s in servers if s.exitcode is None] + ([] if core_seen else [core.sentinel])
        multiprocessing.connection.wait(watched, timeout=1.0)
        if not core_seen and core.exitcode is not None:
            core_seen = True
            if not state["stopping"]:
                logger.error("gr-engine: the engine core exited (exit code %s); the API servers answer 503",
                             core.exitcode)
                state["status"] = 1
        for i, server in enumerate(servers):
            if server.exitcode is None or i in ended:
                continue
            ended.add(i)
            if server.exitcode != 0 or not state["stopping"]:
                state["status"] = 1
            if not state["stopping"]:
                logger.error("gr-engine: API server %d exited (exit code %s); stopping the others", i,
                             server.exitcode)
                stop()
    core.join(_CORE_EXIT_S)
    if core.exitcode is None:
        logger.error("gr-engine: the engine core did not stop within %.0f s: killing it", _CORE_EXIT_S)
        core.kill()
        core.join()
    if core.exitcode != 0:
        state["status"] = 1
    logger.info("gr-engine: stopped (exit status %d)", state["status"])
    return state["status"]


def _api_server(config_json: bytes, core: CoreHandle, listener: socket.socket, index: int) -> None:
    """An API-server process: its app attached to ``core``, on uvicorn over the inherited ``listener``."""
    config = msgspec.json.decode(config_json, type=EngineConfig)
    threading.Thread(target=_stop_when_orphaned, args=(os.getppid(),), daemon=True).start()
    run_app(build_app(config, core, index), sockets=[listener])


def _stop_when_orphaned(parent: int) -> None:
    """Stop this API server (gracefully, as SIGTERM does) once the launcher has gone without stopping it."""
    while os.getppid() == parent:
        time.sleep(1.0)
    logger.error("gr-engine: the launcher is gone; stopping")
    os.kill(os.getpid(), signal.SIGTERM)
