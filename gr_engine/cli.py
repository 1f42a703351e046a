"""The ``gr-engine`` command line: ``demo`` (returning users under every cache mode, on CPU with a tiny model),
``rank`` and ``generate`` (offline ranking and retrieval over JSONL or Parquet files), ``bench`` and ``config``
(print the resolved configuration as JSON); :data:`EPILOG` shows their use.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import msgspec

from .config import load_config
from .request import GenerateParams


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="engine config file (.json or .toml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set cache.mode=recompute (repeatable)")


def _add_file_job_args(parser: argparse.ArgumentParser) -> None:
    """The arguments ``rank`` and ``generate`` share."""
    parser.add_argument("--input", required=True, nargs="+",
                        help="requests (.jsonl or .parquet); with --workers: files or folders of them")
    parser.add_argument("--output", required=True,
                        help="outputs (.jsonl or .parquet); with --workers: a new or empty folder")
    parser.add_argument("--workers", type=int, help="run on Ray Data with this many engines (pip install "
                                                    "'gr-engine[ray]'); default: one engine in this process")
    parser.add_argument("--output-format", choices=["parquet", "jsonl"],
                        help="with --workers: the output files' format (default parquet)")
    parser.add_argument("--partitions", type=int,
                        help="with --workers: user partitions, each served whole by one engine call, so each must "
                             "fit in a node's object store (default: --workers)")
    parser.add_argument("--weights", help="model weights (.safetensors); default: random init from model.seed")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_config_args(parser)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import demo_config, run_demo

    if args.users < 1 or args.visits < 1:
        raise ValueError(f"--users and --visits must be at least 1, got {args.users} and {args.visits}")
    if args.seed < 0:  # numpy's generator of the synthetic stream takes none
        raise ValueError(f"--seed must be at least 0, got {args.seed}")
    config = load_config(args.config, args.overrides, base=demo_config())
    run_demo(config, num_users=args.users, visits_per_user=args.visits, seed=args.seed)
    return 0


def _serve_file(args: argparse.Namespace, generate: bool) -> int:
    """``rank`` / ``generate``: with ``--workers``, on Ray Data (:mod:`gr_engine.ray_job`). Else serve ``--input``
    a chunk at a time (:class:`~gr_engine.io.RequestReader`), writing
    each chunk's outputs, one per row (unparsable rows: error rows), to ``--output`` before reading the next. Exit
    status 1 when every request failed, else 0."""
    if args.workers is not None:
        if args.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {args.workers}")
        if args.partitions is not None and args.partitions < 1:  # before Ray starts (seconds)
            raise ValueError(f"--partitions must be at least 1, got {args.partitions}")
        from .ray_job import serve_files_on_ray

        args.output_format = args.output_format or "parquet"
        return serve_files_on_ray(args, generate)
    if args.output_format is not None or args.partitions is not None:
        raise ValueError("--output-format and --partitions are for --workers")
    if len(args.input) != 1:
        raise ValueError(f"one --input file without --workers, got {len(args.input)}")
    [args.input] = args.input
    from tqdm.auto import tqdm

    from .engine import build_engine
    from .io import RequestReader, file_format, max_line_bytes, max_list_lengths, serve_rows
    from .output_writer import OutputWriter
    from .outputs import GenerateOutput, RankOutput
    from .request import GenerateRequest, RankRequest

    file_format(args.input)
    file_format(args.output)  # before serving: results that cannot be written would be lost
    if Path(args.output).exists() and Path(args.output).samefile(args.input):
        raise ValueError(f"--output {args.output} is the input file: it is read while the outputs are written")
    params = GenerateParams(top_k=args.top_k, exclude_history=args.exclude_history) if generate else None
    overrides = args.overrides + ([f"weights_path={args.weights}"] if args.weights else [])
    config = load_config(args.config, overrides)
    rows = failed = 0
    # The input opens first (a missing file fails before the engine is built), the output once the engine exists.
    with RequestReader(args.input, GenerateRequest if generate else RankRequest, max_line_bytes(config),
                       max_list_lengths(config, ranking=not generate)) as reader:
        engine = build_engine(config)
        t0 = time.perf_counter()
        with OutputWriter(args.output, GenerateOutput if generate else RankOutput) as writer, \
                tqdm(total=reader.num_rows, desc="Retrieving" if generate else "Ranking", unit="req",
                     disable=args.no_progress) as bar:
            for chunk in reader:
                outputs = serve_rows(engine, chunk, params)
                writer.write(outputs)
                rows += len(outputs)
                failed += sum(o.error is not None for o in outputs)
                bar.update(len(outputs))
    return finish_file_job(args.command, generate, rows, failed, engine.stats.total_hit_ratio,
                           time.perf_counter() - t0, args.output)


def finish_file_job(command: str, generate: bool, rows: int, failed: int, hit_ratio: float, seconds: float,
                    written: object, where: str = "") -> int:
    """Print a file job's summary line (``where``: e.g. " on 4 workers"); exit status 1 when every request failed
    (pointing at the error fields of ``written``), else 0."""
    verb = "retrieved items for" if generate else "ranked"
    print(f"{verb} {rows - failed} requests ({failed} failed){where} in {seconds:.2f} s; history token hit ratio "
          f"{hit_ratio:.1%}; wrote {written}", file=sys.stderr)
    if rows and failed == rows:
        print(f"gr-engine {command}: error: all {failed} requests failed (see the error field of {written})",
              file=sys.stderr)
        return 1
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import dataclasses
    import subprocess

    from .bench.experiments import run_benchmark
    from .bench.report import load_result, summarize, unwritable, write_results
    from .bench.runner import BENCH_CACHE_FIELDS, BenchSettings, quick_settings

    if args.report_only:  # the report of a saved run: its bench.json is read, not written
        result = load_result(Path(args.report_only))
        out = Path(args.out) if args.out else Path(args.report_only).parent
        if (refused := unwritable(out, args.overwrite)) is not None:
            print(f"gr-engine bench: {refused}", file=sys.stderr)
            return 2
        result["report_command"] = "gr-engine " + " ".join(args.argv)
        try:
            summary = summarize(result)
            paths = write_results(result, out, raw=False)
        except (KeyError, TypeError, AttributeError, IndexError) as exc:  # a hand-made or cut file lacks a field
            print(f"gr-engine bench: {args.report_only} is not a complete bench result ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
            return 2
        print(json.dumps(summary, indent=2))
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
        return 0
    settings = quick_settings() if args.quick else BenchSettings()
    changes = {k: v for k, v in (("device", args.device), ("backend", args.backend),
                                 ("window_requests", args.window), ("host_dtype", args.host_dtype)) if v is not None}
    if args.modes:
        changes["modes"], changes["tables_only"] = tuple(m.strip() for m in args.modes.split(",")), True
    if args.host_budget_gib is not None:
        if not math.isfinite(args.host_budget_gib):  # int() raises for these (OverflowError for inf)
            raise ValueError(f"--host-budget-gib must be a finite number, got {args.host_budget_gib}")
        changes["host_budget_bytes"] = int(args.host_budget_gib * 2**30)
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if changes["host_budget_bytes"] > memory:  # else the host tier fails to allocate after modes have run
            raise ValueError(f"--host-budget-gib {args.host_budget_gib:g} is over this machine's memory "
                             f"({memory / 2**30:.0f} GiB)")
    if args.users is not None:
        changes["trace"] = dataclasses.replace(settings.trace, num_users=args.users)
    if args.cache:
        from cache_engine import CacheConfig

        from .config import apply_overrides

        try:
            cache = apply_overrides({}, args.cache)
            fixed = [key for key in cache if key in BENCH_CACHE_FIELDS]
            if fixed:  # the bench sets these per engine: a value for all of them would mislabel the results
                raise ValueError(f"{fixed[0]} is not for --cache: {BENCH_CACHE_FIELDS[fixed[0]]}")
            msgspec.convert(cache, CacheConfig)  # unknown fields and bad values fail here, before any engine exists
        except (msgspec.ValidationError, ValueError) as exc:
            print(f"gr-engine bench: invalid --cache: {exc}", file=sys.stderr)
            return 2
        changes["cache"] = tuple(cache.items())
    settings = dataclasses.replace(settings, **changes)  # nonsense sizes fail here (ValueError), before any run
    from .config import check_attention_backend, check_device

    try:  # before any trace is generated or engine built
        check_device(settings.device, require_available=True)
        check_attention_backend(settings.backend)
    except ValueError as exc:
        print(f"gr-engine bench: {exc}", file=sys.stderr)
        return 2
    if args.calibrate:  # the trace's calibration check: gpu_only hit ratios over three seeds (CPU, seconds)
        from .bench.runner import cache_config
        from .bench.simulate import simulate_policy
        from .bench.trace import generate_trace

        for seed in range(3):
            trace = generate_trace(dataclasses.replace(settings.trace, seed=seed))
            hit = simulate_policy(trace, cache_config(settings, "gpu_only")).gpu_hit_ratio
            print(f"seed {seed}: gpu_only at {settings.gpu_pages} pages hits {hit:.1%} of history tokens")
        return 0
    out = Path(args.out or "bench-out")
    if (refused := unwritable(out, args.overwrite)) is not None:
        print(f"gr-engine bench: {refused}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)

    def checkpoint(partial: dict) -> None:  # what a run cut short has measured
        (out / "bench_partial.json").write_text(json.dumps(partial, indent=2, default=str))

    result = run_benchmark(settings, echo=lambda line: print(line, file=sys.stderr), checkpoint=checkpoint)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result["commit"] = args.commit or commit.stdout.strip() or "unknown"
    result["command"] = "gr-engine " + " ".join(args.argv)
    import torch

    result["gpu"] = torch.cuda.get_device_name() if settings.device.startswith("cuda") else "cpu"
    paths = write_results(result, out)
    (out / "bench_partial.json").unlink(missing_ok=True)
    print(json.dumps(summarize(result), indent=2))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    print(msgspec.json.format(msgspec.json.encode(load_config(args.config, args.overrides)).decode(), indent=2))
    return 0


#: ``gr-engine --help``'s text: plain, not the reStructuredText of the module docstring.
DESCRIPTION = "gr-engine: serve HSTU generative-recommendation models with per-user KV caches."
EPILOG = """examples:
  gr-engine demo
  gr-engine rank --input requests.jsonl --output scores.parquet
  gr-engine generate --input requests.jsonl --output items.jsonl --top-k 20
  gr-engine rank --input requests/ --output scores/ --workers 4
  gr-engine config --config engine.toml --set cache.mode=recompute

