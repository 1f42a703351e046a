"""``xformers`` (softmax attention) against the ``torch_ref`` oracle's softmax path.

On CPU, where xformers cannot run, a stand-in ``xformers.ops`` (a dense per-block implementation of
``memory_efficient_attention`` with ``BlockDiagonalCausalFromBottomRightMask`` semantics) checks the
backend's own work: the block layout of the mask and the gather of paged histories and candidates' own
keys. ``gpu`` tests run the real kernels (xformers needs ``libcudart.so.12`` on ``LD_LIBRARY_PATH``
there) and compare them with ``TorchRefBackend`` of kind ``softmax`` at bf16/fp16 tolerance.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types

import msgspec
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attention_backends import AttentionSpec
from attention_backends.torch_ref import TorchRefBackend
from attention_backends.xformers_backend import XFormersBackend
from gr_engine import GREngine
from tests.attention_cases import build_case, check_cache_holds_history
from tests.conftest import requires_cuda, tiny_config, with_cache
from tests.test_backend_conformance import CASE_NAMES, assert_close, case_for, check_backend

HAS_XFORMERS = importlib.util.find_spec("xformers") is not None
needs_xformers = pytest.mark.skipif(not HAS_XFORMERS, reason="xformers is not installed")


def make_spec(device: str, dtype: torch.dtype, head_dim: int = 16, page_size: int = 16, heads: int = 2):
    return AttentionSpec(kind="softmax", num_heads=heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
                         device_type=device, alpha=head_dim**-0.5, scaling_seqlen=1)


class _BottomRightBlocks:
    """Stand-in for xformers' ``BlockDiagonalCausalFromBottomRightMask``: records the blocks."""

    def __init__(self, q_seqlen: list[int], kv_seqlen: list[int]) -> None:
        assert all(k >= q > 0 for q, k in zip(q_seqlen, kv_seqlen, strict=True)), (q_seqlen, kv_seqlen)
        self.q_seqlen, self.kv_seqlen = q_seqlen, kv_seqlen

    @classmethod
    def from_seqlens(cls, q_seqlen: list[int], kv_seqlen: list[int], *, device: torch.device) -> _BottomRightBlocks:
        assert all(isinstance(x, int) for x in q_seqlen + kv_seqlen)  # host lists, as xformers requires
        return cls(q_seqlen, kv_seqlen)


def _dense_memory_efficient_attention(query, key, value, attn_bias, scale):
    """Block-diagonal bottom-right-causal softmax attention of ``[1, M, H, D]`` inputs, in float64."""
    assert query.shape[0] == key.shape[0] == value.shape[0] == 1 and query.dtype == key.dtype == value.dtype
    assert sum(attn_bias.q_seqlen) == query.shape[1] and sum(attn_bias.kv_seqlen) == key.shape[1]
    out, q0, k0 = [], 0, 0
    for n, s in zip(attn_bias.q_seqlen, attn_bias.kv_seqlen):
        q, k, v = query[0, q0:q0 + n].double(), key[0, k0:k0 + s].double(), value[0, k0:k0 + s].double()
        logits = torch.einsum("qhd,khd->hqk", q, k) * scale
        visible = torch.arange(s)[None, :] <= s - n + torch.arange(n)[:, None]
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
        q0, k0 = q0 + n, k0 + s
    return torch.cat(out)[None].to(query.dtype)


@pytest.fixture
def cpu_xformers(monkeypatch):
    """Install the stand-in ``xformers.ops`` and let the backend serve CPU float32 specs."""
    ops = types.ModuleType("xformers.ops")
    ops.memory_efficient_attention = _dense_memory_efficient_attention
    ops.fmha = types.SimpleNamespace(attn_bias=types.SimpleNamespace(
        BlockDiagonalCausalFromBottomRightMask=_BottomRightBlocks))
    package = types.ModuleType("xformers")
    package.ops = ops
    monkeypatch.setitem(sys.modules, "xformers", package)
    monkeypatch.setitem(sys.modules, "xformers.ops", ops)
    monkeypatch.setattr(XFormersBackend, "reasons_unsupported", classmethod(lambda cls, spec: []))


@pytest.mark.parametrize("case_name", CASE_NAMES)
def test_block_layout_and_gather_on_cpu(cpu_xformers, case_name):
    spec = make_spec("cpu", torch.float32)
    check_backend(XFormersBackend(spec), case_for(spec, case_name))


def test_metadata_blocks_on_cpu(cpu_xformers):
    # Request 0: 2 new history rows over 5 keys, then 2 candidates; request 1: no rows at all; request 2: only
    # a candidate and no history; request 3: one new row, no candidate.
    case = build_case([3, 4, 0, 9], [2, 0, 0, 1], [2, 0, 1, 0], heads=2, dim=16, page_size=16)
    backend = XFormersBackend(make_spec("cpu", torch.float32))
    meta = backend.build_metadata(case.metadata)
    assert meta.attn_bias.q_seqlen == [2, 1, 1, 1, 1]
    assert meta.attn_bias.kv_seqlen == [5, 6, 6, 1, 10]
    assert meta.num_keys == 28
    assert meta.own_dest.tolist() == [10, 16, 17] and meta.own_rows.tolist() == [2, 3, 4]
    assert sorted(meta.history_dest.tolist() + meta.own_dest.tolist()) == list(range(28))
    # Without the host copies, the same plan from one read of the device.
    assert case.metadata.host is not None
    again = backend.build_metadata(dataclasses.replace(case.metadata, host=None))
    assert (again.attn_bias.q_seqlen, again.attn_bias.kv_seqlen) == (meta.attn_bias.q_seqlen, meta.attn_bias.kv_seqlen)
    for field in ("history_dest", "history_page", "history_entry", "own_dest", "own_rows"):
        assert torch.equal(getattr(again, field), getattr(meta, field)), field


