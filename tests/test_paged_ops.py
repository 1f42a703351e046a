"""The pure-torch paged ops follow FlashInfer's semantics exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attention_backends.base import layout_arrays
from attention_backends.paged import append_paged_kv_cache, get_seq_lens, padded_block_table


def append_indices(seq_lens: torch.Tensor, append_lens: list[int], kv_indptr: torch.Tensor, page_size: int):
    """FlashInfer's ``get_batch_indices_positions`` of the appends (the last ``append_lens[b]`` tokens of each
    request), as :func:`layout_arrays` resolves them: ``(batch_indices, positions)``, int32 ``[nnz]``."""
    hist = np.asarray(append_lens)
    arrays = layout_arrays(seq_lens.numpy() - hist, hist, np.zeros_like(hist), kv_indptr.numpy(),
                           np.arange(int(kv_indptr[-1])), page_size)
    return (torch.from_numpy(arrays[k]).to(torch.int32) for k in ("append_batch_indices", "append_positions"))


def test_batch_indices_positions_docstring_example():
    # FlashInfer's documented example for get_batch_indices_positions.
    seq_lens = torch.tensor([5, 5, 5, 5], dtype=torch.int32)
    batch, pos = append_indices(seq_lens, [1, 2, 3, 4], torch.tensor([0, 1, 2, 3, 4]), 16)
    assert batch.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert pos.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]


def test_canonical_append_case():
    """FlashInfer's test_append_paged_kv_cache: lengths 45/8/25/22, page size 16."""
    page_size, heads, dim = 16, 2, 8
    lens = [45, 8, 25, 22]
    kv_indptr = torch.tensor([0, 3, 4, 6, 8], dtype=torch.int32)
    kv_indices = torch.arange(8, dtype=torch.int32)
    kv_last_page_len = torch.tensor([13, 8, 9, 6], dtype=torch.int32)
    seq_lens = get_seq_lens(kv_indptr, kv_last_page_len, page_size)
    assert seq_lens.tolist() == lens
    nnz = sum(lens)
    key = torch.randn(nnz, heads, dim)
    value = torch.randn(nnz, heads, dim)
    cache = torch.zeros(8, 2, page_size, heads, dim)
    batch, pos = append_indices(seq_lens, lens, kv_indptr, page_size)
    append_paged_kv_cache(key, value, batch, pos, cache, kv_indices, kv_indptr, kv_last_page_len)
    # The per-token check of FlashInfer's test: token j of request b lives at page kv_indices[...].
    row = 0
    for b, n in enumerate(lens):
        for j in range(n):
            page = kv_indices[kv_indptr[b] + j // page_size]
            assert torch.equal(cache[page, 0, j % page_size], key[row])
            assert torch.equal(cache[page, 1, j % page_size], value[row])
            row += 1
    # Unused slots of the last pages stay untouched.
    assert cache[2, :, 13:].abs().sum() == 0 and cache[7, :, 6:].abs().sum() == 0


def test_append_into_shuffled_pages_and_partial_append():
    page_size = 4
    kv_indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    kv_indices = torch.tensor([7, 2, 0, 5, 3], dtype=torch.int32)
    kv_last = torch.tensor([3, 1], dtype=torch.int32)  # lengths 7 and 9
    seq_lens = get_seq_lens(kv_indptr, kv_last, page_size)
    batch, pos = append_indices(seq_lens, [2, 3], kv_indptr, page_size)  # last 2 of req 0, last 3 of req 1
    assert pos.tolist() == [5, 6, 6, 7, 8]
    cache = torch.zeros(8, 2, page_size, 1, 1)
    key = torch.arange(1, 6, dtype=torch.float32).view(5, 1, 1)
    append_paged_kv_cache(key, -key, batch, pos, cache, kv_indices, kv_indptr, kv_last)
    assert cache[2, 0, 1].item() == 1 and cache[2, 0, 2].item() == 2  # req 0 positions 5, 6 -> page 2
    assert cache[5, 0, 2].item() == 3 and cache[5, 0, 3].item() == 4  # req 1 positions 6, 7 -> page 5
    assert cache[3, 0, 0].item() == 5 and cache[3, 1, 0].item() == -5


def test_append_out_of_bounds_raises():
    kv_indptr = torch.tensor([0, 1], dtype=torch.int32)
    kv_indices = torch.tensor([0], dtype=torch.int32)
    kv_last = torch.tensor([2], dtype=torch.int32)
    cache = torch.zeros(2, 2, 4, 1, 1)
    with pytest.raises(IndexError):
        append_paged_kv_cache(torch.ones(1, 1, 1), torch.ones(1, 1, 1), torch.tensor([0], dtype=torch.int32),
                              torch.tensor([2], dtype=torch.int32), cache, kv_indices, kv_indptr, kv_last)


def test_padded_block_table():
    kv_indptr = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    kv_indices = torch.tensor([4, 1, 6, 0, 3], dtype=torch.int32)
    table = padded_block_table(kv_indptr, kv_indices, 3)
    assert table.tolist() == [[4, 1, 0], [0, 0, 0], [6, 0, 3]]
    assert padded_block_table(torch.zeros(3, dtype=torch.int32), kv_indices[:0], 0).shape == (2, 0)


def test_resolved_append_slots_equal_flashinfer_formula():
    """PagedBatchMetadata resolves each appended row's page and entry once per step on the host; writing
    through them equals FlashInfer's per-row formula."""
    from attention_backends import PagedBatchMetadata
    from attention_backends.paged import write_appended

    rng = np.random.default_rng(0)
    page_size = 4
    cached, new = rng.integers(0, 20, 6), rng.integers(0, 11, 6)
    pages = -(-(cached + new) // page_size)
    indptr = np.concatenate([[0], np.cumsum(pages)])
    indices = rng.permutation(int(indptr[-1]) + 5)[: indptr[-1]]
    meta = PagedBatchMetadata.from_layout(cached, new, np.ones(6, int), indptr, indices, page_size, "cpu")
    n = int(new.sum())
    key, value = torch.randn(n, 2, 3), torch.randn(n, 2, 3)
    expected = torch.zeros(int(indptr[-1]) + 5, 2, page_size, 2, 3)
    got = expected.clone()
    append_paged_kv_cache(key, value, meta.append_batch_indices, meta.append_positions, expected,
                          meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len)
    write_appended(got, key, value, meta.append_pages, meta.append_entries)
    assert torch.equal(got, expected) and expected.abs().sum() > 0
