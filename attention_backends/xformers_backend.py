"""``xformers``: softmax attention (SASRec-style models) with ``xformers.ops.memory_efficient_attention``.

xformers has no HSTU kernel nor a usable paged path (its paged biases are decode-only), so each layer gathers
the histories into dense K/V for one call with a ``BlockDiagonalCausalFromBottomRightMask``. Blocks, per request:
its ``n`` new history rows over its ``s`` history keys (bottom-right alignment puts row ``i`` at key ``s - n + i``:
causal); then one per candidate: that row over the history and its own k/v. Rows keep the flat batch's order.
Each candidate block copies the history (``sum_b candidates_b * seq_len_b`` keys per layer): short histories only.
(Where the CUDA runtime differs from the wheel's, xformers needs ``libcudart.so.12`` on ``LD_LIBRARY_PATH``.)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
import torch

from .base import AttentionBackend, AttentionSpec, BackendSupport, PagedBatchMetadata, package_reasons
from .paged import write_appended


@dataclass
class XFormersMetadata:
    """One step's dense gather and mask (``K``: keys of all blocks, ``G``: history keys gathered, ``C``: candidates).

    Attributes:
        common: the common metadata it was built from.
        attn_bias: the ``BlockDiagonalCausalFromBottomRightMask`` over all rows (``None`` if no rows).
        num_keys: ``K`` (host int).
        history_dest: int64 ``[G]`` slot of the dense K/V each gathered history key goes to.
        history_page, history_entry: int64 ``[G]`` its physical page and entry in it.
        own_dest: int64 ``[C]`` slot of each candidate's own key (the last of its block).
        own_rows: int64 ``[C]`` flat row of each candidate (where its k/v are read from).
    """

    common: PagedBatchMetadata
    attn_bias: Any
    num_keys: int
    history_dest: torch.Tensor
    history_page: torch.Tensor
    history_entry: torch.Tensor
    own_dest: torch.Tensor
    own_rows: torch.Tensor


class XFormersBackend(AttentionBackend):
    """Softmax attention over the paged cache with xformers' memory-efficient kernels (CUDA, fp16/bf16)."""

    name: ClassVar[str] = "xformers"
    support: ClassVar[BackendSupport] = BackendSupport(
        devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}), kinds=frozenset({"softmax"}),
        head_dims=frozenset(range(8, 257, 8)))  # what both FlashAttention and CUTLASS kernels take
    priority: ClassVar[int] = 10

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self._xops: ModuleType = importlib.import_module("xformers.ops")
        self._mask_cls = self._xops.fmha.attn_bias.BlockDiagonalCausalFromBottomRightMask

    @classmethod
    def reasons_unsupported(cls, spec: AttentionSpec) -> list[str]:
        reasons = cls.support.reasons_unsupported(spec)
        if spec.device_type == "cuda" and not torch.cuda.is_available():
            reasons.append("CUDA is not available (torch.cuda.is_available() is False)")
        return reasons + package_reasons("xformers", "xformers.ops", "xformers", check_import=not reasons)

    def build_metadata(self, common: PagedBatchMetadata) -> XFormersMetadata:
        """The mask's blocks (from host lengths: the mask needs lists) and where each key comes from (expanded
        on the device from per-block arrays uploaded in one copy)."""
        device = common.query_start_loc.device
        hist, cand, seq_lens, kv_indptr = (
            np.asarray(common.host[k] if common.host else getattr(common, k).cpu().numpy(), dtype=np.int64)
            for k in ("num_history_rows", "num_candidate_rows", "kv_seq_lens", "kv_indptr"))
        # Per request: its history block (dropped without new history rows), then one block per candidate.
        per_request = 1 + cand
        block_req = np.repeat(np.arange(len(hist)), per_request)
        is_history = np.zeros(len(block_req), dtype=bool)
        is_history[np.cumsum(per_request) - per_request] = True
        q_len = np.where(is_history, hist[block_req], 1)
        keep = q_len > 0
        block_req, is_history, q_len = block_req[keep], is_history[keep], q_len[keep]
        history_len = seq_lens[block_req]  # the block's first history_len keys: its request's history
        kv_len = history_len + ~is_history  # candidates add their own key, last
        kv_start = np.cumsum(kv_len) - kv_len
        q_start = np.cumsum(q_len) - q_len  # a candidate block's row in the flat batch
        num_blocks, num_candidates = len(q_len), int((~is_history).sum())
        num_history_keys = int(history_len.sum())

        host = np.concatenate([
            history_len, np.cumsum(history_len) - history_len, kv_start,
            kv_indptr[block_req] * common.page_size,  # flat page-table slot of the request's first key
            (kv_start + kv_len - 1)[~is_history], q_start[~is_history],
        ])
        uploaded = torch.split(torch.from_numpy(host).to(device), [num_blocks] * 4 + [num_candidates] * 2)
        history_len_t, first_key, kv_start_t, first_slot, own_dest, own_rows = uploaded
        # Gathered history key i belongs to block `block` and is history position `position` of its request.
        block = torch.repeat_interleave(torch.arange(num_blocks, device=device), history_len_t,
                                        output_size=num_history_keys)
        position = torch.arange(num_history_keys, device=device) - first_key[block]
        slot = first_slot[block] + position
        attn_bias = self._mask_cls.from_seqlens(q_len.tolist(), kv_len.tolist(), device=device) if num_blocks else None
        return XFormersMetadata(common, attn_bias, int(kv_len.sum()), kv_start_t[block] + position,
                                common.kv_indices.long()[slot // common.page_size], slot % common.page_size,
                                own_dest, own_rows)

    def append_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  metadata: XFormersMetadata) -> None:
        c = metadata.common
        write_appended(kv_cache, key[c.history_rows], value[c.history_rows], c.append_pages, c.append_entries)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               metadata: XFormersMetadata, time_bias: torch.Tensor | None = None) -> torch.Tensor:
        """``softmax(alpha q.k) v`` over each row's allowed keys (``q``, ``k``, ``v``: last dim contiguous)."""
        m = metadata
        if m.attn_bias is None:
            return torch.empty_like(q)
        num_heads, head_dim = q.shape[1], q.shape[2]
        dense_k = torch.empty(m.num_keys, num_heads, head_dim, dtype=q.dtype, device=q.device)
        dense_v = torch.empty_like(dense_k)
        dense_k[m.history_dest] = kv_cache[m.history_page, 0, m.history_entry]
        dense_v[m.history_dest] = kv_cache[m.history_page, 1, m.history_entry]
        dense_k[m.own_dest] = k[m.own_rows]
        dense_v[m.own_dest] = v[m.own_rows]
        out = self._xops.memory_efficient_attention(q[None], dense_k[None], dense_v[None], attn_bias=m.attn_bias,
                                                    scale=self.spec.alpha)
        return out[0]
