"""``flashinfer``: FlashInfer's paged K/V append, composed with ``hstu_triton``'s paged HSTU attention.

The append's rows are placed by ``append_batch_indices`` and ``append_positions`` (what
``flashinfer.get_batch_indices_positions`` returns; the GPU tests check it). FlashInfer has no HSTU (SiLU)
attention, hence ``hstu_triton``'s; its append has no fp32. ``flashinfer`` is imported only when the backend is
checked or created; its first append JIT-compiles FlashInfer's page module (then cached).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import ClassVar

import torch

from . import hstu_triton
from .base import AttentionBackend, AttentionSpec, BackendSupport, PagedBatchMetadata, package_reasons
from .hstu_triton import HSTUTritonBackend, HSTUTritonMetadata


class FlashInferBackend(AttentionBackend):
    """HSTU attention on CUDA: K/V appended by FlashInfer's kernel, attention (and metadata) by ``hstu_triton``."""

    name: ClassVar[str] = "flashinfer"
    support: ClassVar[BackendSupport] = BackendSupport(
        devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}), kinds=frozenset({"hstu"}),
        head_dims=frozenset({64, 128, 256}), page_sizes=frozenset({16, 32, 64}), time_bias=True)
    #: Below ``hstu_triton`` (same attention): ``auto`` skips FlashInfer's JIT.
    priority: ClassVar[int] = 5

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self._flashinfer_page: ModuleType = importlib.import_module("flashinfer.page")
        self._attention = HSTUTritonBackend(spec)

    @classmethod
    def reasons_unsupported(cls, spec: AttentionSpec) -> list[str]:
        reasons = cls.support.reasons_unsupported(spec)
        if spec.device_type == "cuda" and not torch.cuda.is_available():
            reasons.append("CUDA is not available (torch.cuda.is_available() is False)")
        if hstu_triton.triton is None:
            reasons.append("triton is not installed (pip install triton): it runs the attention")
        # Import FlashInfer (seconds) only for a configuration it could otherwise serve.
        return reasons + package_reasons("flashinfer", "flashinfer", "flashinfer-python", check_import=not reasons)

    def build_metadata(self, common: PagedBatchMetadata) -> HSTUTritonMetadata:
        return self._attention.build_metadata(common)

    def append_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  metadata: HSTUTritonMetadata) -> None:
        """By ``flashinfer.page.append_paged_kv_cache``: fp16/bf16, last dims contiguous; ``TypeError`` if the
        dtypes differ (FlashInfer would reinterpret the bytes)."""
        if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
            raise TypeError(f"K/V dtype {key.dtype}/{value.dtype} differs from the cache's {kv_cache.dtype}")
        c = metadata.common
        if c.history_rows.shape[0] == 0:
            return
        self._flashinfer_page.append_paged_kv_cache(
            key[c.history_rows], value[c.history_rows], c.append_batch_indices, c.append_positions, kv_cache,
            c.kv_indices, c.kv_indptr, c.kv_last_page_len, kv_layout="NHD",
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               metadata: HSTUTritonMetadata, time_bias: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`.hstu_triton.HSTUTritonBackend.attend`."""
        return self._attention.attend(q, k, v, kv_cache, metadata, time_bias=time_bias)
