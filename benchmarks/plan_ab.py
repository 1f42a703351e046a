"""The device tile plan (``hstu_triton_device_plan``) of two versions, and of the current one at several warp counts,
timed on the GPU in one process.

    python benchmarks/plan_ab.py --baseline OLD_PLAN.py --out plan_ab.json [--warps 4,8,16,32]

``OLD_PLAN.py`` is a copy of ``attention_backends/hstu_triton_device_plan.py`` as it was (``git show
REV:attention_backends/hstu_triton_device_plan.py > old_plan.py``, made before the tree goes to the GPU machine); it
is loaded inside the ``attention_backends`` package, so its relative imports resolve. For each case (:data:`CASES`:
the graph buckets a cold 8,192-event visit, a serving step and a recompute-like batch replay, the bench model's
default launch shape) the plan is written by the baseline at its own warps and by the current module at each of
``--warps``; device time per plan is the median of CUDA-graph replays (``triton.testing.do_bench_cudagraph``), and
every plan must equal the baseline's (the same plan, however it is computed).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
from types import ModuleType

import numpy as np
import torch
from kernel_bench import HEADS  # sibling scripts: the bench model's attention
from tile_sweep import SPEC

from attention_backends import hstu_triton_device_plan as current
from attention_backends.hstu_triton_plan import (
    MIN_TILES_PER_SPLIT,
    SPLIT_OVERHEAD_KEYS,
    TileConfig,
    default_tile_config,
    padded_capacities,
)

#: name -> (bucket rows, bucket requests, real requests as (new history rows, candidates, cached tokens)).
CASES: dict[str, tuple[int, int, list[tuple[int, int, int]]]] = {
    "cold visit: 8,192 events + 100 candidates in 8,704 rows, 1 request": (8704, 1, [(8192, 100, 0)]),
    "serving: 8 x (4 + 100) over 2k-12k cached, 1,024 rows, 64 requests": (
        1024, 64, [(4, 100, cached) for cached in (2000, 3500, 5000, 6500, 8000, 9500, 11000, 12000)]),
    "recompute-like: 8 x (1,000 + 50) in 8,704 rows, 8 requests": (8704, 8, [(1000, 50, 0)] * 8),
}


def load_plan_module(path: str) -> ModuleType:
    """The module file at ``path`` (a copy of ``hstu_triton_device_plan.py``), loaded as a sibling of the real one."""
    spec = importlib.util.spec_from_file_location("attention_backends._baseline_device_plan", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "attention_backends"
    spec.loader.exec_module(module)
    return module


def padded_step(rows: int, requests: int, real: list[tuple[int, int, int]], device: str,
                num_sms: int = 132) -> tuple[int, int, dict[str, torch.Tensor]]:
    """A bucket's capacities in tiles and items (as ``HSTUTritonBackend.graph_plan`` sizes them for the default
    tiles and ``num_sms`` SMs: :func:`~attention_backends.hstu_triton_plan.padded_capacities`) and the padded int32
    ``query_start_loc [R + 1]``, ``num_history_rows [R]`` and ``kv_seq_lens [R]`` the plan reads (spare requests
    without rows)."""
    tiles = tile_config()
    spare = requests - len(real)
    per_request = np.array([h + c for h, c, _ in real] + [0] * spare)
    if per_request.sum() > rows:
        raise ValueError(f"{per_request.sum()} rows do not fit a {rows}-row bucket")
    num_tiles, num_items = padded_capacities(rows, requests, tiles.block_m, HEADS, processors(tiles, num_sms))
    arrays = {"query_start_loc": np.concatenate([[0], np.cumsum(per_request)]),
              "num_history_rows": np.array([h for h, _, _ in real] + [0] * spare),
              "kv_seq_lens": np.array([h + cached for h, _, cached in real] + [0] * spare)}
    return num_tiles, num_items, {k: torch.tensor(v, dtype=torch.int32, device=device) for k, v in arrays.items()}


def tile_config() -> TileConfig:
    """The bench model's default launch shape."""
    return default_tile_config(SPEC)


def processors(tiles: TileConfig, num_sms: int = 132) -> int:
    return num_sms * tiles.programs_per_sm


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="a copy of hstu_triton_device_plan.py to compare against")
    parser.add_argument("--out", required=True)
    parser.add_argument("--warps", default="4,8,16,32", help="the current plan's warp counts to time")
    parser.add_argument("--commit", default=None, help="the current tree's commit, to record")
    args = parser.parse_args(argv)
    import triton.testing

    baseline, tiles = load_plan_module(args.baseline), tile_config()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = [("baseline", baseline, None)] + [(f"{w} warps", current, int(w)) for w in args.warps.split(",")]
    results: dict[str, dict[str, dict[str, float | bool]]] = {}
    default_warps = current.PLAN_WARPS
    try:
        for case, (rows, requests, real) in CASES.items():
            num_tiles, num_items, step = padded_step(rows, requests, real, "cuda", num_sms)
            reference, row = None, {}
            for label, module, warps in variants:
                if warps is not None:
                    current.PLAN_WARPS = warps  # what write_plan launches with
                plan = torch.full((5 * num_tiles + 2 * num_items,), -7, dtype=torch.int32, device="cuda")
                write = functools.partial(module.write_plan, plan, step["query_start_loc"], step["num_history_rows"],
                                          step["kv_seq_lens"], tiles, num_tiles, num_items, HEADS,
                                          processors(tiles, num_sms), SPLIT_OVERHEAD_KEYS, MIN_TILES_PER_SPLIT)
                write()
                reference = plan.clone() if reference is None else reference
                micros = triton.testing.do_bench_cudagraph(write, rep=100, return_mode="median") * 1e3
                row[label] = {"us": micros, "equal": bool(torch.equal(plan, reference))}
                print(f"{case} | {label}: {micros:.1f} us, equal {row[label]['equal']}", flush=True)
            results[case] = row
    finally:
        current.PLAN_WARPS = default_warps
    out = {"gpu": torch.cuda.get_device_name(), "commit": args.commit, "current_default_warps": default_warps,
           "command": f"python benchmarks/plan_ab.py --baseline {args.baseline} --out {args.out} --warps {args.warps}",
           "results": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
