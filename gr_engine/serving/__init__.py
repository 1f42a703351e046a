"""Online serving: the engine core in its own process, its asyncio client and the HTTP server (docs/serving.md).

Needs the ``serve`` extra (pyzmq, Starlette, uvicorn, prometheus_client, httpx,
aiohttp): ``pip install 'gr-engine[serve]'``.
The names below are imported when first used, so that importing :mod:`gr_engine` (whose config holds a
:class:`ServingConfig`) does not import them.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"AsyncGREngine": "client", "CoreHandle": "client", "EngineDead": "client", "EngineOverloaded": "admission",
            "ReplicaRouter": "router", "ServingConfig": "config", "build_app": "server", "start_core": "core"}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
