"""The bench's model FLOP count (:mod:`gr_engine.bench.flops`) against independent counts: attended pairs by
enumeration, the layers' linear FLOPs by torch's FLOP counter over a real forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gr_engine import ModelConfig
from gr_engine.bench.flops import attended_pairs, gemm_peak_tflops, step_flops
from gr_engine.models.layers import HSTULayer, SASRecLayer


def test_attended_pairs_equal_an_enumeration():
    rng = np.random.default_rng(0)
    history = rng.integers(1, 60, 40)
    cached = (rng.random(40) * history).astype(np.int64)
    candidates = rng.integers(0, 9, 40)
    expected = []
    for p, n, c in zip(cached, history, candidates):
        keys = sum(len(range(0, i + 1)) for i in range(p, n))  # new row at position i sees keys 0..i
        keys += sum(n + 1 for _ in range(c))  # a candidate: the whole history and itself
        expected.append(keys)
    assert attended_pairs(cached, history, candidates).tolist() == expected


@pytest.mark.parametrize("architecture,concat_ua", [("hstu", False), ("hstu", True), ("sasrec", False)])
def test_linear_flops_equal_torchs_count(architecture, concat_ua):
    config = ModelConfig(architecture=architecture, d_model=48, num_heads=3, head_dim=16, num_layers=2,
                         concat_ua=concat_ua, dtype="float32")
    layer = (HSTULayer if architecture == "hstu" else SASRecLayer)(config)
    cached, history, candidates = np.array([5, 0]), np.array([30, 17]), np.array([4, 2])
    rows = int((history - cached + candidates).sum())

    def attend(q, k, v, time_bias):  # no products: only the linear maps are counted
        return torch.zeros_like(q)

    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(rows, config.d_model), attend)
    width = config.num_heads * config.head_dim
    attention = 4 * width * attended_pairs(cached, history, candidates).sum()
    linear = step_flops(config, cached, history, candidates) / config.num_layers - attention
    assert linear == counter.get_total_flops()


def test_no_gemm_peak_off_cuda():
    assert gemm_peak_tflops("cpu") is None
