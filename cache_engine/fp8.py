"""FP8 (e4m3) host chunks in torch: quantisation with one scale per (slot, layer, K/V, head), and its inverse. The
CPU path uses these; the transfer kernels' tests compare against them (docs/design.md section 5, "FP8 host chunks")."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize(chunks: torch.Tensor, tokens: torch.Tensor | list[int], scales: torch.Tensor,
             slot_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """``chunks`` (``[J, L, pages, 2, page_size, H, D]``) to FP8, each (chunk, layer, K/V, head) divided by its scale
    ``max(amax / 448, tiny)``, written to ``scales[slot_ids[j]]`` (float32 ``[num_slots, L, 2, H]``) and taken over
    chunk ``j``'s first ``tokens[j]`` tokens (int64 ``[J]``); the rows after them (a previous owner's) become zeros."""
    num_chunks, _, pages, _, page_size = chunks.shape[:5]
    rows = torch.arange(pages * page_size, device=chunks.device).view(1, 1, pages, 1, page_size, 1, 1)
    counts = torch.as_tensor(tokens, device=chunks.device).view(num_chunks, 1, 1, 1, 1, 1, 1)
    chunks = torch.where(rows < counts, chunks, torch.zeros((), dtype=chunks.dtype, device=chunks.device))
    amax = chunks.abs().amax(dim=(2, 4, 6)).float()  # [J, L, 2, H]
    # By a tensor: CUDA torch divides by a Python number as a product with its reciprocal, not exactly.
    scale = (amax / torch.full((), FP8_MAX, device=amax.device)).clamp_min(torch.finfo(torch.float32).tiny)
    scales[torch.as_tensor(slot_ids, device=scales.device)] = scale
    return (chunks.float() / scale[:, :, None, :, None, :, None]).to(FP8)


def dequantize(pages: torch.Tensor, scales: torch.Tensor, layer: int, dtype: torch.dtype) -> torch.Tensor:
    """``pages`` (``[P, 2, page_size, H, D]`` FP8, one layer) back to ``dtype``, times ``scales`` (float32
    ``[P, L, 2, H]``: each page's slot's scales)."""
    return (pages.float() * scales[:, layer, :, None, :, None]).to(dtype)
