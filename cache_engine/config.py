"""Configuration of the KV cache."""

from __future__ import annotations

from typing import Literal

import msgspec

CacheMode = Literal["recompute", "gpu_only", "hierarchical", "unlimited"]
HostDType = Literal["kv", "float8_e4m3fn"]


class CacheConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where users' KV lives and how long it is kept (docs/tuning.md says how to size it).

    Attributes:
        mode: ``recompute``: nothing is reused (every request encodes its whole history; pages are
            scratch space freed when the request finishes). ``gpu_only``: each user's KV stays in GPU
            pages across visits; when pages run out the least recently used unlocked users are evicted
            and their KV is lost. ``hierarchical`` (default): like ``gpu_only``, but every user's KV is also
            persisted in host-memory chunks, so an evicted user is loaded back instead of recomputed.
            ``unlimited``: nothing is ever evicted; the pool must be large enough for everyone (the
            ideal to measure against); a request that cannot get pages fails with a clear error.
        page_size: tokens per KV page (FlashInfer's ``page_size``); default 32.
        num_gpu_pages: pages in the GPU pool; default 4,096. Each page holds
            ``num_layers * 2 * page_size * num_heads * head_dim`` values.
        chunk_tokens: tokens per host chunk (a multiple of ``page_size``); a user's history is
            persisted to host one chunk at a time as it fills; default 1,024.
        host_budget_bytes: size of the host chunk pool (``hierarchical`` only); default 8 GiB. Pinned on CUDA, in
            the background, so start-up does not wait for it.
        host_segment_bytes: the host pool is allocated (and pinned) in segments of about this size, default 256 MiB;
            a segment's slots are used as soon as it is pinned.
        max_pending_offloads: most chunks whose copy to host may be in flight; further full chunks wait for a
            later step (admission control); default 64.
        persist_tails: before GPU pages of a user are reclaimed, also persist the un-persisted tail
            (less than a chunk), so eviction loses nothing (default). ``False`` loses it, as MTServe does.
        host_dtype: ``"kv"`` (default) keeps host chunks in the KV dtype (exact); ``"float8_e4m3fn"`` stores them in
            FP8 with one scale per (chunk, layer, K/V, head): half the host memory and PCIe bytes, scores
            no longer exactly equal to recomputing (the benchmark reports the drift).
        staging_pages: on CUDA, pages (of every layer) of the device buffer that onloads are copied into by DMA,
            allocated once at the host dtype; default 4,096 (1 GiB for the benchmark's FP8 chunks). An onload of
            more pages reads host memory directly, which takes multiprocessors from the forward.
        prefetch: as requests arrive, before they are validated and scheduled, start loading the host-resident
            history of their users who hold no GPU pages (``hierarchical``; default on): the onload then starts an
            intake and a scheduling earlier. The request's own verified prefix still decides what is reused.
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
