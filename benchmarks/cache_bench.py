"""Host-tier transfer bandwidth and cache-manager CPU overhead, on the GPU machine.

    python benchmarks/cache_bench.py --out benchmarks/results/cache_bench.json

1. Peak pinned host->device bandwidth (the benchmark's measurement: median of 5 copies of 256 MiB), for reference.
2. Onload bandwidth of the transfer engine the cache builds by default (on CUDA: host chunks -> device staging
   buffer by batched DMA -> the onload kernel into pages, one event per layer), for chunk sizes 512..4096 tokens,
   benchmark model KV (8 layers, 4 heads x 128, bf16, page 32), and offload bandwidth (pages -> host slots).
3. CPU time per batch of 8 returning users with 100,000 users known to the cache, split into metadata
   preparation + eviction (acquire, page table, and the batch metadata's upload: the engine's staging of a step
   replayed from CUDA graphs, ``StepGraphs.stage``, for steps that fit one; ``prepare_eager``: the eager path's
   ``PagedBatchMetadata.from_layout`` instead), launching onloads, and commit + release + launching offloads; for
   users drawn at random (mostly host hits and evictions) and among the 800 most recent (mostly GPU hits).
Medians over repetitions; all parts measured in the same run. ``host_python_loop_us`` (a 1,000-step Python loop, as
``gr-engine bench`` reports it) tells how fast this instance's host is.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from attention_backends import AttentionSpec, PagedBatchMetadata
from attention_backends.hstu_triton import HSTUTritonBackend
from cache_engine import CacheConfig, HostChunkStore, KVCacheManager, OffloadJob, OnloadJob, TransferEngine
from cache_engine.prefix_hash import page_prefix_hashes
from gr_engine.bench.experiments import host_python_loop_us, peak_h2d_GBps
from gr_engine.step_graphs import StepGraphs


def cuda_time(fn: Callable[[], None], reps: int) -> float:
    """Median seconds of ``fn()`` measured with CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def transfer_bandwidth(device: torch.device, chunk_tokens: int, tokens: int, layers: int = 8, heads: int = 4,
                       dim: int = 128, page: int = 32) -> dict:
    """Onload and offload of ``tokens`` tokens in chunks of ``chunk_tokens`` between pinned host slots and shuffled
    device pages, by the default transfer engine; checks that both move the right data."""
    chunk_pages = chunk_tokens // page
    num_chunks = tokens // chunk_tokens
    kv = torch.zeros(layers, num_chunks * chunk_pages * 2, 2, page, heads, dim, dtype=torch.bfloat16, device=device)
    shape = (layers, chunk_pages, 2, page, heads, dim)
    store = HostChunkStore(num_chunks, shape, torch.bfloat16, num_chunks, pin=True)
    store.wait_until_allocated()
    for s in range(num_chunks):
        store.slot(s).copy_(torch.randn(shape).to(torch.bfloat16))
    transfer = TransferEngine(device, scales=None, slot_addresses=store.addresses)
    # Job pages as the engine's cache manager hands them over: int64 arrays.
    pages = np.random.default_rng(0).permutation(kv.shape[1])[: num_chunks * chunk_pages]
    onload_jobs = [OnloadJob(c, store.slot(c), pages[c * chunk_pages:(c + 1) * chunk_pages]) for c in range(num_chunks)]

    def onload() -> None:
        events = transfer.onload(kv, onload_jobs)
        torch.cuda.current_stream().wait_event(events[-1])

    onload()
    torch.cuda.synchronize()
    # correctness of the pipeline: every page holds its chunk's data
    for c in (0, num_chunks - 1):
        got = kv[:, pages[c * chunk_pages:(c + 1) * chunk_pages]].cpu()
        assert torch.equal(got, store.slot(c)), "onload produced wrong pages"
    nbytes = tokens * layers * 2 * heads * dim * 2
    onload_s = cuda_time(onload, 9)
    offload_jobs = [OffloadJob(pages[c * chunk_pages:(c + 1) * chunk_pages], c, store.slot(c), chunk_pages * page)
                    for c in range(num_chunks)]

    def offload() -> None:
        torch.cuda.current_stream().wait_event(transfer.offload(kv, offload_jobs))

    for s in range(num_chunks):  # the offload must write these slots again
        store.slot(s).zero_()
    offload()
    torch.cuda.synchronize()
    for c in (0, num_chunks - 1):  # correctness: every slot holds its pages
        assert torch.equal(kv[:, pages[c * chunk_pages:(c + 1) * chunk_pages]].cpu(), store.slot(c)), \
            "offload produced wrong slots"
    offload_s = cuda_time(offload, 9)
    return {"chunk_tokens": chunk_tokens, "tokens": tokens, "bytes": nbytes,
            "onload_ms": onload_s * 1e3, "onload_GBps": nbytes / onload_s / 1e9,
            "offload_ms": offload_s * 1e3, "offload_GBps": nbytes / offload_s / 1e9}


