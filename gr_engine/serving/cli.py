"""The online commands of ``gr-engine``: ``serve`` (the HTTP server) and ``bench-serve`` (its load benchmark).

Their packages are imported when a command runs, so that building the parser stays light."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_commands(commands: argparse._SubParsersAction, add_config_args: Callable[[argparse.ArgumentParser], None],
                 load: Callable[[argparse.Namespace], object]) -> None:
    """Add ``serve`` to ``commands`` (``add_config_args`` gives it ``--config`` and ``--set``; ``load`` resolves
    them into an :class:`~gr_engine.EngineConfig`)."""
    serve = commands.add_parser("serve", help="serve ranking and retrieval over HTTP (docs/serving.md)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    add_config_args(serve)

    def run_serve(args: argparse.Namespace) -> int:
        from .server import serve as run

        run(load(args), args.host, args.port)
        return 0

    serve.set_defaults(run=run_serve)
