"""What ``GREngine.warmup()`` costs with step graphs up to a given size: the bench's engines, each warmed up once.

    python benchmarks/warmup_cost.py --out warmup_cost.json [--cases hierarchical:8:4096,hierarchical:8:16384,...]

Each case is ``mode:batch:cuda_graph_max_rows`` (an engine as the bench builds it for that cache mode and batch size,
with a 1 GiB host tier); per case: the warm-up's wall time (s), the (bucket, launch shape) forwards captured, and
the change of torch's reserved CUDA memory over it (MiB; it can be negative where the allocator releases what an
earlier case's engine left cached). Run the cases in one process after the kernels have compiled once (e.g. after a
bench run), or the first case's time includes Triton's compilations. ``--quick``: the bench's CPU settings (no
graphs: 0 captured).
"""

from __future__ import annotations

import argparse
import json
import time

import msgspec
import torch

from gr_engine.bench.runner import BenchSettings, cache_config, engine_config, quick_settings
from gr_engine.engine import GREngine

DEFAULT_CASES = "hierarchical:8:4096,hierarchical:8:16384,recompute:1:16384"


def parse_cases(text: str) -> list[tuple[str, int, int]]:
    """``mode:batch:max_rows,...`` -> ``[(mode, batch, max_rows), ...]``."""
    cases = []
    for case in text.split(","):
        mode, batch, max_rows = case.split(":")
        cases.append((mode, int(batch), int(max_rows)))
    return cases


def measure(settings: BenchSettings, mode: str, batch: int, max_rows: int) -> dict:
    """Warm up one bench engine of ``mode`` for batches of ``batch`` with ``cuda_graph_max_rows=max_rows``."""
    cache = cache_config(settings, mode, host_budget_bytes=min(settings.host_budget_bytes, 2**30))
    config = msgspec.structs.replace(engine_config(settings, cache, batch), cuda_graph_max_rows=max_rows)
    with GREngine(config) as engine:
        cuda = engine.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(engine.device)
        reserved = torch.cuda.memory_reserved(engine.device) if cuda else 0
        t0 = time.perf_counter()
        captured = engine.warmup(use_tqdm=False)
        seconds = time.perf_counter() - t0
        grown = (torch.cuda.memory_reserved(engine.device) - reserved) / 2**20 if cuda else 0.0
    if cuda:
        torch.cuda.empty_cache()
    return {"mode": mode, "batch": batch, "max_rows": max_rows, "warmup_s": seconds, "captured": captured,
            "reserved_mib": grown}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=DEFAULT_CASES, help="mode:batch:cuda_graph_max_rows,...")
    parser.add_argument("--quick", action="store_true", help="the bench's CPU settings (seconds)")
    parser.add_argument("--commit", default=None, help="commit id to record (the device copy has no .git)")
    args = parser.parse_args(argv)
    settings = quick_settings() if args.quick else BenchSettings()
    results = []
    for mode, batch, max_rows in parse_cases(args.cases):
        results.append(measure(settings, mode, batch, max_rows))
        print(results[-1], flush=True)
    device = torch.cuda.get_device_name() if settings.device.startswith("cuda") else settings.device
    with open(args.out, "w") as f:
        json.dump({"gpu": device, "commit": args.commit, "cases": results,
                   "command": f"python benchmarks/warmup_cost.py --out {args.out} --cases {args.cases}"
                              + (" --quick" if args.quick else "")}, f, indent=1)


if __name__ == "__main__":
    main()