class _NoDeviceSync(TorchDispatchMode):
    """Fails on an op that reads a tensor's value on the host (a device synchronisation on CUDA)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func is not torch.ops.aten._local_scalar_dense.default, func
        return func(*args, **(kwargs or {}))


def test_per_layer_calls_do_not_read_the_device(cpu_xformers):
    case = case_for(make_spec("cpu", torch.float32), "mixed_lengths")
    backend = XFormersBackend(make_spec("cpu", torch.float32))
    meta = backend.build_metadata(case.metadata)
    with _NoDeviceSync():
        backend.append_kv(case.kv_cache, case.k, case.v, meta)
        backend.attend(case.q, case.k, case.v, case.kv_cache, meta)


def test_empty_step_on_cpu(cpu_xformers):
    backend = XFormersBackend(make_spec("cpu", torch.float32))
    case = build_case([4], [0], [0], heads=2, dim=16, page_size=16)
    meta = backend.build_metadata(case.metadata)
    assert meta.attn_bias is None
    assert backend.attend(case.q, case.k, case.v, case.kv_cache, meta).shape == (0, 2, 16)


def test_engine_with_a_sasrec_model_on_cpu(cpu_xformers):
    from tests.test_engine_differential import max_diff, stream

    config = tiny_config(architecture="sasrec", num_gpu_pages=160)  # pages run out: users are evicted
    requests = stream(config, num_users=10, visits=6, seed=4)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    engine = GREngine(msgspec.structs.replace(config, attention_backend="xformers"))
    assert type(engine.backend) is XFormersBackend
    assert max_diff(engine.rank(requests, use_tqdm=False), expected) <= 1e-5
    assert engine.stats.total_hit_ratio > 0.1


def test_reasons_unsupported():
    cuda = make_spec("cuda", torch.bfloat16, head_dim=64)
    reasons = XFormersBackend.reasons_unsupported(dataclasses.replace(cuda, kind="hstu", dtype=torch.float32))
    assert "attention kind 'hstu' not in ['softmax']" in reasons
    assert any("dtype torch.float32" in r for r in reasons)
    if not torch.cuda.is_available():
        assert any("CUDA is not available" in r for r in XFormersBackend.reasons_unsupported(cuda))
    if not HAS_XFORMERS:
        assert "xformers is not installed (pip install xformers)" in XFormersBackend.reasons_unsupported(cuda)


# ---- GPU: the real xformers kernels against torch_ref's softmax path --------------------------------------


def run_against_torch_ref(layout: list[tuple[int, int, int]], spec: AttentionSpec) -> None:
    cached, new, candidates = (list(x) for x in zip(*layout))
    case = build_case(cached, new, candidates, heads=spec.num_heads, dim=spec.head_dim, page_size=spec.page_size,
                      dtype=spec.dtype, device="cuda", seed=len(layout))
    ref, ref_cache = TorchRefBackend(spec), case.kv_cache.clone()
    ref_meta = ref.build_metadata(case.metadata)
    ref.append_kv(ref_cache, case.k, case.v, ref_meta)
    expected = ref.attend(case.q, case.k, case.v, ref_cache, ref_meta)

    backend = XFormersBackend(spec)
    meta = backend.build_metadata(case.metadata)
    backend.append_kv(case.kv_cache, case.k, case.v, meta)
    assert torch.equal(case.kv_cache, ref_cache)
    check_cache_holds_history(case)
    got = backend.attend(case.q, case.k, case.v, case.kv_cache, meta)
    assert got.shape == case.q.shape and got.dtype == spec.dtype
    assert_close(got, expected.double().cpu(), spec.dtype)


GPU_LAYOUT = [(37, 5, 3), (0, 20, 4), (31, 1, 0), (32, 0, 6), (0, 0, 3), (16, 1, 2), (150, 60, 100), (5, 0, 1)]


@pytest.mark.gpu
@requires_cuda
@needs_xformers
@pytest.mark.parametrize(("dtype", "head_dim", "page_size"), [
    (torch.bfloat16, 64, 16), (torch.bfloat16, 128, 32), (torch.float16, 64, 64), (torch.float16, 256, 16),
])
def test_gpu_matches_torch_ref_softmax(dtype, head_dim, page_size):
    run_against_torch_ref(GPU_LAYOUT, make_spec("cuda", dtype, head_dim=head_dim, page_size=page_size, heads=4))


@pytest.mark.gpu
@requires_cuda
@needs_xformers
def test_gpu_sasrec_sized_batch():
    layout = [(190, 10, 100)] * 6 + [(0, 200, 0), (0, 0, 100)]  # SASRec-style: 200-item histories, 100 candidates
    run_against_torch_ref(layout, make_spec("cuda", torch.bfloat16, head_dim=64, page_size=16, heads=2))


@pytest.mark.gpu
@requires_cuda
@needs_xformers
def test_gpu_engine_sasrec_scores_equal_torch_ref():
    from tests.test_engine_differential import stream

    config = tiny_config(architecture="sasrec", max_num_seqs=8, max_num_batched_tokens=256, page_size=16,
                         num_gpu_pages=400, d_model=128, num_heads=2, head_dim=64, dtype="bfloat16")
    config = msgspec.structs.replace(config, device="cuda")
    requests = stream(config, num_users=12, visits=6, seed=3)
    scores = {}
    for name in ("torch_ref", "xformers"):
        outputs = GREngine(msgspec.structs.replace(config, attention_backend=name)).rank(requests, use_tqdm=False)
        assert all(o.error is None for o in outputs)
        scores[name] = np.concatenate([np.asarray(o.scores).ravel() for o in outputs])
    assert np.abs(scores["xformers"] - scores["torch_ref"]).max() <= 5e-2
