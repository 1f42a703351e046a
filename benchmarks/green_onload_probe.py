"""Can the onload kernel run on a few multiprocessors only, beside a forward, through a CUDA green context?

    python benchmarks/green_onload_probe.py --out X.json [--sms 1 8 16 32]

A diagnostic for ``hier_over_bound_bs8``: device timelines show a forward's kernels starting only at the tail of
each per-layer onload kernel (thousands of queued programs hold the block scheduler), even on a high-priority
stream (``benchmarks/results/profiles/timeline_prioritise_*``). A green context of N multiprocessors confines
kernels launched on its stream to those N. This probe onloads 49,152 tokens of benchmark KV (bf16 host pages,
8 layers, one launch per layer, as ``onload_sweep.py`` does) and, on the default stream, runs a stand-in forward
(``--forward-reps`` bf16 matmuls of 4096 x 4096, sequential). It reports, with medians of CUDA-event timings:

- the onload alone and the stand-in alone;
- both at once, with the onload on an ordinary stream and on the green context's stream of each ``--sms``,
  as the time until each is done (both queued together; the onload first, as a prefetch queues it);
- whether the green-context onload wrote exactly what the ordinary one did.

One multiprocessor (the first ``--sms``) shows whether the confinement takes effect at all: its onload alone must
be much slower than the unconfined one.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from onload_sweep import onload_all_layers  # this script's folder is on the path when run as a script


def timed_pair(onload, forward, onload_stream: torch.cuda.Stream, reps: int = 7) -> tuple[float, float]:
    """Median ms until the onload (queued first, on ``onload_stream``) and the forward (the current stream) are
    done, both queued at once after the current stream's work so far."""
    current = torch.cuda.current_stream()
    onload_done, forward_done = [], []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        start.record(current)
        onload_stream.wait_event(start)
        with torch.cuda.stream(onload_stream):
            onload()
            end_onload = torch.cuda.Event(enable_timing=True)
            end_onload.record(onload_stream)
        forward()
        end_forward = torch.cuda.Event(enable_timing=True)
        end_forward.record(current)
        current.wait_event(end_onload)
        torch.cuda.synchronize()
        onload_done.append(start.elapsed_time(end_onload))
        forward_done.append(start.elapsed_time(end_forward))
    return float(np.median(onload_done)), float(np.median(forward_done))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sms", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--forward-reps", type=int, default=40)
    parser.add_argument("--commit", default="")
    args = parser.parse_args()
    from torch.cuda.green_contexts import SUPPORTED, GreenContext

    layers, heads, dim, page, chunk_pages, tokens = 8, 4, 128, 32, 32, 49_152
    num_pages = tokens // page
    pool = torch.zeros(layers, 2 * num_pages, 2, page, heads, dim, dtype=torch.bfloat16, device="cuda")
    dst_pages = torch.from_numpy(np.random.default_rng(0).permutation(2 * num_pages)[:num_pages]).cuda()
    chunks = num_pages // chunk_pages
    host = torch.randn(chunks, layers, chunk_pages, 2, page, heads, dim).to(torch.bfloat16).pin_memory()
    slot_ids = torch.arange(num_pages, device="cuda") // chunk_pages
    addr = (host.data_ptr() + (slot_ids.cpu() * host.stride(0) + torch.arange(num_pages) % chunk_pages
                               * host.stride(2)) * host.element_size()).cuda()
    layer_bytes = host.stride(1) * host.element_size()
    nbytes = host.numel() * host.element_size()

    def onload() -> None:
        onload_all_layers(pool, addr, dst_pages, layer_bytes, torch.bfloat16, slot_ids, None, 8, 8)

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def forward() -> None:
        for _ in range(args.forward_reps):
            torch.mm(a, b)

    plain = torch.cuda.Stream()
    onload()
    forward()
    torch.cuda.synchronize()
    expected = pool.clone()
    alone_onload, _ = timed_pair(onload, lambda: None, plain)
    _, alone_forward = timed_pair(lambda: None, forward, plain)
    together = timed_pair(onload, forward, plain)
    result = {"gpu": torch.cuda.get_device_name(), "commit": args.commit, "torch": torch.__version__,
              "green_contexts_supported": bool(SUPPORTED), "onload_bytes": nbytes,
              "onload_alone_ms": alone_onload, "onload_alone_GBps": nbytes / alone_onload / 1e6,
              "forward_alone_ms": alone_forward,
              "plain_stream": {"onload_done_ms": together[0], "forward_done_ms": together[1]}, "green": []}
    print(json.dumps(result), flush=True)
    for sms in args.sms:
        entry: dict = {"sms": sms}
        try:
            context = GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
            if hasattr(context, "Stream"):
                stream = context.Stream()
            else:  # older torch: a stream made while the green context is current belongs to it
                context.set_context()
                stream = torch.cuda.Stream()
                context.pop_context()
            pool.zero_()
            timed_pair(onload, lambda: None, stream, reps=1)
            entry["exact"] = bool(torch.equal(pool, expected))
            entry["onload_alone_ms"] = timed_pair(onload, lambda: None, stream)[0]
            entry["onload_alone_GBps"] = nbytes / entry["onload_alone_ms"] / 1e6
            entry["onload_done_ms"], entry["forward_done_ms"] = timed_pair(onload, forward, stream)
        except Exception as exc:  # the probe's question: does this work at all here
            entry["error"] = f"{type(exc).__name__}: {exc}"
        result["green"].append(entry)
        print(json.dumps(entry), flush=True)
    result["command"] = "python benchmarks/green_onload_probe.py --out " + args.out
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