demo, rank, generate, config, serve and bench-serve take --config FILE (.json or .toml) and repeated
--set section.key=value.
Run gr-engine COMMAND --help for a command's options."""


def build_parser() -> argparse.ArgumentParser:
    """The ``gr-engine`` command line: ``demo``, ``rank``, ``generate``, ``bench`` and ``config``."""
    parser = argparse.ArgumentParser(prog="gr-engine", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="run the CPU demo with a tiny synthetic model (up to minutes)")
    demo.add_argument("--users", type=int, default=32, help="synthetic users (default 32)")
    demo.add_argument("--visits", type=int, default=6, help="visits per user (default 6)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the synthetic users' histories (default 0)")
    _add_config_args(demo)
    demo.set_defaults(run=_cmd_demo)

    rank = commands.add_parser("rank", help="rank a JSONL or Parquet file of requests")
    _add_file_job_args(rank)
    rank.set_defaults(run=functools.partial(_serve_file, generate=False))

    generate = commands.add_parser("generate", help="retrieve the top items for a JSONL or Parquet file of requests")
    _add_file_job_args(generate)
    generate.add_argument("--top-k", type=int, default=GenerateParams().top_k,
                          help=f"items to return per request (default {GenerateParams().top_k})")
    generate.add_argument("--exclude-history", action=argparse.BooleanOptionalAction,
                          default=GenerateParams().exclude_history,
                          help="never return items already in the user's history (default: on)")
    generate.set_defaults(run=functools.partial(_serve_file, generate=True))

    bench = commands.add_parser("bench", help="run the benchmark (the MTServe paper's experiments)")
    bench.add_argument("--out", help="folder for the results (default ./bench-out; with --report-only, the JSON's "
                                     "folder); a non-empty folder of benchmarks/results needs --overwrite")
    bench.add_argument("--overwrite", action="store_true",
                       help="allow replacing the committed results in benchmarks/results")
    bench.add_argument("--report-only", metavar="BENCH_JSON",
                       help="run nothing: rebuild bench.md, summary.json (and bench.png) from a saved bench.json")
    bench.add_argument("--quick", action="store_true", help="a tiny CPU run of every part (seconds)")
    bench.add_argument("--device", help="override the device (default: cuda; cpu with --quick)")
    bench.add_argument("--backend", help="attention backend (default: auto; torch_ref with --quick)")
    bench.add_argument("--users", type=int, help="users in the generated trace (default 1000; 16 with --quick)")
    bench.add_argument("--window", type=int,
                       help="measured requests per mode and batch size (default 480; 16 with --quick)")
    bench.add_argument("--modes", metavar="MODE,...", help="only these cache modes' latency tables (Tables 1-2), "
                       "without the sweeps, length scan, score drift and policy simulations (a shorter run)")
    bench.add_argument("--host-budget-gib", type=float,
                       help="host chunk pool size (default 64; 1/16, i.e. 64 MiB, with --quick)")
    bench.add_argument("--host-dtype", choices=["kv", "float8_e4m3fn"], help="host chunk dtype (default float8_e4m3fn)")
    bench.add_argument("--cache", action="append", default=[], metavar="KEY=VALUE",
                       help="set a cache field for every engine (repeatable), e.g. --cache prefetch=true")
    bench.add_argument("--commit", help="commit id to record (when the checkout has no .git)")
    bench.add_argument("--calibrate", action="store_true",
                       help="only check the trace's calibration: gpu_only hit ratios by policy simulation (CPU)")
    bench.set_defaults(run=_cmd_bench)

    from .serving.cli import add_commands

    add_commands(commands, _add_config_args, lambda args: load_config(args.config, args.overrides))

    config = commands.add_parser("config", help="print the resolved configuration as JSON")
    _add_config_args(config)
    config.set_defaults(run=_cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``gr-engine`` with ``argv`` (default: the process's arguments); returns the exit status."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: the benchmark records its command
    try:
        return args.run(args)
    except (ValueError, OSError, ImportError) as exc:
        print(f"gr-engine {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
