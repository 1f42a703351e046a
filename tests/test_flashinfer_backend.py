"""``flashinfer`` (FlashInfer's paged append + ``hstu_triton``'s attention) against ``torch_ref``.

A stand-in ``flashinfer`` module (our pure-torch append, which has FlashInfer's exact semantics) checks
the backend's plumbing anywhere, CPU included: the arguments it passes and the composed attention (on CPU
in Triton's interpreter). ``gpu`` tests run the real FlashInfer kernel: the append must be
bit-exact (``torch.equal`` of the whole cache) with ``torch_ref``'s, our per-row append indices must equal
``flashinfer.get_batch_indices_positions``'s, and attention must match ``torch_ref`` at bf16/fp16 tolerance.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import types

import msgspec
import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # the Triton interpreter; read when hstu_triton's kernels are defined
    os.environ["TRITON_INTERPRET"] = "1"

import attention_backends.hstu_triton as hstu_triton
from attention_backends import AttentionSpec, paged
from attention_backends.flashinfer_backend import FlashInferBackend
from attention_backends.torch_ref import TorchRefBackend
from gr_engine import GREngine
from tests.attention_cases import build_case
from tests.conftest import requires_cuda, tiny_config, with_cache
from tests.test_backend_conformance import CASE_NAMES, assert_close, case_for, check_backend

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
needs_flashinfer = pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")


def make_spec(device: str, dtype: torch.dtype, head_dim: int = 64, page_size: int = 16, heads: int = 4):
    return AttentionSpec(kind="hstu", num_heads=heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
                         device_type=device, alpha=head_dim**-0.5, scaling_seqlen=64)


def test_reasons_when_flashinfer_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # what find_spec reports for an absent package
    reasons = FlashInferBackend.reasons_unsupported(make_spec("cuda", torch.bfloat16))
    assert "flashinfer is not installed (pip install flashinfer-python)" in reasons
    cpu = FlashInferBackend.reasons_unsupported(make_spec("cpu", torch.float32, head_dim=8, page_size=4))
    expected = {"device 'cpu' not in ['cuda']", "head_dim 8 not in [64, 128, 256]", "page_size 4 not in [16, 32, 64]"}
    assert expected <= set(cpu)


def test_reasons_when_flashinfer_fails_to_import(monkeypatch, tmp_path):
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("raise ImportError('libcudart.so.12: cannot open')\n")
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hstu_triton, "triton", hstu_triton.triton or types.ModuleType("triton"))
    assert FlashInferBackend.reasons_unsupported(make_spec("cuda", torch.bfloat16)) == [
        "flashinfer cannot be imported: ImportError: libcudart.so.12: cannot open"]


def test_reasons_without_cuda_or_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hstu_triton, "triton", None)
    reasons = FlashInferBackend.reasons_unsupported(make_spec("cuda", torch.bfloat16))
    assert "CUDA is not available (torch.cuda.is_available() is False)" in reasons
    assert any(r.startswith("triton is not installed") for r in reasons)


def _append_like_flashinfer(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices,
                            kv_indptr, kv_last_page_len, kv_layout="NHD"):
    """Stand-in for ``flashinfer.page.append_paged_kv_cache`` (same signature) that also checks the arguments."""
    assert kv_layout == "NHD" and paged_kv_cache.dim() == 5 and paged_kv_cache.shape[1] == 2
    assert all(t.dtype == torch.int32 for t in (batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len))
    assert append_key.dtype == append_value.dtype == paged_kv_cache.dtype and len(batch_indices) == len(append_key)
    paged.append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices,
                                kv_indptr, kv_last_page_len)


@pytest.fixture
def cpu_flashinfer(monkeypatch):
    """Install the stand-in ``flashinfer`` and let the backend serve float32 (and, on CPU, CPU) specs."""
    package, page = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.page")
    page.append_paged_kv_cache = _append_like_flashinfer
    package.page = page
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.page", page)
    monkeypatch.setattr(FlashInferBackend, "reasons_unsupported", classmethod(lambda cls, spec: []))


STAND_IN_SPEC = make_spec("cuda" if torch.cuda.is_available() else "cpu", torch.float32, head_dim=16, heads=2)
needs_attention = pytest.mark.skipif(bool(hstu_triton.HSTUTritonBackend.reasons_unsupported(STAND_IN_SPEC)),
                                     reason="hstu_triton cannot run here (on CPU: needs triton imported after "
                                     "TRITON_INTERPRET=1)")


@needs_attention
@pytest.mark.parametrize("time_buckets", [0, 12], ids=["plain", "time_bias"])
@pytest.mark.parametrize("case_name", CASE_NAMES)
def test_composition_with_stand_in_append(cpu_flashinfer, case_name, time_buckets):
    spec = dataclasses.replace(STAND_IN_SPEC, time_bias_buckets=time_buckets)  # the bias goes through to the kernel
    check_backend(FlashInferBackend(spec), case_for(spec, case_name))


@needs_attention
def test_append_rejects_a_dtype_mismatch(cpu_flashinfer):
    backend = FlashInferBackend(STAND_IN_SPEC)
    case = build_case([3], [2], [0], heads=2, dim=16, page_size=16, device=STAND_IN_SPEC.device_type)
    meta = backend.build_metadata(case.metadata)
    with pytest.raises(TypeError, match="differs from the cache"):
        backend.append_kv(case.kv_cache, case.k.half(), case.v.half(), meta)


# ---- GPU: the real FlashInfer kernel -------------------------------------------------------------------

GPU_LAYOUT = [(37, 5, 3), (0, 20, 4), (31, 1, 0), (32, 0, 6), (0, 0, 3), (16, 1, 2), (70, 40, 5), (5, 0, 1),
              (3000, 200, 100), (0, 700, 30)]


def gpu_case(layout, spec):
    cached, new, candidates = (list(x) for x in zip(*layout))
    return build_case(cached, new, candidates, heads=spec.num_heads, dim=spec.head_dim, page_size=spec.page_size,
                      dtype=spec.dtype, device="cuda", seed=spec.head_dim + spec.page_size,
                      time_buckets=spec.time_bias_buckets)


@pytest.mark.gpu
@requires_cuda
@needs_flashinfer
@pytest.mark.parametrize(("dtype", "head_dim", "page_size", "time_buckets"), [
    (torch.bfloat16, 128, 32, 0), (torch.bfloat16, 64, 16, 0), (torch.float16, 256, 64, 0), (torch.float16, 128, 16, 0),
    (torch.bfloat16, 128, 32, 24),  # with a relative time bias
])
def test_gpu_append_bit_exact_and_attention_matches_torch_ref(dtype, head_dim, page_size, time_buckets):
    import flashinfer

    spec = make_spec("cuda", dtype, head_dim=head_dim, page_size=page_size)
    spec = dataclasses.replace(spec, time_bias_buckets=time_buckets)
    case = gpu_case(GPU_LAYOUT, spec)
    common = case.metadata
    # Our per-row append indices are FlashInfer's own.
    append_indptr = torch.cumsum(torch.nn.functional.pad(common.num_history_rows, (1, 0)), 0, dtype=torch.int32)
    batch_indices, positions = flashinfer.get_batch_indices_positions(append_indptr, common.kv_seq_lens,
                                                                      len(common.history_rows))
    assert torch.equal(batch_indices, common.append_batch_indices) and torch.equal(positions, common.append_positions)
    assert torch.equal(flashinfer.get_seq_lens(common.kv_indptr, common.kv_last_page_len, page_size),
                       common.kv_seq_lens)

    ref, ref_cache = TorchRefBackend(spec), case.kv_cache.clone()
    ref_meta = ref.build_metadata(common)
    ref.append_kv(ref_cache, case.k, case.v, ref_meta)
    expected = ref.attend(case.q, case.k, case.v, ref_cache, ref_meta, time_bias=case.time_bias)

    backend = FlashInferBackend(spec)
    meta = backend.build_metadata(common)
    backend.append_kv(case.kv_cache, case.k, case.v, meta)
    torch.cuda.synchronize()
    assert torch.equal(case.kv_cache, ref_cache)  # bit-exact, every page (untouched ones included)
    got = backend.attend(case.q, case.k, case.v, case.kv_cache, meta, time_bias=case.time_bias)
    assert got.shape == case.q.shape and got.dtype == dtype
    assert_close(got, expected.double().cpu(), dtype)


@pytest.mark.gpu
@requires_cuda
@needs_flashinfer
def test_gpu_engine_scores_equal_torch_ref():
    from tests.test_engine_differential import stream

    config = tiny_config(max_num_seqs=8, max_num_batched_tokens=256, page_size=16, num_gpu_pages=400, d_model=128,
                         num_heads=2, head_dim=64, dtype="bfloat16")
    config = with_cache(msgspec.structs.replace(config, device="cuda"), mode="gpu_only")
    requests = stream(config, num_users=12, visits=6, seed=3)
    scores = {}
    for name in ("torch_ref", "flashinfer"):
        outputs = GREngine(msgspec.structs.replace(config, attention_backend=name)).rank(requests, use_tqdm=False)
        assert all(o.error is None for o in outputs)
        scores[name] = np.concatenate([np.asarray(o.scores).ravel() for o in outputs])
    assert np.abs(scores["flashinfer"] - scores["torch_ref"]).max() <= 5e-2


@needs_attention
def test_engine_with_stand_in_append(cpu_flashinfer):
    from tests.test_engine_differential import max_diff, stream

    config = tiny_config(page_size=16, head_dim=16, num_gpu_pages=60, max_history_len=128)
    config = msgspec.structs.replace(config, device=STAND_IN_SPEC.device_type)
    requests = stream(config, num_users=4, visits=4, seed=6)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    engine = GREngine(msgspec.structs.replace(config, attention_backend="flashinfer"))
    assert type(engine.backend) is FlashInferBackend
    assert max_diff(engine.rank(requests, use_tqdm=False), expected) <= 1e-4
