"""Random paged attention batches and a dense float64 oracle, for testing any attention backend."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from attention_backends import PagedBatchMetadata
from attention_backends.base import time_bucket


@dataclass
class AttentionCase:
    """A batch whose history K/V (``dense_k[b]``, ``dense_v[b]``: ``[seq_len_b, H, D]``) is partly in
    shuffled pages (the cached prefix) and partly in the new rows of ``k``/``v``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    metadata: PagedBatchMetadata
    cached: list[int]
    new: list[int]
    candidates: list[int]
    dense_k: list[torch.Tensor]
    dense_v: list[torch.Tensor]
    times: list[torch.Tensor] | None = None  # per request, int64 [seq_len] event times (time bias cases)
    time_bias: torch.Tensor | None = None  # float32 [buckets, H]


def build_case(cached: list[int], new: list[int], candidates: list[int], *, heads: int = 2, dim: int = 8,
               page_size: int = 4, dtype: torch.dtype = torch.float32, device: str = "cpu",
               seed: int = 0, time_buckets: int = 0, other_pages: int = 0) -> AttentionCase:
    """A random batch; with ``time_buckets`` also event times (gaps from seconds to months) and a bias table.

    The cache holds the batch's pages (shuffled), 3 free pages and, first, ``other_pages`` pages
    (ids ``0 .. other_pages - 1``) that no request of the batch owns, as another user's would be."""
    gen = torch.Generator().manual_seed(seed)
    seq = [c + n for c, n in zip(cached, new)]
    pages = [-(-s // page_size) for s in seq]
    total = sum(pages) + 3 + other_pages
    perm = torch.randperm(total - other_pages, generator=gen) + other_pages
    indptr = np.concatenate([[0], np.cumsum(pages)])
    indices = perm[: indptr[-1]].numpy()
    kv_cache = torch.randn(total, 2, page_size, heads, dim, generator=gen)  # garbage outside histories
    dense_k = [torch.randn(s, heads, dim, generator=gen) for s in seq]
    dense_v = [torch.randn(s, heads, dim, generator=gen) for s in seq]
    q_rows, k_rows, v_rows = [], [], []
    for b, (c, n, m) in enumerate(zip(cached, new, candidates)):
        for j in range(c):  # the cached prefix is already in pages
            page = indices[indptr[b] + j // page_size]
            kv_cache[page, 0, j % page_size] = dense_k[b][j]
            kv_cache[page, 1, j % page_size] = dense_v[b][j]
        q_rows.append(torch.randn(n + m, heads, dim, generator=gen))
        k_rows += [dense_k[b][c:], torch.randn(m, heads, dim, generator=gen)]
        v_rows += [dense_v[b][c:], torch.randn(m, heads, dim, generator=gen)]
    to = {"dtype": dtype, "device": device}
    times = table = query_times = key_times = None
    if time_buckets:
        gaps = [torch.randint(0, 2**20, (s,), generator=gen) // torch.randint(1, 4096, (s,), generator=gen)
                for s in seq]
        times = [torch.cumsum(g, 0) + 1_700_000_000 for g in gaps]
        table = torch.randn(time_buckets, heads, generator=gen).to(device)
        query_times = np.concatenate([np.concatenate([t[c:].numpy(), np.full(m, t[-1].item() if len(t) else 0)])
                                      for t, c, m in zip(times, cached, candidates)])
        key_times = np.concatenate([t.numpy() for t in times])
    meta = PagedBatchMetadata.from_layout(np.array(cached), np.array(new), np.array(candidates), indptr,
                                          indices, page_size, device, query_times, key_times)
    return AttentionCase(torch.cat(q_rows).to(**to), torch.cat(k_rows).to(**to), torch.cat(v_rows).to(**to),
                         kv_cache.to(**to), meta, cached, new, candidates, dense_k, dense_v, times, table)


def reference_attention(case: AttentionCase, alpha: float, scaling_seqlen: int, kind: str = "hstu") -> torch.Tensor:
    """Dense float64 attention of every row of ``case`` (history causal, candidates see history + self)."""
    q, k, v = (t.double().cpu() for t in (case.q, case.k, case.v))
    out, row = [], 0
    for b, (c, n, m) in enumerate(zip(case.cached, case.new, case.candidates)):
        hk, hv = case.dense_k[b].to(case.q.dtype).double(), case.dense_v[b].to(case.q.dtype).double()
        for i in range(n + m):
            qi = q[row + i]
            if i < n:
                keys, values = hk[: c + i + 1], hv[: c + i + 1]
            else:
                keys = torch.cat([hk, k[row + i][None]])
                values = torch.cat([hv, v[row + i][None]])
            logits = torch.einsum("hd,khd->hk", qi, keys) * alpha
            if case.time_bias is not None:
                t = case.times[b]
                t_query = t[c + i] if i < n else (t[-1] if len(t) else torch.tensor(0))
                t_keys = t[: c + i + 1] if i < n else torch.cat([t, t_query[None]])
                buckets = time_bucket(t_query - t_keys, case.time_bias.shape[0])
                logits = logits + case.time_bias.double().cpu()[buckets].T
            weights = F.silu(logits) / scaling_seqlen if kind == "hstu" else torch.softmax(logits, dim=-1)
            out.append(torch.einsum("hk,khd->hd", weights, values))
        row += n + m
    return torch.stack(out) if out else q.new_zeros(0, *q.shape[1:])


def history_slots(case: AttentionCase) -> torch.Tensor:
    """bool ``[num_pages, page_size]``: the cache slots that hold a batch request's history once the step's
    new rows are appended (every other slot is garbage the backends must ignore)."""
    m = case.metadata
    indptr, indices = m.kv_indptr.cpu().numpy(), m.kv_indices.cpu().numpy()
    held = torch.zeros(case.kv_cache.shape[0], m.page_size, dtype=torch.bool)
    for b, s in enumerate(np.asarray(case.cached) + np.asarray(case.new)):
        for j in range(s):
            held[indices[indptr[b] + j // m.page_size], j % m.page_size] = True
    return held


def check_cache_holds_history(case: AttentionCase) -> None:
    """After append_kv, every history token's K/V sits in its page."""
    m = case.metadata
    indptr, indices = m.kv_indptr.cpu().numpy(), m.kv_indices.cpu().numpy()
    page_size = m.page_size
    cache = case.kv_cache.cpu()
    for b, s in enumerate(np.asarray(case.cached) + np.asarray(case.new)):
        for j in range(s):
            page = indices[indptr[b] + j // page_size]
            assert torch.equal(cache[page, 0, j % page_size], case.dense_k[b][j].to(cache.dtype))
            assert torch.equal(cache[page, 1, j % page_size], case.dense_v[b][j].to(cache.dtype))