def metadata_overhead(device: torch.device, num_users: int = 100_000, batch: int = 8, steps: int = 300,
                      history: int = 1000, new_events: int = 20) -> dict:
    """CPU seconds per batch for the cache manager's work, with ``num_users`` users known."""
    config = CacheConfig(mode="hierarchical", page_size=32, num_gpu_pages=40_960, chunk_tokens=1024,
                         host_budget_bytes=num_users * 2 * 1024 * 8 * 2, host_segment_bytes=2**28)
    kv = KVCacheManager(config, num_layers=1, num_heads=1, head_dim=4, dtype=torch.float16, device=device)
    kv.host.store.wait_until_allocated()
    # The engine's staging of a step replayed from CUDA graphs (benchmark model: 4 heads x 128, bf16, page 32).
    spec = AttentionSpec(kind="hstu", num_heads=4, head_dim=128, page_size=32, dtype=torch.bfloat16,
                         device_type=device.type, alpha=128**-0.5, scaling_seqlen=20_000)
    graphs = StepGraphs(HSTUTritonBackend(spec), device, 32, 4096, batch, config.num_gpu_pages)
    token_ids = np.zeros(4096, dtype=np.int64)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 10**6, num_users)  # user u's events are base[u] + 0, 1, 2, ...
    lengths = np.full(num_users, history)

    def serve(users):
        events = [base[u] + np.arange(lengths[u]) for u in users]
        hashes = [page_prefix_hashes(e, e % 7, np.arange(len(e)), 32) for e in events]
        t0 = time.perf_counter()
        kv.begin_step()
        hits = [kv.acquire(int(u), h, len(h)) for u, h in zip(users, hashes)]
        assert all(h is not None for h in hits)
        indptr, indices = kv.page_table([int(u) for u in users], [len(h) for h in hashes])
        done = np.array([hit.total for hit in hits])
        layout = {"history_start": done, "num_history_rows": lengths[users] - done,
                  "num_candidate_rows": np.full(len(users), 100), "kv_indptr": indptr, "kv_indices": indices}
        rows = int(layout["num_history_rows"].sum()) + 100 * len(users)
        tokens = {"item_ids": token_ids[:rows], "action_ids": token_ids[:rows]}
        t_table = time.perf_counter()
        staged = graphs.fits(rows, len(users), rows - 100 * len(users), len(indices))
        if staged:  # the engine's path for a step replayed from CUDA graphs
            graphs.stage(layout, tokens)
        t_staged = time.perf_counter()
        PagedBatchMetadata.from_layout(*layout.values(), 32, device)  # the eager path's metadata
        t_eager = time.perf_counter()
        kv.launch_onloads()
        t2 = time.perf_counter()
        for u, h in zip(users, hashes):
            kv.commit(int(u), len(h), h)
            kv.release(int(u))
        kv.end_step()
        table, staging, eager = t_table - t0, t_staged - t_table, t_eager - t_staged
        prepare = table + (staging if staged else eager)  # what the engine would spend on this step
        return (prepare, table + eager, t2 - t_eager, time.perf_counter() - t2, staged), hits

    for start in range(0, num_users, batch):  # everybody's first visit
        serve(np.arange(start, min(start + batch, num_users)))
    results = {}
    for name, pool in (("random_users", np.arange(num_users)), ("recent_users", np.arange(num_users - 800, num_users))):
        times, host_hits, gpu_hits = [], 0, 0
        for _ in range(steps):
            users = rng.choice(pool, batch, replace=False)
            lengths[users] += new_events
            seconds, hits = serve(users)
            times.append(seconds)
            host_hits += sum(h.host for h in hits)
            gpu_hits += sum(h.gpu for h in hits)
        ms = np.asarray(times)[:, :4] * 1e3
        results[name] = {"prepare_median_ms": float(np.median(ms[:, 0])),
                         "prepare_p90_ms": float(np.percentile(ms[:, 0], 90)),
                         "prepare_eager_median_ms": float(np.median(ms[:, 1])),
                         "staged_steps": int(sum(t[4] for t in times)),
                         "onload_launch_median_ms": float(np.median(ms[:, 2])),
                         "commit_and_offload_launch_median_ms": float(np.median(ms[:, 3])),
                         "host_hit_tokens": int(host_hits), "gpu_hit_tokens": int(gpu_hits)}
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"users_known": len(kv.users), "batch": batch, "history": history, "new_events": new_events, **results,
            "evicted_users": kv.stats.evicted_users}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=49_152, help="tokens moved per transfer measurement")
    parser.add_argument("--commit", default=None, help="commit id to record (the device copy has no .git)")
    parser.add_argument("--metadata-only", action="store_true", help="only part 3 (the cache manager's CPU time)")
    args = parser.parse_args()
    device = torch.device("cuda")
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    result = {"gpu": torch.cuda.get_device_name(), "commit": commit or "unknown", "torch": torch.__version__,
              "python": platform.python_version(),
              # this instance's host speed (hosts differ by up to ~2x): compare metadata times with it in mind
              "host_python_loop_us": host_python_loop_us()}
    if not args.metadata_only:
        result |= {"peak_pinned_h2d_GBps": peak_h2d_GBps(str(device)),
                   "transfers": [transfer_bandwidth(device, c, args.tokens) for c in (512, 1024, 2048, 4096)]}
    result["metadata"] = metadata_overhead(device)
    result["command"] = "python benchmarks/cache_bench.py " + " ".join(sys.argv[1:])
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
