"""The GPU tier: one preallocated paged KV tensor for all layers, with an O(1) free list."""

from __future__ import annotations

import numpy as np
import torch


class PagePool:
    """Physical KV pages shared by all users.

    Attributes:
        kv: ``[num_layers, num_pages, 2, page_size, num_heads, head_dim]``; ``kv[l]`` is layer ``l``'s
            FlashInfer NHD paged cache (``[:, 0]`` K, ``[:, 1]`` V).
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be positive")
        self.page_size = page_size
        self.num_pages = num_pages
        self.kv = torch.zeros(num_layers, num_pages, 2, page_size, num_heads, head_dim, dtype=dtype, device=device)
        # A stack in ``_stack[:num_free]``: allocate pops from the end, free pushes; one slice copy per call.
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self.num_free = num_pages  #: pages free now (read-only outside this class)

    def allocate(self, out: np.ndarray) -> None:
        """Fill ``out`` (int32 ``[count]``, e.g. a slice of a user's page buffer) with free page ids (``RuntimeError``
        if fewer are free)."""
        count, end = len(out), self.num_free
        if count > end:
            raise RuntimeError(f"page pool exhausted: {count} pages asked, {end} free")
        start = end - count
        out[:] = self._stack[start:end]
        self.num_free = start

    def free(self, pages: np.ndarray) -> None:
        """Return pages (int ``[count]``) to the pool (zero-copy: their contents are simply forgotten)."""
        end = self.num_free + len(pages)
        if end > self.num_pages:
            raise RuntimeError(f"freeing {len(pages)} pages would exceed the pool's {self.num_pages}: double free")
        self._stack[self.num_free: end] = pages
        self.num_free = end

    def free_page_ids(self) -> list[int]:
        """A copy of the free list (for invariant checks)."""
        return self._stack[: self.num_free].tolist()
