"""Host time of the CUDA-facing calls on the engine's per-step path (a diagnostic: what each call costs the host).

    python benchmarks/host_api_costs.py [--out costs.json]

Each call is repeated (device work trivial: tiny tensors) and timed with ``time.perf_counter``; medians of
batches, in microseconds per call. The GPU machine's host runs Python several times slower than a dev box,
and CUDA driver calls cost it more still: this says which calls to avoid or batch on the hot path.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def per_call_us(fn, calls: int = 200, batches: int = 7) -> float:
    fn()
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return float(np.median(times)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    stream, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    small = torch.zeros(1024, dtype=torch.int32, device=device)
    pinned = torch.zeros(1024, dtype=torch.int32, pin_memory=True)
    host = np.arange(1024, dtype=np.int32)
    event = torch.cuda.Event()
    event.record(stream)
    kv = torch.zeros(64, 2, 32, 4, 128, dtype=torch.bfloat16, device=device)
    index = torch.arange(16, device=device)
    graph = torch.cuda.CUDAGraph()
    static = torch.zeros(16, device=device)
    s = torch.cuda.Stream(device)
    s.wait_stream(stream)
    with torch.cuda.stream(s):
        static.add_(1)
    stream.wait_stream(s)
    with torch.cuda.graph(graph):
        static.add_(1)

    def stream_context():
        with torch.cuda.stream(side):
            pass

    def record_new_event():
        torch.cuda.Event().record(stream)

    def pin_fresh():
        torch.from_numpy(host).pin_memory()

    def pinned_empty():
        torch.empty(1024, dtype=torch.int32, pin_memory=True)

    def upload_pinned():
        pinned.numpy()[:] = host
        small.copy_(pinned, non_blocking=True)

    values = np.arange(3000, dtype=np.int64)
    ring_host = torch.zeros(4096, dtype=torch.long, pin_memory=True)
    ring_device = torch.zeros(4096, dtype=torch.long, device=device)

    def upload_allocating():  # TransferEngine._upload: torch's caching host allocator, then a new device tensor
        staged = torch.empty(len(values), dtype=torch.long, pin_memory=True)
        staged.numpy()[:] = values
        return staged.to(device, non_blocking=True)

    def upload_persistent():  # a kept pinned buffer and device buffer
        ring_host.numpy()[: len(values)] = values
        ring_device[: len(values)].copy_(ring_host[: len(values)], non_blocking=True)

    costs = {
        "upload 3000 int64: pinned torch.empty + fill + .to(device)": per_call_us(upload_allocating),
        "upload 3000 int64: kept pinned and device buffers": per_call_us(upload_persistent),
        "torch.cuda.current_stream()": per_call_us(lambda: torch.cuda.current_stream(device)),
        "torch.cuda.current_stream() no device": per_call_us(lambda: torch.cuda.current_stream()),
        "with torch.cuda.stream(side)": per_call_us(stream_context),
        "Event() + record(stream)": per_call_us(record_new_event),
        "event.record(stream) (reused)": per_call_us(lambda: event.record(stream)),
        "event.query() (done)": per_call_us(event.query),
        "event.synchronize() (done)": per_call_us(event.synchronize),
        "stream.wait_event(event)": per_call_us(lambda: stream.wait_event(event)),
        "stream.wait_stream(side)": per_call_us(lambda: stream.wait_stream(side)),
        "Tensor.pin_memory() 4 KiB": per_call_us(pin_fresh),
        "torch.empty(4 KiB, pin_memory=True)": per_call_us(pinned_empty),
        "numpy into pinned + copy_ non_blocking 4 KiB": per_call_us(upload_pinned),
        "pinned.to(device, non_blocking=True) 4 KiB": per_call_us(lambda: pinned.to(device, non_blocking=True)),
        "kv.index_select(0, 16 pages)": per_call_us(lambda: kv.index_select(0, index)),
        "small.add_(1)": per_call_us(lambda: small.add_(1)),
        "CUDAGraph.replay() (one kernel)": per_call_us(graph.replay),
        "torch.cuda.synchronize() (idle)": per_call_us(torch.cuda.synchronize),
        "small tensor .cpu() (4 KiB)": per_call_us(lambda: small.cpu()),
    }
    try:
        from cache_engine.onload_kernel import onload_pages
        src = torch.zeros(64, 2, 32, 4, 128, dtype=torch.bfloat16, pin_memory=True)
        addresses = torch.tensor([src[i].data_ptr() for i in range(16)], device=device)
        costs["triton onload_pages launch (16 pages)"] = per_call_us(
            lambda: onload_pages(kv, addresses, index, 0, torch.bfloat16))
        from cache_engine import onload_kernel as ok
        from cache_engine.kernel_cache import POINTER_DTYPES
        args_ = (kv, addresses, index, index, kv, index, 0, 0, 1, 4, 32)  # Count: a placeholder (HAS_COUNT off)
        consts = dict(SRC_DTYPE=POINTER_DTYPES[torch.bfloat16], ROW=512, BLOCK=512, HEAD_DIM=128, ROWS=8,
                      HAS_SCALES=False, HAS_COUNT=False)
        compiled = ok._onload_pages_kernel[(16, 8)](*args_, **consts, num_warps=8)
        launcher = compiled[(16, 8, 1)]
        raw = torch.cuda.current_stream(device).cuda_stream
        every = (*args_, *consts.values())
        costs["triton compiled-kernel launch (16 pages)"] = per_call_us(lambda: launcher(*every, stream=raw))
    except ImportError:
        pass
    for name, us in costs.items():
        print(f"{us:9.1f} us  {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(device), "us_per_call": costs}, f, indent=1)


if __name__ == "__main__":
    main()
