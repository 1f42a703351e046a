"""Attention kernel benchmark on the GPU: hstu_triton vs torch_ref vs torch SDPA (softmax reference).

    python benchmarks/kernel_bench.py --out benchmarks/results/kernels.json

- Full-history prefill (one request, T new history rows, causal) at T = 1k, 4k, 8k, 16k; TFLOP/s with
  causal FLOPs counted once (``2 * 2 * H * D * T^2 / 2``). ``hstu_triton`` reads the keys from the pages
  (``attend``, ``hstu_triton_prefill_*tflops``) and from the step's own rows (``attend_new_rows``, how a
  ``recompute`` engine runs a self-contained step: ``hstu_triton_prefill_dense_*tflops``). ``hstu_triton`` is timed
  launched from Python (L2 flushed before each call, as ``do_bench`` does) and replayed from a CUDA graph (back to
  back, device time: how the engine runs a step of at most ``cuda_graph_max_rows`` rows).
- Delta queries: 8 requests, each 256 new history rows + 100 candidates over a cached paged history of
  1k..16k tokens; the fraction of HBM bandwidth achieved reading the paged history
  (history K/V bytes / time / measured device-copy bandwidth). At 356 query rows per request this shape
  is compute-bound (about 356 FLOP per history byte against the H200's ridge of about 190), so the same
  fraction is also reported for the memory-bound regime: 8 requests of 4 new rows + 12 candidates.
  Delta and decode times are replayed from CUDA graphs (device time, as the engine runs small steps);
  decode also reports the launched time, which the host's launch cost bounds from below.
- The relative time bias on and off (prefill at 8k and the 8k delta step), to show its cost.
4 heads x 128, bf16, page 32; medians of ``triton.testing.do_bench``; all measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess

import numpy as np
import torch
import torch.nn.functional as F
import triton.testing

from attention_backends import AttentionSpec, PagedBatchMetadata
from attention_backends.hstu_triton import HSTUTritonBackend
from attention_backends.torch_ref import TorchRefBackend

HEADS, DIM, PAGE = 4, 128, 32


def make_step(cached: list[int], new: list[int], cands: list[int], device, timestamps: bool = False) -> tuple:
    """Random q/k/v rows and a paged cache holding ``cached + new`` tokens per request (shuffled pages);
    with ``timestamps``, increasing event times (seconds) for the relative time bias."""
    seq = np.asarray(cached) + np.asarray(new)
    pages = -(-seq // PAGE)
    indptr = np.concatenate([[0], np.cumsum(pages)])
    indices = np.random.default_rng(0).permutation(int(indptr[-1]) + 8)[: indptr[-1]]
    cache = torch.randn(int(indptr[-1]) + 8, 2, PAGE, HEADS, DIM, device=device, dtype=torch.bfloat16)
    rows = int(sum(new) + sum(cands))
    q, k, v = (torch.randn(rows, HEADS, DIM, device=device, dtype=torch.bfloat16) for _ in range(3))
    times = {}
    if timestamps:
        keys = np.concatenate([np.cumsum(np.random.default_rng(1).integers(1, 600, n)) for n in seq])
        query = np.concatenate([np.full(n + c, keys[e - 1]) for n, c, e in zip(new, cands, np.cumsum(seq))])
        times = {"query_timestamps": query, "key_timestamps": keys}
    meta = PagedBatchMetadata.from_layout(np.asarray(cached), np.asarray(new), np.asarray(cands), indptr, indices,
                                          PAGE, device, **times)
    return q, k, v, cache, meta


def time_backend(backend, step, time_bias: torch.Tensor | None = None, graph: bool = False,
                 dense: bool = False) -> float:
    """Median seconds of one ``attend`` (``dense``: ``attend_new_rows``, the keys read from the step's own rows);
    ``graph``: replayed from a CUDA graph (device time without the host's launch cost, as the engine runs small
    steps)."""
    q, k, v, cache, meta = step
    prepared = backend.build_metadata(meta)
    extra = {} if time_bias is None else {"time_bias": time_bias}
    if dense:
        fn = lambda: backend.attend_new_rows(q, k, v, prepared, **extra)  # noqa: E731
    else:
        fn = lambda: backend.attend(q, k, v, cache, prepared, **extra)  # noqa: E731
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") / 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def history_bytes(cached: int, new: int, batch: int) -> int:
    """Bytes of paged K and V (bf16) a step reads per layer: every request's ``cached + new`` tokens."""
    return batch * (cached + new) * 2 * HEADS * DIM * 2


def device_copy_bandwidth(device) -> float:
    """Bytes read plus written per second by a 1 GiB device-to-device copy."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3
    return 2 * src.numel() / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=None, help="commit id to record (the device copy has no .git)")
    args = parser.parse_args()
    device = torch.device("cuda")
    spec = AttentionSpec(kind="hstu", num_heads=HEADS, head_dim=DIM, page_size=PAGE, dtype=torch.bfloat16,
                         device_type="cuda", alpha=DIM**-0.5, scaling_seqlen=20_000)
    triton_backend, ref_backend = HSTUTritonBackend(spec), TorchRefBackend(spec)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    hbm = device_copy_bandwidth(device)
    result = {"gpu": torch.cuda.get_device_name(), "commit": commit or "unknown", "torch": torch.__version__,
              "triton": triton.__version__, "heads": HEADS, "head_dim": DIM, "page_size": PAGE, "dtype": "bfloat16",
              "hbm_copy_GBps": hbm / 1e9, "hstu_triton_prefill_tflops": {},
              "hstu_triton_prefill_graph_tflops": {}, "hstu_triton_prefill_dense_tflops": {},
              "hstu_triton_prefill_dense_graph_tflops": {}, "torch_ref_prefill_tflops": {},
              "sdpa_prefill_tflops": {}, "prefill_ms": {}, "delta_hbm_fraction": {}, "delta_ms": {},
              "delta_torch_ref_ms": {}, "decode_hbm_fraction": {}, "decode_ms": {},
              "time_bias_ms": {}}
    for t in (1024, 4096, 8192, 16384):
        flops = 2 * HEADS * DIM * t * t
        step = make_step([0], [t], [0], device)
        tri = time_backend(triton_backend, step)
        tri_graph = time_backend(triton_backend, step, graph=True)
        dense = time_backend(triton_backend, step, dense=True)
        dense_graph = time_backend(triton_backend, step, graph=True, dense=True)
        ref = time_backend(ref_backend, step)
        q = torch.randn(1, HEADS, t, DIM, device=device, dtype=torch.bfloat16)
        sdpa = triton.testing.do_bench(lambda q=q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                                       return_mode="median") / 1e3
        result["hstu_triton_prefill_tflops"][t] = flops / tri / 1e12
        result["hstu_triton_prefill_graph_tflops"][t] = flops / tri_graph / 1e12
        result["hstu_triton_prefill_dense_tflops"][t] = flops / dense / 1e12
        result["hstu_triton_prefill_dense_graph_tflops"][t] = flops / dense_graph / 1e12
        result["torch_ref_prefill_tflops"][t] = flops / ref / 1e12
        result["sdpa_prefill_tflops"][t] = flops / sdpa / 1e12
        result["prefill_ms"][t] = {"hstu_triton": tri * 1e3, "hstu_triton_graph": tri_graph * 1e3,
                                   "hstu_triton_dense": dense * 1e3, "hstu_triton_dense_graph": dense_graph * 1e3,
                                   "torch_ref": ref * 1e3, "sdpa": sdpa * 1e3}
        del step
        torch.cuda.empty_cache()
        print(t, result["prefill_ms"][t], flush=True)
    for hist in (1024, 2048, 4096, 8192, 16384):
        batch = 8
        step = make_step([hist] * batch, [256] * batch, [100] * batch, device)
        tri = time_backend(triton_backend, step, graph=True)
        result["delta_hbm_fraction"][hist] = history_bytes(hist, 256, batch) / tri / hbm
        result["delta_ms"][hist] = tri * 1e3
        result["delta_torch_ref_ms"][hist] = time_backend(ref_backend, step) * 1e3
        print(hist, tri * 1e3, result["delta_hbm_fraction"][hist], flush=True)
        del step
        torch.cuda.empty_cache()
    for hist in (1024, 4096, 8192, 16384):
        batch = 8
        step = make_step([hist] * batch, [4] * batch, [12] * batch, device)
        tri = time_backend(triton_backend, step, graph=True)
        result["decode_hbm_fraction"][hist] = history_bytes(hist, 4, batch) / tri / hbm
        result["decode_ms"][hist] = {"graph": tri * 1e3, "launched": time_backend(triton_backend, step) * 1e3}
        print("decode", hist, result["decode_ms"][hist], result["decode_hbm_fraction"][hist], flush=True)
        del step
        torch.cuda.empty_cache()
    buckets = 64
    bias_backend = HSTUTritonBackend(dataclasses.replace(spec, time_bias_buckets=buckets))
    bias = torch.randn(buckets, HEADS, device=device, dtype=torch.float32)
    for name, shape in (("prefill_8192", ([0], [8192], [0])), ("delta_8192", ([8192] * 8, [256] * 8, [100] * 8))):
        step = make_step(*shape, device, timestamps=True)
        result["time_bias_ms"][name] = {"off": time_backend(triton_backend, step) * 1e3,
                                        "on": time_backend(bias_backend, step, bias) * 1e3}
        print("time bias", name, result["time_bias_ms"][name], flush=True)
        del step
        torch.cuda.empty_cache()
    result["command"] = "python benchmarks/kernel_bench.py --out " + args.out
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
