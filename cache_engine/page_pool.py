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
        # A stack in ``_stack[:num_free]``: allocation takes from the end, freeing pushes back; one numpy
        # slice copy per call, whatever the page count.
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self.num_free = num_pages  #: pages free now (read-only outside this class)
        #: free pages given back by :meth:`free_last` still below all others (the bottom of the stack)
        self.num_free_last = 0
        self.track_handed_out = False  #: keep the pages allocated until :meth:`handed_out` is called
        self._handed_out: list[np.ndarray] = []

    def allocate(self, out: np.ndarray) -> None:
        """Fill ``out`` (int32 ``[count]``, e.g. a slice of a user's page buffer) with ``count`` free page ids
        (``RuntimeError`` if fewer are free; callers check first)."""
        count, end = len(out), self.num_free
        if count > end:
            raise RuntimeError(f"page pool exhausted: {count} pages asked, {end} free")
        start = end - count
        out[:] = self._stack[start:end]
        self.num_free = start
        if start < self.num_free_last:
            self.num_free_last = start
        if self.track_handed_out:
            self._handed_out.append(out.copy())

    def handed_out(self) -> np.ndarray:
        """int32: the pages allocated since the last call (with ``track_handed_out``)."""
        pages, self._handed_out = self._handed_out, []
        return np.concatenate(pages) if pages else np.zeros(0, dtype=np.int32)

    def free(self, pages: np.ndarray) -> None:
        """Return pages (int ``[count]``) to the pool (zero-copy: their contents are simply forgotten)."""
        end = self.num_free + len(pages)
        if end > self.num_pages:
            raise RuntimeError(f"freeing {len(pages)} pages would exceed the pool's {self.num_pages}: double free")
        self._stack[self.num_free: end] = pages
        self.num_free = end

    def free_last(self, pages: np.ndarray) -> None:
        """Return pages (int ``[count]``) below every free page: they are handed out after all the others (pages a
        copy to host may still read, say). Costs a copy of the free list (small while the pool is full)."""
        count, end = len(pages), self.num_free + len(pages)
        if end > self.num_pages:
            raise RuntimeError(f"freeing {count} pages would exceed the pool's {self.num_pages}: double free")
        self._stack[count:end] = self._stack[: self.num_free].copy()
        self._stack[:count] = pages
        self.num_free, self.num_free_last = end, self.num_free_last + count

    def settle_free_last(self) -> None:
        """Treat the pages given back by :meth:`free_last` like any other free page from now on (e.g. the copies
        that read them finished); they stay where they are in the free list."""
        self.num_free_last = 0

    def free_page_ids(self) -> list[int]:
        """A copy of the free list (for invariant checks)."""
        return self._stack[: self.num_free].tolist()
