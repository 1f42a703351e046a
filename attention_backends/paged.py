"""Pure-torch paged KV-cache operations with FlashInfer's exact semantics.

The paged layout (FlashInfer "NHD"): one layer's cache is a tensor
``[num_pages, 2, page_size, num_heads, head_dim]`` where ``[:, 0]`` holds K and ``[:, 1]`` holds V.
A batch's page table is CSR:

- ``kv_indptr``: int32 ``[B + 1]``, ``kv_indptr[0] == 0``; request ``b`` owns the physical pages
  ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` in logical order.
- ``kv_indices``: int32 ``[kv_indptr[-1]]``, physical page ids.
- ``kv_last_page_len``: int32 ``[B]``, valid entries in each request's last page (0 when the request
  owns no page).

These functions are the CPU path and the correctness oracle for the CUDA kernels
(``flashinfer.append_paged_kv_cache`` and ``flashinfer.get_batch_indices_positions``).
"""

from __future__ import annotations

import torch


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Sequence length of each request: ``max(num_pages - 1, 0) * page_size + last_page_len``.

    Args:
        kv_indptr: int32 ``[B + 1]``.
        kv_last_page_len: int32 ``[B]``.
        page_size: tokens per page.

    Returns:
        int32 ``[B]`` sequence lengths in tokens.
    """
    num_pages = kv_indptr[1:] - kv_indptr[:-1]
    return ((num_pages - 1).clamp(min=0) * page_size + kv_last_page_len).to(torch.int32)


def get_batch_indices_positions(
    append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map each appended token to its request and its position in that request's sequence.

    Appended tokens are the *last* ``append_len[b]`` tokens of request ``b``'s sequence, so token ``j``
    of request ``b``'s append goes to position ``seq_lens[b] - append_len[b] + j``.

    Args:
        append_indptr: int32 ``[B + 1]``, offsets of each request's appended rows.
        seq_lens: int32 ``[B]``, sequence lengths *including* the appended tokens.
        nnz: total appended tokens (``append_indptr[-1]``), a host int.

    Returns:
        ``(batch_indices, positions)``, both int32 ``[nnz]``.
    """
    append_len = (append_indptr[1:] - append_indptr[:-1]).long()
    batch = torch.repeat_interleave(torch.arange(len(append_len), device=seq_lens.device), append_len)
    rows = torch.arange(nnz, device=seq_lens.device)
    positions = rows - append_indptr[batch].long() + (seq_lens.long() - append_len)[batch]
    return batch.to(torch.int32), positions.to(torch.int32)


def append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
) -> None:
    """Write appended K/V rows into their pages, in place (FlashInfer's kernel formula).

    Row ``i`` goes to flat slot ``kv_indptr[batch_indices[i]] * page_size + positions[i]`` of the
    request's page list, i.e. page ``kv_indices[slot // page_size]``, entry ``slot % page_size``.
    The page table must already include the appended tokens. Unlike the CUDA kernel, positions past a
    request's allocation raise instead of silently corrupting another request's pages (checked on
    CPU tensors only, where it costs no device synchronisation).

    Args:
        append_key: ``[nnz, H, D]``.
        append_value: ``[nnz, H, D]``.
        batch_indices: int32 ``[nnz]``.
        positions: int32 ``[nnz]``.
        paged_kv_cache: ``[num_pages, 2, page_size, H, D]`` (NHD), same dtype as the rows.
        kv_indices, kv_indptr, kv_last_page_len: the CSR page table (module docstring).
    """
    page_size = paged_kv_cache.shape[2]
    batch = batch_indices.long()
    slot = kv_indptr[batch].long() * page_size + positions.long()
    if paged_kv_cache.device.type == "cpu" and len(batch):
        seq_lens = get_seq_lens(kv_indptr, kv_last_page_len, page_size)
        if bool((positions.long() >= seq_lens[batch]).any()) or bool((positions < 0).any()):
            raise IndexError("append position outside its request's page allocation")
    page = kv_indices[slot // page_size].long()
    entry = slot % page_size
    paged_kv_cache[page, 0, entry] = append_key
    paged_kv_cache[page, 1, entry] = append_value


def write_appended(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                   entries: torch.Tensor) -> None:
    """Write appended rows into slots already resolved (``PagedBatchMetadata.append_pages/entries``):
    the same result as :func:`append_paged_kv_cache`, in two indexed writes.

    Args:
        kv_cache: ``[num_pages, 2, page_size, H, D]`` (NHD), written in place.
        key, value: ``[N, H, D]`` in the cache's dtype.
        pages, entries: int ``[N]`` page and entry of each row.
    """
    kv_cache[pages, 0, entries] = key
    kv_cache[pages, 1, entries] = value


def padded_block_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, max_pages: int) -> torch.Tensor:
    """Convert the CSR page table into a padded 2-D block table.

    Args:
        kv_indptr: int32 ``[B + 1]``.
        kv_indices: int32 ``[nnz_pages]``.
        max_pages: the largest page count of any request (a host int).

    Returns:
        int64 ``[B, max_pages]``; entries past a request's page count are 0 (callers mask them).
    """
    start = kv_indptr[:-1].long()
    count = (kv_indptr[1:] - kv_indptr[:-1]).long()
    col = torch.arange(max_pages, device=kv_indptr.device)
    valid = col[None, :] < count[:, None]
    flat = (start[:, None] + col[None, :]).clamp(max=max(len(kv_indices) - 1, 0))
    if len(kv_indices) == 0:
        return torch.zeros(len(count), max_pages, dtype=torch.long, device=kv_indptr.device)
    return torch.where(valid, kv_indices.long()[flat], 0)
