"""hstu_triton's paged read against its dense read of a step's own K/V rows (``attend`` after the append against
``attend_new_rows``), on the GPU, on the steps with no cached keys: 8k and 16k prefill, the cold 8,192-event visit
(100 candidates) and recompute's batch of 8.

    python benchmarks/dense_ab.py --out dense_ab.json [--rounds 3] [--commit REV]

Each round times both reads of every step in the engine's own launch shapes, replayed from a CUDA graph
(``do_bench_cudagraph``, device time; the append is not timed), and records the largest absolute difference of the
outputs (0 measured on the H100, the own-rows read on 64-key tiles and the paged one on 128).
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

CASES = {name: STEPS[name] for name in ("prefill_8192", "prefill_16384", "recompute_bs8")}
CASES["cold_visit_8192"] = ([0], [8192], [100])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    backend = HSTUTritonBackend(SPEC)
    tflops: dict[str, dict[str, list[float]]] = {"paged": {}, "dense": {}}
    diffs: dict[str, dict[str, float]] = {"dense": {}}
    for _ in range(args.rounds):
        for name, shape in CASES.items():
            q, k, v, cache, common = make_step(*shape, device)
            meta = backend.build_metadata(common)
            backend.append_kv(cache, k, v, meta)  # the pages hold the step's K/V: both reads see the same keys
            reads = {"paged": functools.partial(backend.attend, q, k, v, cache, meta),
                     "dense": functools.partial(backend.attend_new_rows, q, k, v, meta)}
            outputs = {label: read().float() for label, read in reads.items()}
            for label in diffs:
                diff = (outputs[label] - outputs["paged"]).abs().max().item()
                diffs[label][name] = max(diffs[label].get(name, 0.0), diff)
            for label, read in reads.items():
                seconds = triton.testing.do_bench_cudagraph(read, rep=100, return_mode="median") / 1e3
                tflops[label].setdefault(name, []).append(step_tflop(*shape) / seconds)
    medians = {label: {name: float(np.median(t)) for name, t in by_step.items()} for label, by_step in tflops.items()}
    for name in CASES:
        paged = medians["paged"][name]
        print(f"{name:16s} paged {paged:6.1f} TFLOP/s; " + "; ".join(
            f"{label} {medians[label][name]:6.1f} ({medians[label][name] / paged:.3f}x, max |diff| "
            f"{diffs[label][name]:.3g})" for label in diffs))
    with open(args.out, "w") as f:
        json.dump({"commit": args.commit, "device": torch.cuda.get_device_name(), "rounds": args.rounds,
                   "median_tflops": medians, "all_tflops": tflops, "max_abs_diff": diffs}, f, indent=1)


if __name__ == "__main__":
    main()
