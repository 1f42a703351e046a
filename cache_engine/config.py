"""Configuration of the KV cache."""

from __future__ import annotations

from typing import Literal

import msgspec

CacheMode = Literal["recompute", "gpu_only", "hierarchical", "unlimited"]
HostDType = Literal["kv", "float8_e4m3fn"]
OnloadEngine = Literal["copy", "kernel", "dma"]


class CacheConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where users' KV lives and how long it is kept.

    Attributes:
        mode: ``recompute``: nothing is reused (every request encodes its whole history; pages are
            scratch space freed when the request finishes). ``gpu_only``: each user's KV stays in GPU
            pages across visits; when pages run out the least recently used unlocked users are evicted
            and their KV is lost. ``hierarchical``: like ``gpu_only``, but every user's KV is also
            persisted in host-memory chunks, so an evicted user is loaded back instead of recomputed.
            ``unlimited``: nothing is ever evicted; the pool must be large enough for everyone (the
            ideal to measure against); a request that cannot get pages fails with a clear error.
        page_size: tokens per KV page (FlashInfer's ``page_size``).
        num_gpu_pages: pages in the GPU pool. Each page holds
            ``num_layers * 2 * page_size * num_heads * head_dim`` values.
        chunk_tokens: tokens per host chunk (a multiple of ``page_size``); a user's history is
            persisted to host one chunk at a time as it fills.
        host_budget_bytes: size of the host chunk pool (``hierarchical`` only). Pinned on CUDA; pinned
            in the background so start-up does not wait for it.
        host_segment_bytes: the host pool is allocated (and pinned) in segments of about this size.
        max_pending_offloads: most chunks whose device-to-host copy may be in flight (admission
            control: further full chunks wait for a later step).
        persist_tails: before GPU pages of a user are reclaimed, also persist the un-persisted tail
            (less than a chunk), so eviction loses nothing. ``False`` reproduces MTServe, which loses it.
        host_dtype: ``"kv"`` keeps host chunks in the KV dtype (exact); ``"float8_e4m3fn"`` stores them in
            FP8 with one scale per (chunk, layer, K/V, head): half the host memory and PCIe bytes, scores
            no longer exactly equal to recomputing (the benchmark reports the drift).
        onload_streams: CUDA streams the host-to-device chunk copies are spread over (``copy`` engine).
        onload_engine: how KV moves between pages and host chunks on CUDA. ``"dma"`` (default; CUDA with Triton
            and a driver with batched copies, else ``"kernel"``): offloads by kernel (below); onloads by DMA, each
            layer's chunk copies in one driver call (:mod:`cache_engine.batched_copy`) into a device staging
            buffer, then the onload kernel reads that buffer into the pages (dequantising FP8), so the bytes
            crossing PCIe take no multiprocessors from the forward. Measured on the H200 against ``"kernel"``
            over the benchmark's batches of 8: -1.30 ms a batch (median of the batch differences, two runs
            each), latency ~ 1.92 ms + bytes / 50.6 GB/s against 2.30 ms + bytes / 44.0
            (``benchmarks/results/profiles/bound_probe_engines_1599954.log``). ``"kernel"``: one Triton kernel
            per layer reads the host pages directly (pinned memory is device-addressable) and writes the pages
            (:mod:`cache_engine.onload_kernel`), and one kernel gathers (and quantises) an offload's chunks and
            stores them into their host slots (:mod:`cache_engine.offload_kernel`); without Triton installed,
            ``"copy"`` is used. ``"copy"``: DMA copies (one driver call per layer where the driver has batched
            copies) into a device buffer, then a scatter into the pages; offloads gathered and quantised with
            torch operations, then a copy per chunk (more host work per step). On CPU all three are synchronous
            copies.
        onload_graphs: with the ``kernel`` engine on CUDA, replay each step's per-layer onload launches from a
            CUDA graph (:mod:`cache_engine.onload_graphs`): one launch for the host instead of one per layer.
        dma_graphs: with the ``dma`` engine and ``onload_graphs``, replay the onload kernels from CUDA graphs too,
            each layer's kernel waiting inside the graph for that layer's copies (:mod:`cache_engine.dma_staging`).
            Its graphs are captured before serving (:meth:`~cache_engine.KVCacheManager.warm_transfers`). Off by
            default: the replay was meant to save an onload's 8 kernel launches, 8 waits and 8 event records (~180 us
            of host time on the H200's host, ``benchmarks/results/profiles/host_breakdown_bd444c1.json``), but over
            the benchmark's batches it saved no measurable host time and was 0.1-0.3 ms a batch slower (two A/B
            runs: ``benchmarks/results/profiles/bound_probe_dma_graphs_d8be018.log``,
            ``bound_probe_dma_graphs_ad1afb7.log``), as step graphs waiting on onload events were
            (:mod:`gr_engine.step_graphs`): a graph's event-wait nodes on copies still in flight cost its launch.
        staging_pages: ``dma`` engine: pages (of every layer) of the device staging buffer, allocated once at the
            pool's host dtype (4,096 pages of the benchmark's FP8 chunks: 1 GiB); an onload of more pages reads host
            memory directly, as ``kernel`` does. Also the largest onload whose graph is captured before serving.
        onload_group_bytes: with the ``kernel`` and ``dma`` engines on CUDA (onloads launched eagerly, not replayed
            from graphs), an onload moves as many consecutive layers per kernel launch and (``dma``) per driver call
            as fit in this many bytes of host pages (at least one layer), with one event per group that each of its
            layers waits for: a small onload, over before the forward would start its layers anyway, then costs the
            host one launch, copy call, record and wait instead of one per layer. 0 (default): one layer at a time.
            Measured on the H200 over the benchmark's batches of 8 (two runs per arm): 32 MiB saved 0.07 ms of host
            time a batch and the median of the batch differences was -0.07 ms, within run-to-run noise; 8 MiB was
            0.09 ms slower (``benchmarks/results/profiles/bound_probe_group_bytes_d42a510.log``). Fixed groups of 4
            layers saved 0.20 ms of host time but cost 0.18 ms a batch (``bound_probe_layer_group_b149f5a.log``):
            a layer's attention waiting for its group's copies costs more than the launches save.
        prefetch: as requests arrive, before they are validated and hashed, start loading the host-resident
            history of their users who hold no GPU pages (``hierarchical``): the onload then starts about an intake
            and a scheduling earlier. The request's own verified prefix still decides what is reused. Measured on
            the H200 (``benchmarks/results/profiles/bound_probe_prefetch_f694434.log``): 0.83 ms a batch faster
            (median of the per-batch differences; 7.05 -> 5.18 ms median at batch size 8).
        onload_first: ``hierarchical``: launch a step's (or prefetch's) onloads before the copies to host of the
            users just evicted, without waiting for those copies' gathers, when none of the pages handed out since
            the last launch is still to be read by a copy to host (otherwise, and without the option, the copies
            go first and every write waits for their gathers). An evicted user's pages being copied are then given
            back below all other free pages, and evictions go on until enough other pages are free, so that the
            pages handed out are rarely being copied. Measured on the H200: no difference beyond run-to-run noise
            (``benchmarks/results/profiles/bound_probe_aa_0b9577f.log``: two runs of one configuration differ by
            0.1-0.3 ms a batch), so off by default.
        onload_sms: on CUDA: if positive, the onload kernels run on at most this many
            multiprocessors (a CUDA green context; an ordinary stream, with a warning, where there is none), so that
            a layer whose pages have arrived need not wait behind the queued programs of later layers' onloads:
            device timelines show the forward's kernels starting only at the tail of each onload kernel
            (``benchmarks/results/profiles/timeline_0b9577f/``). 0 (default): no confinement. Measured on the
            H200 (``benchmarks/results/green_onload_probe_1599954.json``): confinement works (a kernel onload on one
            multiprocessor still reads 50 GB/s, and a stand-in forward beside it ends at 11.0 ms instead of 23.5);
            but with the ``kernel`` engine the benchmark's batches gained 0.18 ms at 16 multiprocessors, within
            run-to-run noise, and lost 2.7 ms a batch against ``dma`` at 2 or 8 (their onloads slowed to 5-27 GB/s;
            ``bound_probe_green_kernel_d874f32.log``); the ``dma`` engine's onload kernels read device memory
            only (``bound_probe_engines_1599954.log``).
    """

    mode: CacheMode = "hierarchical"
    page_size: int = 32
    num_gpu_pages: int = 4096
    chunk_tokens: int = 1024
    host_budget_bytes: int = 2**33
    host_segment_bytes: int = 2**28
    max_pending_offloads: int = 64
    persist_tails: bool = True
    host_dtype: HostDType = "kv"
    onload_streams: int = 1
    onload_engine: OnloadEngine = "dma"
    onload_graphs: bool = True
    dma_graphs: bool = False
    staging_pages: int = 4096
    onload_group_bytes: int = 0
    prefetch: bool = True
    onload_first: bool = False
    onload_sms: int = 0

    def __post_init__(self) -> None:
        for name in ("page_size", "num_gpu_pages", "chunk_tokens", "host_segment_bytes", "max_pending_offloads",
                     "onload_streams", "staging_pages"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cache.{name} must be positive, got {getattr(self, name)}")
        for name in ("onload_sms", "onload_group_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"cache.{name} must be >= 0, got {getattr(self, name)}")
        if self.host_budget_bytes < 0:
            raise ValueError(f"cache.host_budget_bytes must be >= 0, got {self.host_budget_bytes}")
        if self.chunk_tokens % self.page_size:
            raise ValueError(
                f"cache.chunk_tokens ({self.chunk_tokens}) must be a multiple of cache.page_size ({self.page_size})"
            )

    @property
    def chunk_pages(self) -> int:
        """Pages per host chunk."""
        return self.chunk_tokens // self.page_size
