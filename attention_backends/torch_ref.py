"""``torch_ref``: pure-torch attention over the paged cache; runs anywhere, and is the oracle.

A step is padded to ``[B, max_query_len]`` query rows and ``[B, max_pages * page_size]`` history keys (gathered
through a padded block table): batched tensor ops, no Python loop, ``O(B * H * max_query_len * max_kv_len)`` memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import AttentionBackend, BackendSupport, PagedBatchMetadata, time_bucket
from .paged import append_paged_kv_cache, padded_block_table


@dataclass
class TorchRefMetadata:
    """Padded views of one step's batch (``P = max_query_len``).

    Attributes:
        common: the common metadata it was built from.
        block_table: int64 ``[B, max_pages]`` physical pages, 0-padded (padding slots are zeroed in ``attend``).
        row_index: int64 ``[B, P]`` flat row of each padded query slot (0 for padding).
        row_valid: bool ``[B, P]``.
        key_limit: int64 ``[B, P]`` number of leading history keys each slot may see.
        is_candidate: bool ``[B, P]``; candidates also attend to their own k/v.
        time_delta: int64 ``[B, P, max_pages * page_size]`` query minus key time (``None``: no timestamps).
    """

    common: PagedBatchMetadata
    block_table: torch.Tensor
    row_index: torch.Tensor
    row_valid: torch.Tensor
    key_limit: torch.Tensor
    is_candidate: torch.Tensor
    time_delta: torch.Tensor | None = None


class TorchRefBackend(AttentionBackend):
    """Reference HSTU and softmax attention in plain torch (CPU and CUDA, any float dtype)."""

    name: ClassVar[str] = "torch_ref"
    support: ClassVar[BackendSupport] = BackendSupport(
        devices=frozenset({"cpu", "cuda"}), kinds=frozenset({"hstu", "softmax"}), time_bias=True,
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64}))  # priority: the base's 0

    def build_metadata(self, common: PagedBatchMetadata) -> TorchRefMetadata:
        device = common.query_start_loc.device
        starts = common.query_start_loc[:-1].long()
        num_rows = (common.query_start_loc[1:] - common.query_start_loc[:-1]).long()
        num_hist = common.num_history_rows.long()
        slot = torch.arange(common.max_query_len, device=device)[None, :]
        row_valid = slot < num_rows[:, None]
        row_index = torch.where(row_valid, starts[:, None] + slot, 0)
        seq_lens = common.kv_seq_lens.long()[:, None]
        is_candidate = row_valid & (slot >= num_hist[:, None])
        # A new history row in slot s sits at position seq_len - num_hist + s and sees keys up to it.
        hist_limit = seq_lens - num_hist[:, None] + slot + 1
        key_limit = torch.where(is_candidate, seq_lens, torch.where(row_valid, hist_limit, 0))
        block_table = padded_block_table(common.kv_indptr, common.kv_indices, common.max_pages)
        time_delta = None
        if common.timestamps is not None:
            t = common.timestamps
            key_pos = torch.arange(common.max_pages * common.page_size, device=device)[None, :]
            key_index = (t.key_start.long()[:, None] + key_pos).clamp(max=max(len(t.keys) - 1, 0))
            key_times = torch.where(key_pos < seq_lens, t.keys[key_index], 0) if len(t.keys) else key_pos * 0
            time_delta = t.query[row_index][:, :, None] - key_times[:, None, :]
        return TorchRefMetadata(common, block_table, row_index, row_valid, key_limit, is_candidate, time_delta)

    def append_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  metadata: TorchRefMetadata) -> None:
        c = metadata.common
        rows = c.history_rows
        append_paged_kv_cache(key[rows], value[rows], c.append_batch_indices, c.append_positions, kv_cache,
                              c.kv_indices, c.kv_indptr, c.kv_last_page_len)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               metadata: TorchRefMetadata, time_bias: torch.Tensor | None = None) -> torch.Tensor:
        m = metadata
        batch = m.row_index.shape[0]
        heads, dim = q.shape[1], q.shape[2]
        compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        pages = kv_cache[m.block_table]  # [B, max_pages, 2, page_size, H, D]
        key_pos = torch.arange(pages.shape[1] * pages.shape[3], device=q.device)
        # Slots past a request's history (its last page's tail, block-table padding at page 0) may hold inf or NaN:
        # zero them, so that they enter no product (0 * inf is NaN).
        in_history = (key_pos[None, :] < m.common.kv_seq_lens.long()[:, None])[:, :, None, None]  # [B, K, 1, 1]
        hist_k = torch.where(in_history, pages[:, :, 0].reshape(batch, -1, heads, dim), 0).to(compute)
        hist_v = torch.where(in_history, pages[:, :, 1].reshape(batch, -1, heads, dim), 0).to(compute)
        rows = m.row_index
        q_pad = q[rows].to(compute)  # [B, P, H, D]
        self_k, self_v = k[rows].to(compute), v[rows].to(compute)

        alpha = self.spec.alpha
        logits = torch.einsum("bphd,bkhd->bhpk", q_pad, hist_k) * alpha  # [B, H, P, K]
        self_logit = (q_pad * self_k).sum(-1).transpose(1, 2)[..., None] * alpha  # [B, H, P, 1]
        if time_bias is not None:  # a candidate's own key has its query's time: bucket 0
            buckets = time_bucket(m.time_delta, time_bias.shape[0])  # [B, P, K]
            logits = logits + time_bias.to(compute)[buckets].permute(0, 3, 1, 2)
            self_logit = self_logit + time_bias.to(compute)[0][None, :, None, None]
        allowed = (key_pos[None, None, :] < m.key_limit[:, :, None])[:, None]  # [B, 1, P, K]
        self_allowed = m.is_candidate[:, None, :, None]  # [B, 1, P, 1]

        if self.spec.kind == "hstu":
            inv_n = 1.0 / self.spec.scaling_seqlen
            weights = torch.where(allowed, F.silu(logits), 0.0) * inv_n
            self_weight = torch.where(self_allowed, F.silu(self_logit), 0.0) * inv_n
        else:
            all_logits = torch.cat([logits, self_logit], dim=-1)
            all_allowed = torch.cat([allowed, self_allowed], dim=-1)
            probs = torch.softmax(all_logits.masked_fill(~all_allowed, float("-inf")), dim=-1)
            probs = torch.nan_to_num(probs, nan=0.0)  # rows with no key at all (padding)
            weights, self_weight = probs[..., :-1], probs[..., -1:]

        out = torch.einsum("bhpk,bkhd->bphd", weights, hist_v)
        out = out + self_weight.squeeze(-1).transpose(1, 2)[..., None] * self_v
        result = torch.empty_like(q)
        result[rows[m.row_valid]] = out[m.row_valid].to(q.dtype)
        return result
