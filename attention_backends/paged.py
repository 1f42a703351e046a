"""Pure-torch paged KV-cache operations with FlashInfer's exact semantics: the CPU path, and the CUDA kernels' oracle.

One layer's cache is ``[num_pages, 2, page_size, H, D]`` (FlashInfer's "NHD"; ``[:, 0]`` holds K, ``[:, 1]`` V).
A batch's page table is CSR: request ``b`` owns the physical pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``
in logical order (int32 ``kv_indptr [B + 1]``, ``kv_indices [kv_indptr[-1]]``), and int32 ``kv_last_page_len [B]``
counts the valid entries in each request's last page (0 when it owns no page).
"""

from __future__ import annotations

import torch


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """int32 ``[B]`` tokens of each request, ``max(num_pages - 1, 0) * page_size + last_page_len``."""
    num_pages = kv_indptr[1:] - kv_indptr[:-1]
    return ((num_pages - 1).clamp(min=0) * page_size + kv_last_page_len).to(torch.int32)


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor,
                          positions: torch.Tensor, paged_kv_cache: torch.Tensor, kv_indices: torch.Tensor,
                          kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor) -> None:
    """Write appended K/V rows into their pages, in place (FlashInfer's formula): row ``i`` goes to flat slot
    ``kv_indptr[batch_indices[i]] * page_size + positions[i]``, i.e. page ``kv_indices[slot // page_size]``, entry
    ``slot % page_size``. The page table must already include the appended tokens. On CPU (no sync cost), unlike
    the CUDA kernel, positions past a request's allocation raise ``IndexError``.

    Args:
        append_key, append_value: ``[nnz, H, D]``.
        batch_indices, positions: int32 ``[nnz]`` request of each row and its position in the request.
        paged_kv_cache: ``[num_pages, 2, page_size, H, D]``, the rows' dtype.
        kv_indices, kv_indptr, kv_last_page_len: the CSR page table (module docstring).
    """
    page_size = paged_kv_cache.shape[2]
    batch = batch_indices.long()
    slot = kv_indptr[batch].long() * page_size + positions.long()
    if paged_kv_cache.device.type == "cpu" and len(batch):
        seq_lens = get_seq_lens(kv_indptr, kv_last_page_len, page_size)
        if bool((positions.long() >= seq_lens[batch]).any()) or bool((positions < 0).any()):
            raise IndexError("append position outside its request's page allocation")
    write_appended(paged_kv_cache, append_key, append_value, kv_indices[slot // page_size].long(), slot % page_size)


def write_appended(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                   entries: torch.Tensor) -> None:
    """Write ``key``, ``value`` (``[N, H, D]``, the cache's dtype) into ``entries`` of ``pages`` (int ``[N]``, as
    ``PagedBatchMetadata.append_pages/entries``) of ``kv_cache`` (NHD), in place."""
    kv_cache[pages, 0, entries] = key
    kv_cache[pages, 1, entries] = value


def padded_block_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, max_pages: int) -> torch.Tensor:
    """The CSR page table as int64 ``[B, max_pages]`` (``max_pages``: a host int >= every request's page count);
    entries past a request's page count are 0 (callers mask them)."""
    count = (kv_indptr[1:] - kv_indptr[:-1]).long()
    if len(kv_indices) == 0:
        return torch.zeros(len(count), max_pages, dtype=torch.long, device=kv_indptr.device)
    col = torch.arange(max_pages, device=kv_indptr.device)
    flat = (kv_indptr[:-1].long()[:, None] + col[None, :]).clamp(max=len(kv_indices) - 1)
    return torch.where(col[None, :] < count[:, None], kv_indices.long()[flat], 0)
