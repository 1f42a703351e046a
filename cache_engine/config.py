"""Configuration of the KV cache."""

from __future__ import annotations

from typing import Literal

import msgspec

CacheMode = Literal["recompute", "gpu_only", "hierarchical", "unlimited"]
HostDType = Literal["kv", "float8_e4m3fn"]


class CacheConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where users' KV lives and how long it is kept (docs/tuning.md says how to size it).

    Attributes:
        mode: ``recompute`` (nothing reused; pages are scratch, freed when the request finishes), ``gpu_only`` (KV
            stays in GPU pages across visits; the LRU unlocked users' KV is lost when pages run out),
            ``hierarchical`` (default: ``gpu_only`` plus host chunks, so an evicted user is loaded back, not
            recomputed) or ``unlimited`` (never evicts, the ideal to measure against; a request that cannot get pages
            fails with a clear error). See docs/design.md section 5, "Modes".
        page_size: tokens per KV page (FlashInfer's ``page_size``); default 32.
        num_gpu_pages: pages in the GPU pool, each ``num_layers * 2 * page_size * num_heads * head_dim`` values;
            default 4,096.
        chunk_tokens: tokens per host chunk (a multiple of ``page_size``), persisted as it fills; default 1,024.
        host_budget_bytes: size of the host chunk pool (``hierarchical`` only); default 8 GiB, pinned on CUDA in the
            background so start-up does not wait.
        host_segment_bytes: the host pool is allocated and pinned in segments of about this size (default 256 MiB),
            each segment's slots usable once it is pinned.
        max_pending_offloads: most chunk copies to host in flight; further full chunks wait for a later step
            (admission control); default 64.
        persist_tails: before a user's GPU pages are reclaimed, persist its un-persisted tail (under a chunk) too,
            so eviction loses nothing (default); ``False`` loses it, as MTServe does.
        host_dtype: ``"kv"`` (default, exact) or ``"float8_e4m3fn"``: FP8 with one scale per (chunk, layer, K/V,
            head), half the host memory and PCIe bytes, scores no longer exactly the recomputed ones.
        staging_pages: on CUDA, pages (of every layer) of the device buffer onloads are DMA-copied into, allocated
            once at the host dtype; default 4,096. A larger onload reads host memory directly, which takes
            multiprocessors from the forward.
        prefetch: as requests arrive, before validation and scheduling, start loading the host-resident history of
            their users holding no GPU pages (``hierarchical``; default on); the request's own verified prefix still
            decides what is reused.
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
    staging_pages: int = 4096
    prefetch: bool = True

    def __post_init__(self) -> None:
        for name in ("page_size", "num_gpu_pages", "chunk_tokens", "host_segment_bytes", "max_pending_offloads",
                     "staging_pages"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cache.{name} must be positive, got {getattr(self, name)}")
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
