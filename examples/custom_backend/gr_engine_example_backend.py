"""``scaled_ref``: an example third-party attention backend for gr-engine, installed as a plugin.

It is ``torch_ref`` with an ``attend`` that scales to long histories. ``torch_ref`` materialises the
scores of every query slot against every history key (``[B, H, P, max_kv_len]`` floats); this backend
walks the history in chunks of ``chunk_tokens`` keys (whole pages), so its memory is
``O(B * H * P * chunk_tokens)`` whatever the history length. HSTU attention has no normaliser, so the
chunks' contributions simply add; softmax keeps a running maximum and sum per row (online softmax).
Metadata and the K/V append are ``torch_ref``'s.

gr-engine finds it through the ``gr_engine.attention_backends`` entry point declared in this
directory's ``pyproject.toml``; ``pip install -e examples/custom_backend``, then set
``attention_backend = "scaled_ref"``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn.functional as F

from attention_backends import BackendSupport
from attention_backends.torch_ref import TorchRefBackend, TorchRefMetadata


class ScaledRefBackend(TorchRefBackend):
    """``torch_ref`` with key-chunked attention (CPU and CUDA, any float dtype, HSTU and softmax)."""

    name: ClassVar[str] = "scaled_ref"
    support: ClassVar[BackendSupport] = dataclasses.replace(TorchRefBackend.support, time_bias=False)
    #: History keys per chunk (rounded down to whole pages, at least one page).
    chunk_tokens: ClassVar[int] = 1024

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
        metadata: TorchRefMetadata, time_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of every row, one chunk of history keys at a time.

        Args:
            q, k, v: ``[T, H, D]`` projections of all rows; candidates' own k/v are read from here.
            kv_cache: one layer's cache ``[num_pages, 2, page_size, H, D]`` (NHD).
            metadata: ``torch_ref``'s padded view of the step (``P`` query slots per request).

        Returns:
            ``[T, H, D]`` in ``q``'s dtype.
        """
        m = metadata
        compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        rows = m.row_index
        q_pad = q[rows].to(compute).transpose(1, 2)  # [B, H, P, D]
        own_v = v[rows].to(compute).transpose(1, 2)
        own_logit = (q_pad * k[rows].to(compute).transpose(1, 2)).sum(-1) * self.spec.alpha  # [B, H, P]
        own_allowed = m.is_candidate[:, None, :]  # [B, 1, P]: candidates also see their own k/v
        pages_per_chunk = max(1, self.chunk_tokens // kv_cache.shape[2])
        first_pages = range(0, m.block_table.shape[1], pages_per_chunk)

        if self.spec.kind == "hstu":
            acc = torch.where(own_allowed, F.silu(own_logit), 0.0)[..., None] * own_v
            for first in first_pages:
                logits, allowed, values = self._chunk(q_pad, kv_cache, m, first, pages_per_chunk)
                acc = acc + torch.where(allowed, F.silu(logits), 0.0) @ values
            out = acc / self.spec.scaling_seqlen
        else:
            # Running maximum, sum of exp(logit - maximum) and weighted values of each row.
            run_max = torch.where(own_allowed, own_logit, float("-inf"))
            run_sum = own_allowed.to(compute).expand_as(own_logit)
            acc = run_sum[..., None] * own_v
            for first in first_pages:
                logits, allowed, values = self._chunk(q_pad, kv_cache, m, first, pages_per_chunk)
                logits = logits.masked_fill(~allowed, float("-inf"))
                new_max = torch.maximum(run_max, logits.amax(-1))
                shift = torch.where(torch.isfinite(new_max), new_max, 0.0)  # rows with no key yet
                rescale = torch.exp(run_max - shift)
                probs = torch.exp(logits - shift[..., None])
                run_sum = run_sum * rescale + probs.sum(-1)
                acc = acc * rescale[..., None] + probs @ values
                run_max = new_max
            out = acc / torch.where(run_sum > 0, run_sum, 1.0)[..., None]  # padding slots have no key

        result = torch.empty_like(q)
        result[rows[m.row_valid]] = out.transpose(1, 2)[m.row_valid].to(q.dtype)
        return result

    def _chunk(
        self, q_pad: torch.Tensor, kv_cache: torch.Tensor, m: TorchRefMetadata, first_page: int, num_pages: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scores of every query slot against the history keys of logical pages ``first_page ..
        first_page + num_pages`` of each request.

        Args:
            q_pad: ``[B, H, P, D]`` queries in the compute dtype.
            kv_cache: ``[num_pages, 2, page_size, H, D]`` (NHD).
            m: the step's metadata.

        Returns:
            ``alpha q.k`` logits ``[B, H, P, K]``, which of them are allowed ``[B, 1, P, K]`` (bool) and the
            chunk's values ``[B, H, K, D]``, for ``K`` keys of the chunk.
        """
        batch, heads, _, dim = q_pad.shape
        pages = kv_cache[m.block_table[:, first_page:first_page + num_pages]]  # [B, c, 2, page_size, H, D]
        key_pos = first_page * kv_cache.shape[2] + torch.arange(pages.shape[1] * pages.shape[3], device=q_pad.device)
        # Slots past a request's history (unwritten, or the block table's padding: page 0, another user's) may
        # hold inf or NaN; zeroed, they enter no product.
        in_history = (key_pos[None, :] < m.common.kv_seq_lens.long()[:, None])[:, :, None, None]  # [B, K, 1, 1]
        keys = torch.where(in_history, pages[:, :, 0].reshape(batch, -1, heads, dim), 0)
        values = torch.where(in_history, pages[:, :, 1].reshape(batch, -1, heads, dim), 0)
        keys = keys.to(q_pad.dtype).transpose(1, 2)  # [B, H, K, D]
        values = values.to(q_pad.dtype).transpose(1, 2)
        logits = q_pad @ keys.transpose(-1, -2) * self.spec.alpha
        allowed = (key_pos[None, None, :] < m.key_limit[:, :, None])[:, None]
        return logits, allowed, values
