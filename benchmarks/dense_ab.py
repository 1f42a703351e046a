"""hstu_triton's three reads of a step's keys on the GPU: from the pages only (``PAGES``, after the append), by
``attend`` (the step's own K/V rows for each request with no cached keys, the pages for the others) and by
``attend_new_rows`` (own rows only, for steps with no cached keys): 8k and 16k prefill, the cold 8,192-event visit
(100 candidates), recompute's batch of 8, and two steps with cached keys (the bench's serving step of 8 returning
users; 4 of them with 4 first visits).

    python benchmarks/dense_ab.py --out dense_ab.json [--rounds 3] [--commit REV]

Each round times every read of every step in the engine's own launch shape, replayed from a CUDA graph
(``do_bench_cudagraph``, device time; the append is not timed), and records the largest absolute difference of each
read's output from the pages-only read's (the same sums in the same order: 0 expected).
"""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np
import torch
import triton.testing
from kernel_bench import make_step  # sibling scripts
from tile_sweep import SPEC, STEPS, step_tflop

from attention_backends.hstu_triton import HSTUTritonBackend
from attention_backends.hstu_triton_kernels import PAGES

CASES = {name: STEPS[name] for name in ("prefill_8192", "prefill_16384", "recompute_bs8")}
CASES["cold_visit_8192"] = ([0], [8192], [100])
CASES["serve_bs8"] = STEPS["serve_bs8"]
CASES["mixed_bs8"] = ([2000, 5000, 8000, 11000, 0, 0, 0, 0], [4, 4, 4, 4, 1500, 3000, 5000, 7500], [100] * 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    backend = HSTUTritonBackend(SPEC)
    labels = ("pages", "attend", "own_rows")
    tflops: dict[str, dict[str, list[float]]] = {label: {} for label in labels}
    diffs: dict[str, dict[str, float]] = {label: {} for label in labels}
    for _ in range(args.rounds):
        for name, shape in CASES.items():
            q, k, v, cache, common = make_step(*shape, device)
            meta = backend.build_metadata(common)
            backend.append_kv(cache, k, v, meta)  # the pages hold the step's K/V: every read sees the same keys
            reads = {"pages": functools.partial(backend._attend, q, k, v, cache, meta, None, PAGES),
                     "attend": functools.partial(backend.attend, q, k, v, cache, meta)}
            if not any(shape[0]):  # no cached keys
                reads["own_rows"] = functools.partial(backend.attend_new_rows, q, k, v, meta)
            outputs = {label: read().float() for label, read in reads.items()}
            for label, read in reads.items():
                diff = (outputs[label] - outputs["pages"]).abs().max().item()
                diffs[label][name] = max(diffs[label].get(name, 0.0), diff)
                seconds = triton.testing.do_bench_cudagraph(read, rep=100, return_mode="median") / 1e3
                tflops[label].setdefault(name, []).append(step_tflop(*shape) / seconds)
    medians = {label: {name: float(np.median(t)) for name, t in by_step.items()} for label, by_step in tflops.items()}
    for name in CASES:
        pages = medians["pages"][name]
        line = " ".join(f"{label} {medians[label][name]:6.1f} ({medians[label][name] / pages:.3f}x, "
                        f"diff {diffs[label][name]:.3g})" for label in labels if name in medians[label])
        print(f"{name:16s} TFLOP/s: {line}")
    with open(args.out, "w") as f:
        json.dump({"commit": args.commit, "device": torch.cuda.get_device_name(), "rounds": args.rounds,
                   "median_tflops": medians, "all_tflops": tflops, "max_abs_diff": diffs}, f, indent=1)


if __name__ == "__main__":
    main()
