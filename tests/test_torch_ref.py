"""torch_ref paged attention equals dense attention, for HSTU and softmax, across edge cases."""

from __future__ import annotations

import pytest
import torch

from attention_backends import AttentionSpec
from attention_backends.torch_ref import TorchRefBackend
from tests.attention_cases import build_case, check_cache_holds_history, reference_attention

CASES = {
    "mixed": ([5, 0, 12, 7], [3, 6, 1, 0], [2, 3, 0, 4]),
    "page_boundaries": ([4, 8, 3], [4, 1, 1], [1, 1, 1]),  # last page full / holding 1 token
    "no_history_at_all": ([0, 9], [0, 0], [3, 2]),
    "single_new_token": ([15], [1], [0]),
    "cold_prefill": ([0, 0], [13, 4], [0, 5]),
}


@pytest.mark.parametrize("kind", ["hstu", "softmax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_dense(kind, name):
    cached, new, cands = CASES[name]
    case = build_case(cached, new, cands, seed=len(name))
    spec = AttentionSpec(kind=kind, num_heads=2, head_dim=8, page_size=4, dtype=torch.float32,
                         device_type="cpu", alpha=0.3, scaling_seqlen=17)
    backend = TorchRefBackend(spec)
    meta = backend.build_metadata(case.metadata)
    backend.append_kv(case.kv_cache, case.k, case.v, meta)
    check_cache_holds_history(case)
    out = backend.attend(case.q, case.k, case.v, case.kv_cache, meta)
    expected = reference_attention(case, alpha=0.3, scaling_seqlen=17, kind=kind)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_rejects_unsupported_spec():
    spec = AttentionSpec(kind="hstu", num_heads=2, head_dim=8, page_size=4, dtype=torch.int8,
                         device_type="tpu", alpha=1.0, scaling_seqlen=1)
    with pytest.raises(ValueError, match=r"device 'tpu'.*dtype"):
        TorchRefBackend(spec)


def test_time_bucket_is_exact_near_powers_of_two():
    from attention_backends.base import time_bucket

    k = torch.arange(0, 62)
    for offset in (-1, 0, 1):
        delta = (torch.ones_like(k) << k) + offset - 1  # 1 + |delta| = 2^k + offset
        expected = torch.tensor([(abs(int(d)) + 1).bit_length() - 1 for d in delta])
        assert torch.equal(time_bucket(delta, 100), expected)
        assert torch.equal(time_bucket(-delta, 100), expected)
    assert torch.equal(time_bucket(torch.tensor([0, 10**12]), 8), torch.tensor([0, 7]))
