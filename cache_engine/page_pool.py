"""The GPU tier: one preallocated paged KV tensor for all layers, with an O(1) free list."""

from __future__ import annotations

import torch


class PagePool:
    """Physical KV pages shared by all users.

    Attributes:
        kv: ``[num_layers, num_pages, 2, page_size, num_heads, head_dim]``; ``kv[l]`` is layer ``l``'s
            FlashInfer NHD paged cache (``[:, 0]`` K, ``[:, 1]`` V).
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be positive")
        self.page_size = page_size
        self.num_pages = num_pages
        self.kv = torch.zeros(
            num_layers, num_pages, 2, page_size, num_heads, head_dim, dtype=dtype, device=device
        )
        # A stack: allocation pops from the end, freeing pushes back; both O(1) per page.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free pages (``RuntimeError`` if fewer are free; callers check first)."""
        if count > len(self._free):
            raise RuntimeError(f"page pool exhausted: {count} pages asked, {len(self._free)} free")
        if count <= 0:
            return []
        pages = self._free[-count:]
        del self._free[-count:]
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool (zero-copy: their contents are simply forgotten)."""
        self._free.extend(pages)

    def free_page_ids(self) -> list[int]:
        """A copy of the free list (for invariant checks)."""
        return list(self._free)
