"""Transformer layers of the engine's models; each gets its attention as an ``attend(q, k, v)`` callable.

- :class:`HSTULayer` (docs/design.md section 4): ``u,v,q,k = silu(Linear(LN(x)))``, SiLU attention with a fixed
  normaliser, ``x + Linear(u * LN(attn))``. On CUDA its norms and gate are the Triton kernels of :mod:`.fused_ops`
  (imported then only); on CPU they are torch's ops, the reference.
- :class:`SASRecLayer`: a pre-norm softmax transformer block (SASRec-style sequential recommenders), for
  comparison with classic softmax attention under the same engine and cache.

Both are cache-consistent: a history token's K/V depend only on the tokens before it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig

AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``attend(q, k, v, time_bias) -> out``: ``q, k, v, out`` are ``[T, H, D]``; ``time_bias`` is the
layer's ``[time_bias_buckets, H]`` relative time bias table, or ``None``."""


class FusedLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state-dict names) over the last dim of ``[T, N]`` inputs, one Triton
    kernel (:func:`.fused_ops.layer_norm`) on CUDA."""

    def forward(self, x: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
        """Args: ``x`` ``[T, N]``; ``fused``: run the kernel (default: on CUDA; on CPU only under Triton's
        interpreter, for tests). Returns ``[T, N]``, ``x``'s dtype."""
        if not (x.is_cuda if fused is None else fused):
            return super().forward(x)
        from .fused_ops import layer_norm

        return layer_norm(x, self.weight, self.bias, self.eps)


class HSTULayer(nn.Module):
    """``u,v,q,k = silu(Linear(LN(x)))``; ``x + Linear(u * LN(attn(q, k, v)))``. On CUDA, ``LN(x)`` (with ``x`` plus
    the output bias, which the output GEMM adds its product to: no residual add of its own) is one kernel, ``u *
    LN(attn)`` (or ``[u, attn, u * LN(attn)]``) another (:mod:`.fused_ops`), and in bf16 or fp16 the projection's
    SiLU is its GEMM's epilogue (:mod:`.fused_linear`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        width = config.num_heads * config.head_dim
        self.concat_ua = config.concat_ua
        self.input_norm = FusedLayerNorm(config.d_model, eps=1e-6)
        self.uvqk = nn.Linear(config.d_model, 4 * width)
        self.attn_norm = nn.LayerNorm(width, eps=1e-6)
        self.output = nn.Linear(3 * width if config.concat_ua else width, config.d_model)
        self.time_bias = _time_bias_table(config)

    def forward(self, x: torch.Tensor, attend: AttendFn, fused: bool | None = None) -> torch.Tensor:
        """Args: ``x`` ``[T, d_model]``; ``fused``: use :mod:`.fused_ops`' kernels (default: on CUDA; on CPU only
        under Triton's interpreter, for tests). Returns ``[T, d_model]``."""
        fused = x.is_cuda if fused is None else fused
        heads = (self.num_heads, self.head_dim)
        if fused:  # LN(x) and the residual plus the output bias, in one kernel
            from .fused_ops import gated_attn_norm, layer_norm_and_shift

            norm = self.input_norm
            normed, residual = layer_norm_and_shift(x, norm.weight, norm.bias, norm.eps, self.output.bias)
        else:
            normed = self.input_norm(x, fused)
        u, v, q, k = self._projection(normed, fused).split(self.num_heads * self.head_dim, dim=-1)
        attn = attend(q.unflatten(1, heads), k.unflatten(1, heads), v.unflatten(1, heads), self.time_bias).flatten(1)
        if fused:
            y = gated_attn_norm(attn, u, self.attn_norm.weight, self.attn_norm.bias, self.attn_norm.eps, self.concat_ua)
            # in place: the GEMM accumulates into the residual (an out-of-place addmm would first copy it)
            return residual.addmm_(y, self.output.weight.t())
        normed = self.attn_norm(attn)
        y = torch.cat([u, attn, u * normed], dim=-1) if self.concat_ua else u * normed
        return x + self.output(y)

    def _projection(self, normed: torch.Tensor, fused: bool) -> torch.Tensor:
        """``silu(uvqk(normed))`` ``[T, 4W]``: one kernel with the SiLU in the GEMM's epilogue
        (:func:`.fused_linear.linear_silu`) on the fused path where it takes the inputs (bf16 or fp16), else cuBLAS
        then torch's SiLU."""
        if fused:
            from .fused_linear import linear_silu, supports

            if supports(normed, self.uvqk.weight):
                return linear_silu(normed, self.uvqk.weight, self.uvqk.bias)
        return F.silu(self.uvqk(normed))


class SASRecLayer(nn.Module):
    """``x + Proj(attn(LN(x)))`` then ``x + FFN(LN(x))``, softmax attention (kind ``"softmax"``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        width = config.num_heads * config.head_dim
        self.attn_norm = nn.LayerNorm(config.d_model, eps=1e-6)
        self.qkv = nn.Linear(config.d_model, 3 * width)
        self.proj = nn.Linear(width, config.d_model)
        self.ffn_norm = nn.LayerNorm(config.d_model, eps=1e-6)
        self.ffn = nn.Sequential(nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(),
                                 nn.Linear(4 * config.d_model, config.d_model))
        self.time_bias = _time_bias_table(config)

    def forward(self, x: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """Args: ``x`` ``[T, d_model]``. Returns ``[T, d_model]``."""
        heads = (self.num_heads, self.head_dim)
        q, k, v = self.qkv(self.attn_norm(x)).split(self.num_heads * self.head_dim, dim=-1)
        attn = attend(q.unflatten(1, heads), k.unflatten(1, heads), v.unflatten(1, heads), self.time_bias)
        x = x + self.proj(attn.flatten(1))
        return x + self.ffn(self.ffn_norm(x))


def _time_bias_table(config: ModelConfig) -> nn.Parameter | None:
    """``[time_bias_buckets, H]`` in the model's dtype (backends add it in float32), or ``None``."""
    if not config.time_bias_buckets:
        return None
    return nn.Parameter(torch.zeros(config.time_bias_buckets, config.num_heads))
