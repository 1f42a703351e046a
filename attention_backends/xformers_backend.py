"""``xformers``: softmax attention (SASRec-style models) with ``xformers.ops.memory_efficient_attention``.

xformers has no kernel for HSTU's SiLU attention nor a paged path usable here (its paged biases are
decode-only), so each layer gathers the histories it needs from the pages into dense K/V (tensor
indexing through the page table) and runs one ``memory_efficient_attention`` call over all rows of the
step with a single block-diagonal mask, ``BlockDiagonalCausalFromBottomRightMask``, whose blocks are:

- per request with new history rows: queries = its ``n`` new history rows, keys = its whole history
  (``s`` keys, the new rows' included). Bottom-right causal alignment puts query ``i`` at key position
  ``s - n + i``, so it sees exactly the keys up to itself;
- per candidate: queries = that one candidate row, keys = the request's history followed by the
  candidate's own k/v. A one-row bottom-right causal block sees all of its keys: the whole history and
  itself, never another candidate.

Queries stay in the flat batch's order (each request's history rows, then its candidates), so ``q`` is
passed as it is and the output needs no reordering. Candidates cost the same FLOPs as in a dedicated
target-aware kernel; the price is memory traffic, since every candidate block carries its own copy of
the history (``sum_b candidates_b * seq_len_b`` keys gathered per layer). That suits the short
histories of SASRec-style models, which this backend is for; it would not suit 10k-token histories.

The mask is built from host-side sequence lengths (xformers requires Python lists):
:meth:`XFormersBackend.build_metadata` takes the per-request counts from the metadata's host copies
(``PagedBatchMetadata.host``; without them it reads the device once per step); the per-layer
:meth:`XFormersBackend.attend` never synchronises. ``xformers`` is imported lazily. (On a
machine whose CUDA runtime differs from the wheel's, xformers needs ``libcudart.so.12`` on
``LD_LIBRARY_PATH``, else it finds "No operator".)
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
import torch

from .base import AttentionBackend, AttentionSpec, BackendSupport, PagedBatchMetadata


def _xformers_reasons(check_import: bool) -> list[str]:
    """Why xformers cannot be used: not installed; or (``check_import``) installed but not importable."""
    if importlib.util.find_spec("xformers") is None:
        return ["xformers is not installed (pip install xformers)"]
    if check_import:
        try:
            importlib.import_module("xformers.ops")
        except (ImportError, OSError, RuntimeError) as exc:
            return [f"xformers cannot be imported: {type(exc).__name__}: {exc}"]
    return []


@dataclass
class XFormersMetadata:
    """One step's dense-gather plan and mask (``K`` = keys of all blocks, ``G`` = history keys gathered,
    ``C`` = candidate rows).

    Attributes:
        common: the common metadata it was built from.
        attn_bias: the ``BlockDiagonalCausalFromBottomRightMask`` over all rows (``None`` if no rows).
        num_keys: ``K`` (host int).
        history_dest: int64 ``[G]`` slot of the dense K/V each gathered history key goes to.
        history_page: int64 ``[G]`` physical page of each gathered history key.
        history_entry: int64 ``[G]`` entry in that page.
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
    """Softmax attention over the paged cache with xformers' memory-efficient kernels (CUDA, fp16/bf16).

    Args:
        spec: what the model asks of attention.
    """

    name: ClassVar[str] = "xformers"
    support: ClassVar[BackendSupport] = BackendSupport(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        kinds=frozenset({"softmax"}),
        head_dims=frozenset(range(8, 257, 8)),  # what both FlashAttention and CUTLASS kernels take
    )
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
        # Import xformers only for a configuration it could otherwise serve.
        return reasons + _xformers_reasons(check_import=not reasons)

    def build_metadata(self, common: PagedBatchMetadata) -> XFormersMetadata:
        """The blocks of the mask (from ``common.host``; without it, one read from the device) and where each
        of their keys comes from (expanded on the device from per-block arrays uploaded in one copy)."""
        device = common.query_start_loc.device
        hist, cand, seq_lens, kv_indptr = (
            np.asarray(common.host[k] if common.host else getattr(common, k).cpu().numpy(), dtype=np.int64)
            for k in ("num_history_rows", "num_candidate_rows", "kv_seq_lens", "kv_indptr"))
        # Blocks, per request: its history block (dropped below when it has no new history row), then one
        # block per candidate.
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
        attn_bias = None
        if num_blocks:
            attn_bias = self._mask_cls.from_seqlens(q_len.tolist(), kv_len.tolist(), device=device)
        return XFormersMetadata(
            common, attn_bias, int(kv_len.sum()), history_dest=kv_start_t[block] + position,
            history_page=common.kv_indices.long()[slot // common.page_size], history_entry=slot % common.page_size,
            own_dest=own_dest, own_rows=own_rows,
        )

    def append_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: XFormersMetadata
    ) -> None:
        """Write the new history rows' K/V into their pages (tensor indexing, FlashInfer's slot formula).

        Args:
            kv_cache: one layer's cache ``[num_pages, 2, page_size, H, D]`` (NHD), written in place.
            key: ``[N, H, D]`` K of the new history rows, in ``history_rows`` order, ``kv_cache``'s dtype.
            value: ``[N, H, D]`` V of the new history rows.
            metadata: what :meth:`build_metadata` returned for this step.
        """
        c = metadata.common
        page_size = kv_cache.shape[2]
        slot = c.kv_indptr.long()[c.append_batch_indices.long()] * page_size + c.append_positions.long()
        page, entry = c.kv_indices.long()[slot // page_size], slot % page_size
        kv_cache[page, 0, entry] = key
        kv_cache[page, 1, entry] = value

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
        metadata: XFormersMetadata, time_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Softmax attention of every row (after :meth:`append_kv` for this layer).

        Args:
            q, k, v: ``[T, H, D]`` fp16/bf16 projections of all rows, last dim contiguous.
            kv_cache: ``[num_pages, 2, page_size, H, D]`` (NHD) in ``q``'s dtype.
            metadata: what :meth:`build_metadata` returned for this step.

        Returns:
            ``[T, H, D]`` in ``q``'s dtype: ``softmax(alpha q.k) v`` over each row's allowed keys.
        """
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
