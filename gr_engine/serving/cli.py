"""The online commands of ``gr-engine``: ``serve`` (the HTTP server) and ``bench-serve`` (its load benchmark).

Their packages are imported when a command runs, so that building the parser stays light."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_commands(commands: argparse._SubParsersAction, add_config_args: Callable[[argparse.ArgumentParser], None],
                 load: Callable[[argparse.Namespace], object]) -> None:
    """Add ``serve`` and ``bench-serve`` to ``commands`` (``add_config_args`` gives them ``--config`` and ``--set``;
    ``load`` resolves them into an :class:`~gr_engine.EngineConfig`)."""
    serve = commands.add_parser("serve", help="serve ranking and retrieval over HTTP (docs/serving.md)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free port)")
    serve.add_argument("--api-servers", type=int, default=1, metavar="N",
                       help="API-server processes sharing the port and one engine core (default 1); each admits "
                            "1/N of serving.max_pending_requests and max_pending_tokens")
    serve.add_argument("--replicas", type=int, default=1, metavar="N",
                       help="engine-core replicas, each user served by one (consistent hashing of user_id); device "
                            "cuda puts replica i on cuda:i (default 1; docs/scale_out.md)")
    serve.add_argument("--ray", action="store_true",
                       help="run the replicas as a Ray Serve application on a Ray cluster (RAY_ADDRESS, else a "
                            "local one), one GPU each with device cuda (docs/scale_out.md, 'On Ray Serve')")
    add_config_args(serve)

    def run_serve(args: argparse.Namespace) -> int:
        if args.api_servers < 1 or args.replicas < 1:
            raise ValueError(f"--api-servers and --replicas must be at least 1, got {args.api_servers} and "
                             f"{args.replicas}")
        if args.api_servers > 1 and args.replicas > 1:
            raise ValueError("--replicas N runs one API server in front of its replicas: it cannot be combined "
                             "with --api-servers")
        if args.ray:
            if args.api_servers > 1:
                raise ValueError("--ray serves through Ray Serve's HTTP proxy: it cannot be combined with "
                                 "--api-servers")
            from .ray_serve import serve_until_stopped

            serve_until_stopped(load(args), args.host, args.port, args.replicas)
            return 0
        if args.api_servers > 1:
            from .launcher import serve_many

            return serve_many(load(args), args.host, args.port, args.api_servers)
        from .server import serve as run

        run(load(args), args.host, args.port, args.replicas)
        return 0

    serve.set_defaults(run=run_serve)

    bench = commands.add_parser("bench-serve", help="load-test the online path: the bench's trace as open-loop "
                                                    "Poisson arrivals (docs/serving.md)")
    bench.add_argument("--url", help="the server to load, e.g. http://127.0.0.1:8000 (or --in-process)")
    bench.add_argument("--in-process", action="store_true",
                       help="drive an AsyncGREngine in this process instead of HTTP (engine: --config/--set, "
                            "default the bench's for --mode)")
    bench.add_argument("--rate", type=float, help="offered load (requests/s; default 50 without --rates)")
    bench.add_argument("--rates", help="a sweep of offered loads, comma-separated (requests/s)")
    bench.add_argument("--duration", type=float, default=10.0, help="seconds per rate (default 10)")
    bench.add_argument("--processes", type=int, default=1, help="load-generator processes over HTTP (default 1)")
    bench.add_argument("--concurrency", type=int, default=8, help="warm-up requests in flight (default 8)")
    bench.add_argument("--skip-steady", type=int, help="steady visits served in the warm-up, the trace's cold start "
                                                       "(default 10000, --quick 0)")
    bench.add_argument("--closed-requests", type=int, help="requests of the closed-loop figure (default 240, "
                                                           "--quick 16)")
    bench.add_argument("--body", choices=["json", "msgpack"], default="json",
                       help="HTTP bodies and answers (default json; msgpack: raw int64 arrays and float32 scores)")
    bench.add_argument("--timeout-ms", type=float, help="per-request deadline sent with each request (ms)")
    bench.add_argument("--quick", action="store_true", help="the bench's tiny CPU trace and model")
    bench.add_argument("--users", type=int, help="users in the generated trace")
    bench.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    bench.add_argument("--mode", default="hierarchical",
                       choices=["recompute", "gpu_only", "hierarchical", "unlimited"],
                       help="cache mode of the bench's engine config (default hierarchical)")
    bench.add_argument("--write-config", metavar="FILE",
                       help="only write the bench's engine config for --mode (JSON, for gr-engine serve --config)")
    bench.add_argument("--out", default="bench-serve-out", help="folder for the results (default ./bench-serve-out)")
    bench.add_argument("--core-steps", metavar="FILE",
                       help="the server's step log (its serving.step_log) to profile each rate from; in process the "
                            "core always writes one, to OUT/core_steps.jsonl unless serving.step_log says where")
    add_config_args(bench)

    def run_bench_serve(args: argparse.Namespace) -> int:
        import math
        import sys
        from pathlib import Path

        import msgspec

        from ..config import load_config
        from .load import LoadSettings, bench_engine_config, bench_settings, run_bench
        from .load_report import write_report

        settings = bench_settings(args.quick, args.users, args.seed)
        if args.write_config or args.in_process:  # a config written here may be for a GPU machine
            config = load_config(args.config, args.overrides, base=bench_engine_config(settings, args.mode),
                                 this_machine=not args.write_config)
        if args.write_config:
            Path(args.write_config).write_bytes(msgspec.json.format(msgspec.json.encode(config)))
            print(f"wrote {args.write_config} ({args.mode})", file=sys.stderr)
            return 0
        if args.in_process == bool(args.url):
            raise ValueError("give exactly one of --url and --in-process")
        if args.rate is not None and args.rates:
            raise ValueError("give --rate or --rates, not both")
        rates = tuple(float(r) for r in args.rates.split(",")) if args.rates else (args.rate or 50.0,)
        if not all(0 < value < math.inf for value in (*rates, args.duration)):  # NaN fails too
            raise ValueError("rates and --duration must be positive finite numbers")
        if args.processes < 1 or args.concurrency < 1:
            raise ValueError("--processes and --concurrency must be at least 1")
        if args.timeout_ms is not None and not args.timeout_ms >= 0:
            raise ValueError(f"--timeout-ms must be a number >= 0, got {args.timeout_ms}")
        closed = args.closed_requests if args.closed_requests is not None else (16 if args.quick else 240)
        skip = args.skip_steady if args.skip_steady is not None else (0 if args.quick else 10_000)
        if skip < 0:
            raise ValueError("--skip-steady must not be negative")
        step_log = args.core_steps
        if args.in_process:
            if args.core_steps:
                raise ValueError("--core-steps is for --url; in process set serving.step_log")
            if config.serving.step_log is None:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                serving = msgspec.structs.replace(config.serving, step_log=str(Path(args.out) / "core_steps.jsonl"))
                config = msgspec.structs.replace(config, serving=serving)
            step_log = config.serving.step_log
        load = LoadSettings(rates=rates, duration_s=args.duration, url=None if args.in_process else args.url,
                            processes=args.processes, quick=args.quick, users=args.users, seed=args.seed,
                            mode=args.mode, concurrency=args.concurrency, closed_requests=closed, skip_steady=skip,
                            timeout_ms=args.timeout_ms, body=args.body, step_log=step_log)
        result = run_bench(load, config if args.in_process else None, lambda line: print(line, file=sys.stderr))
        result["command"] = "gr-engine " + " ".join(args.argv)
        paths = write_report(result, Path(args.out))
        print(msgspec.json.format(msgspec.json.encode(result["summary"])).decode())
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
        return 0

    bench.set_defaults(run=run_bench_serve)


def _port(text: str) -> int:
    """``--port``'s value: an int in ``[0, 65535]``."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {port}")
    return port
