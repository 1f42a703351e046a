"""Two versions of hstu_triton's kernels module against each other on the GPU, in one process, on tile_sweep's steps.

    python benchmarks/kernel_ab.py --baseline OLD_KERNELS.py --out kernel_ab.json [--rounds 3]

``OLD_KERNELS.py`` is a copy of ``attention_backends/hstu_triton_kernels.py`` as it was (``git show
REV:attention_backends/hstu_triton_kernels.py > old.py``, made before the tree goes to the GPU machine). Each round
times the baseline's ``hstu_paged_attention_kernel`` and then the current one on every step of ``tile_sweep.py``
(8k and 16k prefill, recompute's batch of 8, the serving and decode steps, the time-bias batch), each in the engine's
own launch shape for the step, replayed from a CUDA graph (device time). Reports TFLOP/s per round and the largest
absolute difference of each output from the baseline's (the two must agree: the same arithmetic in the same order
gives 0).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json

import torch
import triton.testing
from kernel_bench import HEADS  # sibling scripts
from tile_sweep import BIAS_BUCKETS, BIAS_SPEC, BIAS_STEP, SPEC, make_steps

import attention_backends.hstu_triton as hstu_triton


def load_kernel(path: str):
    """``hstu_paged_attention_kernel`` of the module file at ``path``."""
    spec = importlib.util.spec_from_file_location("baseline_hstu_triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.hstu_paged_attention_kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a copy of hstu_triton_kernels.py to compare against")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--commit", default=None, help="the current tree's commit, to record")
    args = parser.parse_args()
    device = torch.device("cuda")
    bias_table = torch.randn(BIAS_BUCKETS, HEADS, device=device, dtype=torch.float32)
    steps, tflop = make_steps(device)
    kernels = {"baseline": load_kernel(args.baseline), "current": hstu_triton.hstu_paged_attention_kernel}
    reference: dict[str, torch.Tensor] = {}
    results = {label: {"tflops": {name: [] for name in steps}, "max_abs_diff": {}} for label in kernels}
    try:
        for _ in range(args.rounds):
            for label, kernel in kernels.items():
                hstu_triton.hstu_paged_attention_kernel = kernel  # what HSTUTritonBackend.attend launches
                row = results[label]
                for name, (q, k, v, cache, meta) in steps.items():
                    biased = name == BIAS_STEP
                    backend = hstu_triton.HSTUTritonBackend(BIAS_SPEC if biased else SPEC)
                    attend = functools.partial(backend.attend, q, k, v, cache, backend.build_metadata(meta),
                                               time_bias=bias_table if biased else None)
                    output = attend().float()
                    reference.setdefault(name, output)
                    row["max_abs_diff"][name] = float((output - reference[name]).abs().max())
                    seconds = triton.testing.do_bench_cudagraph(attend, rep=50, return_mode="median") / 1e3
                    row["tflops"][name].append(tflop[name] / seconds)
                print(label, {n: [round(x, 1) for x in t] for n, t in row["tflops"].items()}, row["max_abs_diff"],
                      flush=True)
    finally:
        hstu_triton.hstu_paged_attention_kernel = kernels["current"]
    out = {"gpu": torch.cuda.get_device_name(), "commit": args.commit, "triton": triton.__version__,
           "command": f"python benchmarks/kernel_ab.py --baseline {args.baseline} --out {args.out} "
                      f"--rounds {args.rounds}",
           "step_tflop": tflop, "results": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
