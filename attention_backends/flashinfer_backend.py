"""``flashinfer``: FlashInfer's paged K/V append, composed with ``hstu_triton``'s paged HSTU attention.

New history K/V are written with ``flashinfer.page.append_paged_kv_cache`` straight into the layer's 5-D NHD
cache ``[num_pages, 2, page_size, H, D]``. That kernel needs, per appended row, its request and its
position in the request's history. :class:`PagedBatchMetadata` already holds exactly these, built once
per step: ``append_batch_indices`` / ``append_positions`` are what ``flashinfer.get_batch_indices_positions(
append_indptr, kv_seq_lens, N)`` returns for ``append_indptr = [0, cumsum(num_history_rows)]`` (position
``seq_len - append_len + j`` for row ``j`` of a request's append), so :meth:`FlashInferBackend.build_metadata`
takes them as they are and no layer recomputes them (the GPU tests check the equality).

FlashInfer has no HSTU (SiLU, no softmax) attention kernel built in, so attention runs ``hstu_triton``'s
kernel over the same pages; this backend is therefore CUDA-only, fp16/bf16 (FlashInfer's append has no
fp32), head dims both support (64/128/256) and the Triton kernel's page sizes (16/32/64); the relative
time bias, if any, is applied by that kernel too.

``flashinfer`` is imported only when the backend is checked or created, never by ``import
attention_backends``; its first append JIT-compiles FlashInfer's page module (about 10 s, then cached).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch

from . import hstu_triton
from .base import AttentionBackend, AttentionSpec, BackendSupport, PagedBatchMetadata
from .hstu_triton import HSTUTritonBackend, HSTUTritonMetadata


def _flashinfer_reasons(check_import: bool) -> list[str]:
    """Why FlashInfer cannot be used: not installed; or (``check_import``) installed but not importable."""
    if importlib.util.find_spec("flashinfer") is None:
        return ["flashinfer is not installed (pip install flashinfer-python)"]
    if check_import:
        try:
            importlib.import_module("flashinfer")
        except (ImportError, OSError, RuntimeError) as exc:
            return [f"flashinfer cannot be imported: {type(exc).__name__}: {exc}"]
    return []


@dataclass
class FlashInferMetadata:
    """One step's view for this backend.

    Attributes:
        common: the common metadata it was built from.
        batch_indices: int32 ``[N]`` request of each new history row (FlashInfer's ``batch_indices``).
        positions: int32 ``[N]`` position of each new history row in its request's history
            (FlashInfer's ``positions``).
        attention: the Triton attention kernel's tile map.
    """

    common: PagedBatchMetadata
    batch_indices: torch.Tensor
    positions: torch.Tensor
    attention: HSTUTritonMetadata


class FlashInferBackend(AttentionBackend):
    """HSTU attention on CUDA: K/V appended by FlashInfer's kernel, attention by ``hstu_triton``'s.

    Args:
        spec: what the model asks of attention.
    """

    name: ClassVar[str] = "flashinfer"
    support: ClassVar[BackendSupport] = BackendSupport(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        kinds=frozenset({"hstu"}),
        head_dims=frozenset({64, 128, 256}),
        page_sizes=frozenset({16, 32, 64}),
        time_bias=True,
    )
    #: Below ``hstu_triton``: same attention kernel, and the append is a small part of a layer's time,
    #: so ``auto`` prefers the backend without FlashInfer's JIT build. Select it by name.
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
        return reasons + _flashinfer_reasons(check_import=not reasons)

    def build_metadata(self, common: PagedBatchMetadata) -> FlashInferMetadata:
        """FlashInfer's append indices (taken from ``common``, no extra work) and the attention tile map."""
        return FlashInferMetadata(common, common.append_batch_indices, common.append_positions,
                                  self._attention.build_metadata(common))

    def append_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: FlashInferMetadata
    ) -> None:
        """Write the new history rows' K/V into their pages with ``flashinfer.page.append_paged_kv_cache``.

        Args:
            kv_cache: one layer's cache ``[num_pages, 2, page_size, H, D]`` (NHD, ``[:, 0]`` = K), fp16/bf16,
                last dim contiguous; written in place.
            key: ``[N, H, D]`` K of the new history rows in ``history_rows`` order, ``kv_cache``'s dtype,
                last dim contiguous (row and head strides are free).
            value: ``[N, H, D]`` V of the new history rows, like ``key``.
            metadata: what :meth:`build_metadata` returned for this step.
        """
        if key.shape[0] == 0:
            return
        if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
            # FlashInfer does not check this: it would reinterpret the bytes.
            raise TypeError(f"K/V dtype {key.dtype}/{value.dtype} differs from the cache's {kv_cache.dtype}")
        c = metadata.common
        self._flashinfer_page.append_paged_kv_cache(
            key, value, metadata.batch_indices, metadata.positions, kv_cache,
            c.kv_indices, c.kv_indptr, c.kv_last_page_len, kv_layout="NHD",
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
        metadata: FlashInferMetadata, time_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """HSTU attention of every row, by ``hstu_triton``'s kernel (after :meth:`append_kv`).

        Args:
            q, k, v: ``[T, H, D]`` fp16/bf16 projections of all rows (any row and head strides).
            kv_cache: ``[num_pages, 2, page_size, H, D]`` (NHD) in ``q``'s dtype.
            metadata: what :meth:`build_metadata` returned for this step.
            time_bias: ``[num_buckets, H]`` relative time bias (times from ``metadata.common.timestamps``),
                or ``None``; applied by ``hstu_triton``'s kernel.

        Returns:
            ``[T, H, D]`` in ``q``'s dtype, contiguous.
        """
        return self._attention.attend(q, k, v, kv_cache, metadata.attention, time_bias=time_bias)
