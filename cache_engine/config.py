"""Configuration of the KV cache."""

from __future__ import annotations

from typing import Literal

import msgspec

CacheMode = Literal["recompute", "gpu_only", "unlimited"]


class CacheConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where users' KV lives and how long it is kept.

    Attributes:
        mode: ``recompute``: nothing is reused (every request encodes its whole history; pages are
            scratch space freed when the request finishes). ``gpu_only``: each user's KV stays in GPU
            pages across visits; when pages run out the least recently used unlocked users are evicted
            (their KV is lost and recomputed on their next visit). ``unlimited``: like ``gpu_only`` but
            nothing is ever evicted; the pool must be large enough for everyone (the ideal to measure
            against); a request that cannot get pages fails with a clear error.
        page_size: tokens per KV page (FlashInfer's ``page_size``).
        num_gpu_pages: pages in the GPU pool. Each page holds
            ``num_layers * 2 * page_size * num_heads * head_dim`` values.
    """

    mode: CacheMode = "gpu_only"
    page_size: int = 32
    num_gpu_pages: int = 4096

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"cache.page_size must be positive, got {self.page_size}")
        if self.num_gpu_pages <= 0:
            raise ValueError(f"cache.num_gpu_pages must be positive, got {self.num_gpu_pages}")
