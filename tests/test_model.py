"""The model's cache-consistency invariants, its oracle, and weight save/load."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from gr_engine import GREngine, GRModel, RankRequest
from gr_engine.config import ModelConfig
from tests.conftest import tiny_config


def _capture_kv(model: GRModel, items, actions, candidates):
    """Per-layer K/V of every token of a dense reference forward."""
    captured = []
    layers = model.layers
    originals = [layer.forward for layer in layers]

    def wrap(layer, original):
        def forward(x, attend):
            def spy(q, k, v, time_bias):
                captured.append((k.clone(), v.clone()))
                return attend(q, k, v, time_bias)
            return original(x, spy)
        return forward

    for layer, original in zip(layers, originals):
        layer.forward = wrap(layer, original)
    try:
        model.forward_reference(torch.tensor(items), torch.tensor(actions), torch.tensor(candidates))
    finally:
        for layer, original in zip(layers, originals):
            layer.forward = original
    return captured


@pytest.mark.parametrize("architecture,concat_ua", [("hstu", False), ("hstu", True), ("sasrec", False)])
def test_prefix_invariance(architecture, concat_ua):
    """A history token's K/V at every layer is unchanged when later events or candidates are added."""
    model = GRModel(ModelConfig(architecture=architecture, num_items=50, num_actions=4, d_model=16, num_heads=2,
                                head_dim=8, max_history_len=64, concat_ua=concat_ua))
    rng = np.random.default_rng(0)
    items, actions = rng.integers(0, 50, 40).tolist(), rng.integers(0, 4, 40).tolist()
    short = _capture_kv(model, items[:25], actions[:25], [])
    long = _capture_kv(model, items, actions, [3, 4, 5])
    assert len(short) == len(long) == model.config.num_layers
    for (k1, v1), (k2, v2) in zip(short, long):
        torch.testing.assert_close(k2[:25], k1, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v2[:25], v1, atol=1e-6, rtol=1e-6)
    # The positions really matter: shifting the history changes K/V (so the test can fail).
    shifted = _capture_kv(model, [0, *items[:24]], [0, *actions[:24]], [])
    assert not torch.allclose(shifted[-1][0][1:], short[-1][0][:24], atol=1e-3)


def _request(rng, rid, user, n, c):
    times = np.cumsum(rng.integers(0, 5000, n)) + 1_700_000_000
    return RankRequest(request_id=rid, user_id=user, item_ids=rng.integers(0, 200, n).tolist(),
                       action_ids=rng.integers(0, 8, n).tolist(), timestamps=times.tolist(),
                       candidate_item_ids=rng.integers(0, 200, c).tolist())


@pytest.mark.parametrize("architecture,time_buckets", [("hstu", 0), ("sasrec", 0), ("hstu", 16), ("sasrec", 16)])
def test_engine_recompute_matches_dense_oracle(architecture, time_buckets):
    engine = GREngine(tiny_config(mode="recompute", max_num_batched_tokens=40,  # forces chunked prefill
                                  architecture=architecture, time_bias_buckets=time_buckets))
    rng = np.random.default_rng(1)
    requests = [_request(rng, f"r{i}", i, n, c) for i, (n, c) in enumerate([(0, 3), (1, 1), (37, 12), (100, 5)])]
    outputs = engine.rank(requests, use_tqdm=False)
    for request, output in zip(requests, outputs):
        assert output.ok and output.timings.total > 0 and output.latency_s >= output.timings.total
        assert 0 < output.timings.intake < output.latency_s  # validation + hashing, the request's own
        expected, _ = engine.model.forward_reference(torch.tensor(request.item_ids, dtype=torch.long),
                                                     torch.tensor(request.action_ids, dtype=torch.long),
                                                     torch.tensor(request.candidate_item_ids),
                                                     torch.tensor(request.timestamps, dtype=torch.long))
        np.testing.assert_allclose(output.scores, expected.numpy(), atol=1e-5, rtol=0)
    assert engine.stats.phase_seconds["intake"] == pytest.approx(sum(o.timings.intake for o in outputs))


@pytest.mark.parametrize("mode", ["recompute", "gpu_only"])
def test_batch_invariance(mode):
    """A request's scores are the same alone and inside batches of any composition."""
    rng = np.random.default_rng(2)
    target = _request(rng, "target", "alice", 60, 7)
    alone = GREngine(tiny_config(mode=mode)).rank([target], use_tqdm=False)[0].scores
    for trial in range(4):
        mates = [_request(rng, f"m{trial}-{i}", f"bob{i}", int(rng.integers(0, 120)), int(rng.integers(1, 12)))
                 for i in range(int(rng.integers(1, 6)))]
        batch = [*mates[: len(mates) // 2], target, *mates[len(mates) // 2:]]
        engine = GREngine(tiny_config(mode=mode, max_num_seqs=8, max_num_batched_tokens=400))
        outputs = engine.rank(batch, use_tqdm=False)
        assert engine.stats.num_steps >= 1
        np.testing.assert_allclose(outputs[len(mates) // 2].scores, alone, atol=1e-5, rtol=0)


def test_time_bias_changes_scores():
    """The relative time bias is really applied: the same events at other times score differently."""
    config = tiny_config(mode="recompute", time_bias_buckets=16)
    rng = np.random.default_rng(4)
    request = _request(rng, "a", "u", 40, 5)
    shifted = msgspec.structs.replace(request, request_id="b",
                                      timestamps=(np.asarray(request.timestamps) * 3).tolist())
    engine = GREngine(config)
    a, b = engine.rank([request, shifted], use_tqdm=False)
    assert np.abs(np.asarray(a.scores) - np.asarray(b.scores)).max() > 1e-3
    plain = GREngine(tiny_config(mode="recompute")).rank([request, shifted], use_tqdm=False)
    np.testing.assert_allclose(plain[0].scores, plain[1].scores, atol=1e-6)


def test_save_load_roundtrip(tmp_path):
    config = tiny_config().model
    model = GRModel(config)
    path = tmp_path / "w.safetensors"
    model.save(path)
    other = GRModel(ModelConfig(**{**{f: getattr(config, f) for f in config.__struct_fields__}, "seed": 99}))
    assert not torch.equal(other.item_embedding.weight, model.item_embedding.weight)
    other.load(path)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name


def test_load_rejects_mismatched_weights(tmp_path):
    path = tmp_path / "w.safetensors"
    GRModel(tiny_config().model).save(path)
    bigger = ModelConfig(num_items=300, num_actions=8, d_model=16, num_heads=2, head_dim=8, max_history_len=256)
    with pytest.raises(ValueError, match="wrong shape"):
        GRModel(bigger).load(path)


def test_engine_loads_weights_from_config(tmp_path):
    path = tmp_path / "w.safetensors"
    config = tiny_config()
    trained = GRModel(ModelConfig(**{**{f: getattr(config.model, f) for f in config.model.__struct_fields__},
                                       "seed": 5}))
    trained.save(path)
    import msgspec
    engine = GREngine(msgspec.structs.replace(config, weights_path=str(path)))
    assert torch.equal(engine.model.item_embedding.weight, trained.item_embedding.weight)
