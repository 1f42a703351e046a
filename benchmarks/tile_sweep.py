"""hstu_triton's launch shapes against each other on the GPU: which ``TileConfig`` computes each step fastest.

    python benchmarks/tile_sweep.py --out tile_sweep.json [--quick]

For every launch shape of a grid (``block_m`` 64/128, ``block_n`` 64/128, ``num_warps`` 4/8, ``num_stages`` 2-4; the
64-row 4-warp shapes also two programs an SM, and the decode tiles 32 x 128 one and two; shapes Triton cannot
compile are recorded as failed), times ``hstu_triton`` attention (4 heads x 128, bf16, page 32, replayed from a CUDA
graph: device time) over six steps: one 8k and one 16k full-history prefill, recompute's batch of 8 (whole histories
of 1.5k-20k events, mean ~9.2k, plus 100 candidates each, nothing cached), a serving step of 8 returning users (4
new events and 100 candidates each over 2k-12.5k cached), the same users with 16 candidates (rows for the engine's
decode tiles), and recompute's batch with a relative time bias (the kernel variant that loads the most per key tile:
a shape must compile for it too). A persistent grid holds one program an SM unless ``programs_per_sm`` says more
(``compile_check.py`` says how many fit). Reports TFLOP/s (causal FLOPs counted once) per shape. ``--quick``: seven
shapes. ``--overhead-keys 256,640,1280`` also times the steps with each split-KV program cost (the backend's
``overhead_keys``, in keys: more splits the cheaper a program is taken to be) under the engine's own launch shapes
(each step's :func:`default_tile_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import subprocess

import numpy as np
import torch
import triton.testing
from kernel_bench import DIM, HEADS, PAGE, make_step  # a sibling script

from attention_backends import AttentionSpec
from attention_backends.hstu_triton import HSTUTritonBackend
from attention_backends.hstu_triton_plan import TileConfig, default_tile_config
from gr_engine.bench.flops import attended_pairs

#: The steps timed: name -> (cached, new history rows, candidates) per request.
STEPS = {
    "prefill_8192": ([0], [8192], [0]),
    "prefill_16384": ([0], [16384], [0]),
    "recompute_bs8": ([0] * 8, [1500, 3000, 5000, 7500, 9700, 12000, 15000, 20000], [100] * 8),
    # a serving step: 8 returning users' new events and candidates over their cached histories (split-KV)
    "serve_bs8": ([2000, 3500, 5000, 6500, 8000, 9500, 11000, 12500], [4] * 8, [100] * 8),
    # the same users with few candidates: 20 rows a request, the engine's decode tiles
    "decode_bs8": ([2000, 3500, 5000, 6500, 8000, 9500, 11000, 12500], [4] * 8, [16] * 8),
}
BIAS_STEP = "recompute_bs8_time_bias"  # STEPS["recompute_bs8"] with timestamps and a time-bias table
BIAS_BUCKETS = 64
#: The bench model's attention (bf16, 4 heads x 128, pages of 32), without and with a relative time bias.
SPEC = AttentionSpec(kind="hstu", num_heads=HEADS, head_dim=DIM, page_size=PAGE, dtype=torch.bfloat16,
                     device_type="cuda", alpha=DIM**-0.5, scaling_seqlen=20_000)
BIAS_SPEC = dataclasses.replace(SPEC, time_bias_buckets=BIAS_BUCKETS)


def step_tflop(cached: list[int], new: list[int], candidates: list[int]) -> float:
    """Attention TFLOP of a step: ``4 * H * D`` per attended (query, key) pair."""
    history = np.asarray(cached) + np.asarray(new)
    return 4 * HEADS * DIM * float(attended_pairs(cached, history, candidates).sum()) / 1e12


def make_steps(device: torch.device) -> tuple[dict[str, tuple], dict[str, float]]:
    """Every timed step's inputs (:func:`kernel_bench.make_step`) and attention TFLOP, the time-bias batch too."""
    steps = {name: make_step(*shape, device) for name, shape in STEPS.items()}
    steps[BIAS_STEP] = make_step(*STEPS["recompute_bs8"], device, timestamps=True)
    tflop = {name: step_tflop(*shape) for name, shape in STEPS.items()}
    tflop[BIAS_STEP] = tflop["recompute_bs8"]
    return steps, tflop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="seven shapes only")
    parser.add_argument("--commit", default=None, help="commit id to record (the device copy has no .git)")
    parser.add_argument("--overhead-keys", default="",
                        help="comma-separated split-KV program costs (keys) to time every step at, engine shapes")
    args = parser.parse_args()
    overheads = [int(v) for v in args.overhead_keys.split(",") if v.strip()]
    device = torch.device("cuda")
    grid = [TileConfig(m, n, w, s) for m, n, w, s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4))]
    grid += [dataclasses.replace(c, programs_per_sm=2) for c in grid if c.block_m == 64 and c.num_warps == 4]
    decode = default_tile_config(SPEC, max_query_len=20)
    decode_one = dataclasses.replace(decode, programs_per_sm=1)
    grid += [decode_one, decode]
    default = default_tile_config(SPEC)
    if args.quick:
        grid = [default, TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(64, 64, 4, 3, 2),
                TileConfig(64, 64, 4, 2, 2), decode_one, decode]
    steps, tflop = make_steps(device)
    bias_table = torch.randn(BIAS_BUCKETS, HEADS, device=device, dtype=torch.float32)

    def tflops(config: TileConfig | None, overhead_keys: int | None = None) -> dict:
        """TFLOP/s of every step under launch shape ``config`` (``None``: the engine's for each step)."""
        row: dict = {"tflops": {}}
        try:
            for name, (q, k, v, cache, meta) in steps.items():
                biased = name == BIAS_STEP
                backend = HSTUTritonBackend(BIAS_SPEC if biased else SPEC, tiles=config)
                if overhead_keys is not None:
                    backend.overhead_keys = overhead_keys
                attend = functools.partial(backend.attend, q, k, v, cache, backend.build_metadata(meta),
                                           time_bias=bias_table if biased else None)
                seconds = triton.testing.do_bench_cudagraph(attend, rep=50, return_mode="median") / 1e3
                row["tflops"][name] = tflop[name] / seconds
        except Exception as exc:  # a shape Triton cannot compile (e.g. out of shared memory)
            row["error"] = repr(exc)[:200]
        print(row, flush=True)
        return row

    results = [{"config": list(dataclasses.astuple(config)), **tflops(config)} for config in grid]
    by_overhead = [{"overhead_keys": keys, **tflops(None, keys)} for keys in overheads]
    ok = [r for r in results if "error" not in r]
    for name in steps:
        ok.sort(key=lambda r, name=name: -r["tflops"][name])
        print(name, "best", ok[0]["config"], f"{ok[0]['tflops'][name]:.0f} TFLOP/s")
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    out = {"gpu": torch.cuda.get_device_name(), "commit": commit or "unknown", "triton": triton.__version__,
           "command": "python benchmarks/tile_sweep.py --out " + args.out + (" --quick" if args.quick else "")
           + (f" --overhead-keys {args.overhead_keys}" if overheads else ""),
           "config_fields": [f.name for f in dataclasses.fields(TileConfig)],
           "default": list(dataclasses.astuple(default)),
           "step_tflop": tflop, "results": results, "overhead_keys": by_overhead}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
