"""Host time of the CUDA-facing calls on the engine's per-step path (a diagnostic: what each call costs the host).

    python benchmarks/host_api_costs.py [--out costs.json] [--host-only]

Each call is repeated (device work trivial: tiny tensors) and timed with ``time.perf_counter``; medians of
batches, in microseconds per call. The GPU machine's host runs Python several times slower than a dev box,
and CUDA driver calls cost it more still: this says which calls to avoid or batch on the hot path. The host-only
part (pure Python, small numpy calls and two of the engine's numpy-heavy helpers at the benchmark's sizes) runs
anywhere (``--host-only``: nothing else): the same numbers from a dev box and from the GPU machine, and against
``host_breakdown.py``'s in-step times of the same helpers, say whether the GPU machine's host is slow or the engine
makes it slow.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def per_call_us(fn, calls: int = 200, batches: int = 7, sync: bool = True) -> float:
    fn()
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
        if sync:
            torch.cuda.synchronize()
    return float(np.median(times)) * 1e6


def host_costs() -> dict[str, float]:
    """Microseconds per call of host-only work: a Python loop, small numpy calls, and ``layout_arrays`` /
    ``host_page_addresses`` at a benchmark batch's sizes (8 requests of ~10,000 cached events; 10 chunks)."""
    from attention_backends.base import layout_arrays
    from cache_engine.jobs import OnloadJob, host_page_addresses

    rng = np.random.default_rng(0)
    start, hist, cand = rng.integers(500, 20_000, 8), rng.integers(1, 40, 8), np.full(8, 100)
    pages = -(-(start + hist) // 32)
    indptr = np.concatenate([[0], np.cumsum(pages)])
    indices = rng.permutation(50_000)[: indptr[-1]]
    # 10 host chunks of 32 pages of 32 tokens, 8 layers (the benchmark's; heads and dims small: only the page count
    # matters here, and the memory is never touched)
    slots = torch.empty(10, 8, 32, 2, 32, 1, 16, dtype=torch.uint8)
    jobs = [OnloadJob(i, slots[i], np.arange(32 * i, 32 * i + 32, dtype=np.int32)) for i in range(10)]
    small = np.arange(8, dtype=np.int64)
    return {
        "python: sum(range(1000))": per_call_us(lambda: sum(range(1000)), sync=False),
        "numpy: np.cumsum([8])": per_call_us(lambda: np.cumsum(small), sync=False),
        "numpy: np.repeat([8], [8])": per_call_us(lambda: np.repeat(small, small), sync=False),
        "numpy: np.concatenate(3 x [8])": per_call_us(lambda: np.concatenate([small, small, small]), sync=False),
        "layout_arrays (8 requests)": per_call_us(
            lambda: layout_arrays(start, hist, cand, indptr, indices, 32), sync=False),
        "host_page_addresses (10 chunks)": per_call_us(lambda: host_page_addresses(jobs), sync=False),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--host-only", action="store_true", help="only the host-only part (no CUDA needed)")
    args = parser.parse_args()
    if args.host_only:
        costs = host_costs()
        for name, us in costs.items():
            print(f"{us:9.2f} us  {name}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"us_per_call": costs}, f, indent=1)
        return
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
        **host_costs(),
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
        args_ = (kv, addresses, index, index, kv, index, 0, 0, 0, 0, 1, 4, 32)  # Count: a placeholder (HAS_COUNT off)
        consts = dict(SRC_DTYPE=POINTER_DTYPES[torch.bfloat16], ROW=512, BLOCK=512, HEAD_DIM=128, ROWS=8,
                      HAS_SCALES=False, HAS_COUNT=False)
        compiled = ok._onload_pages_kernel[(16, 8)](*args_, **consts, num_warps=8)
        launcher = compiled[(16, 8, 1)]
        raw = torch.cuda.current_stream(device).cuda_stream
        every = (*args_, *consts.values())
        costs["triton compiled-kernel launch (16 pages)"] = per_call_us(lambda: launcher(*every, stream=raw))
        # As the engine launches (kernel_cache.CompiledKernels): the compiled launcher, index arrays in pinned host
        # memory, given as tensors (the launcher asks the driver about each pointer) or as their addresses.
        pinned_index, pinned_addresses = index.cpu().pin_memory(), addresses.cpu().pin_memory()
        as_tensors = (kv, pinned_addresses, pinned_index, pinned_index, kv, pinned_index, 0, 0, 0, 0, 1, 4, 32,
                      *consts.values())
        as_ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in as_tensors)
        run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
        for name, every_arg in (("tensors", as_tensors), ("ints", as_ints)):
            costs[f"triton compiled run, 6 pointers as {name}"] = per_call_us(
                lambda every_arg=every_arg: run(16, 8, 1, raw, function, metadata, None, None, None, *every_arg))
    except ImportError:
        pass
    for name, us in costs.items():
        print(f"{us:9.1f} us  {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(device), "us_per_call": costs}, f, indent=1)


if __name__ == "__main__":
    main()
