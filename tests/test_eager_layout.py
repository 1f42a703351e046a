"""Eager steps laid out on the device (:mod:`gr_engine.eager_layout`): the expansion writes exactly the host's layout,
and an engine whose eager steps take this path scores like recompute.

On CPU the expansion kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` set below before anything imports
Triton, as in ``test_step_graphs``); the engine test forces the path on (CUDA engines take it on their own).
"""

from __future__ import annotations

import importlib.util
import os

import msgspec
import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from attention_backends import PagedBatchMetadata
from gr_engine import GREngine
from tests.conftest import requires_cuda, tiny_config, with_cache
from tests.test_engine_differential import max_diff, stream

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU interpreter test (needs triton imported after TRITON_INTERPRET=1)")


def random_step(rng: np.random.Generator, max_requests: int, page_size: int) -> tuple[dict, list, list, tuple]:
    """A random step (requests with and without new history rows or candidates; a fifth have none at all) over a pool
    of 300 pages: ``(layout, item parts, action parts, (query, key) timestamps)``."""
    b = int(rng.integers(1, max_requests + 1))
    start, hist, cand = rng.integers(0, 160, b), rng.integers(0, 40, b), rng.integers(0, 30, b)
    if rng.random() < 0.2:
        hist[:] = 0  # candidates only: nothing appended
    cand[rng.random(b) < 0.3] = 0
    cand[hist + cand == 0] = 1  # every request has a row
    pages = -(-(start + hist) // page_size)
    indptr = np.concatenate([[0], np.cumsum(pages)])
    layout = {"history_start": start, "num_history_rows": hist, "num_candidate_rows": cand, "kv_indptr": indptr,
              "kv_indices": rng.permutation(300)[: indptr[-1]]}
    rows = int((hist + cand).sum())
    items, actions = rng.integers(0, 1000, rows), rng.integers(0, 10, rows)
    cut = int(rng.integers(0, rows + 1))  # tokens in two parts, as strip passes them (one per request and kind)
    times = (rng.integers(0, 2**40, rows), rng.integers(0, 2**40, int((start + hist).sum())))
    return layout, [items[:cut], items[cut:]], [actions], times


@needs_triton
@pytest.mark.parametrize("max_requests", [5, 1])
def test_expanded_layout_equals_the_hosts(max_requests):
    """Every index field, the tokens and their positions, the maxima, the per-request host arrays and the timestamps
    of :meth:`DeviceLayout.build` equal :meth:`PagedBatchMetadata.from_layout`'s (and the host's positions), for steps
    of every size, one expansion kernel for all."""
    from gr_engine.eager_layout import DeviceLayout

    layout_on_device, rng = DeviceLayout(torch.device(DEVICE), 16, max_requests), np.random.default_rng(max_requests)
    for _ in range(40):
        layout, items, actions, times = random_step(rng, max_requests, 16)
        tokens, common = layout_on_device.build(layout, items, actions, times)
        expected = PagedBatchMetadata.from_layout(*layout.values(), 16, "cpu", *times)
        host = expected.host
        for name, values in host.items():
            assert np.array_equal(getattr(common, name).cpu().numpy(), values), name
        positions = np.empty(len(actions[0]), dtype=np.int64)
        positions[host["history_rows"]] = host["append_positions"]
        positions[host["candidate_rows"]] = host["kv_seq_lens"][host["candidate_batch_indices"]]
        assert np.array_equal(tokens["positions"].cpu().numpy(), positions)
        assert np.array_equal(tokens["item_ids"].cpu().numpy(), np.concatenate(items))
        assert np.array_equal(tokens["action_ids"].cpu().numpy(), actions[0])
        assert all(tokens[name].dtype == torch.int32 for name in tokens)
        for name in ("max_query_len", "max_kv_len", "max_pages", "page_size"):
            assert getattr(common, name) == getattr(expected, name), name
        assert set(common.host) == {"query_start_loc", "num_history_rows", "num_candidate_rows", "kv_indptr",
                                    "kv_seq_lens"}
        assert all(np.array_equal(common.host[name], host[name]) for name in common.host)
        for name in ("query", "keys", "key_start"):
            assert torch.equal(getattr(common.timestamps, name).cpu(), getattr(expected.timestamps, name)), name


@needs_triton
def test_more_requests_than_the_layout_holds_are_refused():
    from gr_engine.eager_layout import DeviceLayout

    layout, items, actions, _ = random_step(np.random.default_rng(0), 1, 16)
    layout = {name: np.concatenate([values, values[-1:] if name == "kv_indptr" else values])
              if name != "kv_indices" else values for name, values in layout.items()}
    with pytest.raises(ValueError, match="holds 1"):
        DeviceLayout(torch.device(DEVICE), 16, 1).build(layout, items, actions, (None, None))


def layout_engine(config) -> GREngine:
    """An hstu_triton engine whose eager steps are laid out on the device (forced on CPU) and no step graphs."""
    from gr_engine.eager_layout import DeviceLayout

    config = msgspec.structs.replace(config, attention_backend="hstu_triton", device=DEVICE, cuda_graph_max_rows=0)
    engine = GREngine(config)
    if engine.runner.layout is None:
        engine.runner.layout = DeviceLayout(engine.device, config.cache.page_size, config.scheduler.max_num_seqs)
    return engine


@needs_interpreter
@pytest.mark.parametrize("mode", ["recompute", "hierarchical"])
def test_engine_with_eager_steps_laid_out_on_the_device_equals_recompute_on_cpu(mode):
    """Every step eager and laid out on the device (chunked histories, candidates-only visits, evictions and
    onloads) scores like torch_ref's recompute; each step's metadata came from the device layout."""
    config = tiny_config(mode=mode, num_gpu_pages=45, page_size=16, max_num_seqs=3, max_num_batched_tokens=96,
                         head_dim=16, chunk_pages=2, host_chunks=200)
    requests = stream(config, num_users=6, visits=4, seed=5)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    engine = layout_engine(config)
    built, build = [], engine.runner.layout.build
    engine.runner.layout.build = lambda *args: built.append(1) or build(*args)
    got = engine.rank(requests, use_tqdm=False)
    assert max_diff(got, expected) <= 1e-4
    assert len(built) == engine.stats.num_steps > 0
    engine.kv.check_invariants()


@pytest.mark.gpu
@requires_cuda
def test_gpu_eager_steps_laid_out_on_the_device_score_as_laid_out_on_the_host():
    """On CUDA an hstu_triton engine lays eager steps out on the device; its scores equal, bit for bit, those of the
    same engine laying them out on the host (the same metadata, so the same kernels), large steps included."""
    config = tiny_config(mode="gpu_only", num_gpu_pages=400, page_size=16, max_num_seqs=8,
                         max_num_batched_tokens=4096, d_model=64, num_heads=2, head_dim=32, dtype="bfloat16",
                         max_history_len=4096, max_candidates=100)
    requests = stream(config, num_users=12, visits=4, seed=6)
    on_device, on_host = layout_engine(config), layout_engine(config)
    assert on_device.runner.layout is not None
    on_host.runner.layout = None
    assert max_diff(on_device.rank(requests, use_tqdm=False), on_host.rank(requests, use_tqdm=False)) == 0
