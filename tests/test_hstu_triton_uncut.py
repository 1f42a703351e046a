"""``hstu_triton``'s device plan of large uncut eager steps (:mod:`attention_backends.hstu_triton_uncut`): decided from
``[B]``-sized host arrays exactly when :func:`plan_tile_map` plans uncut, it writes exactly ``plan_tile_map``'s arrays
(spare slots included), so the attention output is the host plan's bit for bit; compiled once, by warm-up.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` set below before anything imports Triton).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_step(rng: np.random.Generator, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host ``query_start_loc``, ``num_history_rows``, ``kv_seq_lens`` of a step: kind 0 long histories and many new
    rows, 1 short ones, 2 a few rows over long histories, 3 recompute-like (nothing cached; some candidates only)."""
    b = int(rng.integers(1, 12))
    cached = rng.integers(0, [20_000, 300, 20_000, 1][kind], b)
    hist = rng.integers(0, [3_000, 400, 3, 6_000][kind], b)
    cand = rng.integers(0, [101, 20, 12, 101][kind], b)
    if kind == 3:
        hist[rng.random(b) < 0.3] = 0
    return np.concatenate([[0], np.cumsum(hist + cand)]), hist, cached + hist


def int32_common(qsl: np.ndarray, hist: np.ndarray, seq_lens: np.ndarray) -> SimpleNamespace:
    """The fields the device plan reads, as int32 device tensors."""
    to = {"dtype": torch.int32, "device": DEVICE}
    return SimpleNamespace(query_start_loc=torch.tensor(qsl, **to), num_history_rows=torch.tensor(hist, **to),
                           kv_seq_lens=torch.tensor(seq_lens, **to), num_requests=len(hist))


@pytest.mark.parametrize("seed", range(3))
def test_uncut_decision_and_device_plan_equal_plan_tile_maps(seed, monkeypatch):
    """For random steps, tile shapes, head and processor counts: :func:`uncut_sizes` says uncut exactly when
    ``plan_tile_map`` takes its large-step branch (costs no cut), and the device writes its arrays exactly."""
    import attention_backends.hstu_triton_plan as plan
    from attention_backends.hstu_triton_uncut import UncutPlanWriter

    costed = []
    cheapest_cut = plan._cheapest_cut
    monkeypatch.setattr(plan, "_cheapest_cut", lambda *args: costed.append(1) or cheapest_cut(*args))
    rng, uncut = np.random.default_rng(seed), 0
    for trial in range(48):
        qsl, hist, seq_lens = random_step(rng, trial % 4)
        tiles = plan.TileConfig(int(rng.choice([16, 32, 64, 128])), int(rng.choice([16, 32, 64, 128])), 4, 1)
        heads, num_sms, min_tiles = int(rng.choice([1, 2, 4, 8])), int(rng.choice([1, 4, 16, 132])), int(
            rng.choice([1, 4]))
        costed.clear()
        expected = plan.plan_tile_map(qsl, hist, seq_lens, tiles, heads, num_sms, 640, min_tiles)
        sizes = plan.uncut_sizes(qsl, hist, seq_lens, tiles, heads, num_sms, min_tiles)
        assert (sizes is not None) == (not costed and expected[0].shape[1] > 0), (trial, sizes)
        if sizes is None:
            continue
        uncut += 1
        assert sizes == (expected[0].shape[1], expected[1].shape[1])
        got = UncutPlanWriter().write(int32_common(qsl, hist, seq_lens), tiles, *sizes).cpu().numpy()
        assert np.array_equal(got, np.concatenate([expected[0].ravel(), expected[1].ravel()])), trial
    assert uncut >= 20  # most draws are large


def test_one_request_and_spare_slots():
    """Edge plans: one tile; more item slots than tiles (spare items after the used ones, no spare tile); spare
    tiles and items; a candidates-only request without history (a tile visiting no key tile); requests without rows
    between others."""
    from attention_backends.hstu_triton_plan import TileConfig, plan_tile_map, uncut_sizes
    from attention_backends.hstu_triton_uncut import UncutPlanWriter

    tiles = TileConfig(16, 16, 4, 1)
    for rows, hist, seq_lens, heads, num_sms in (([9], [1], [400], 16, 4), ([100], [100], [2100], 2, 4),
                                                 ([40, 3, 0, 70], [40, 0, 0, 60], [900, 0, 0, 60], 16, 4),
                                                 ([200, 0, 5], [150, 0, 0], [150, 0, 80], 2, 4)):
        qsl = np.concatenate([[0], np.cumsum(rows)])
        sizes = uncut_sizes(qsl, hist, seq_lens, tiles, heads, num_sms, 1)
        assert sizes is not None
        expected = plan_tile_map(qsl, hist, seq_lens, tiles, heads, num_sms, 640, 1)
        got = UncutPlanWriter().write(int32_common(qsl, np.array(hist), np.array(seq_lens)), tiles, *sizes)
        assert np.array_equal(got.cpu().numpy(), np.concatenate([expected[0].ravel(), expected[1].ravel()]))


def test_build_metadata_plans_large_steps_on_the_device_with_the_host_plans_output(monkeypatch):
    """A large step's metadata is planned without ``plan_tile_map`` (the host builds no per-tile array) and attends
    to exactly the host plan's output, bit for bit, and to the torch reference's within rounding."""
    import attention_backends.hstu_triton as hstu_triton
    from attention_backends.hstu_triton import HSTUTritonMetadata
    from attention_backends.hstu_triton_plan import TileConfig, plan_tile_map
    from tests.test_hstu_triton import assert_close, make_backend, make_batch, make_spec, run_both

    layout = [(0, 300, 5), (200, 150, 3), (1000, 40, 0), (0, 0, 4)]  # (cached, new history rows, candidates)
    spec, tiles, gen = make_spec(16, 2, 16, torch.float32), TileConfig(16, 16, 4, 1), torch.Generator().manual_seed(0)
    common, q, k, v, cache = make_batch(layout, spec, gen)
    backend = make_backend(spec, tiles)
    backend.num_sms = 4  # the CPU's grid: on a GPU's 132 SMs this step is too small to be planned uncut
    host_plan = plan_tile_map(*(common.host[n] for n in ("query_start_loc", "num_history_rows", "kv_seq_lens")),
                              tiles, spec.num_heads, backend.num_sms, backend.overhead_keys,
                              backend.min_tiles_per_split)

    def never(*args):
        raise AssertionError("a large step was planned on the host")

    monkeypatch.setattr(hstu_triton, "plan_tile_map", never)
    meta = backend.build_metadata(common)
    assert np.array_equal(meta.tiles.cpu().numpy(), host_plan[0]) and np.array_equal(meta.items.cpu().numpy(),
                                                                                     host_plan[1])
    on_host = HSTUTritonMetadata(common, *(torch.from_numpy(a).to(DEVICE) for a in host_plan), meta.processors,
                                 meta.may_split, meta.config)
    cache = cache.nan_to_num(0.0)
    backend.append_kv(cache, k, v, meta)
    assert torch.equal(backend.attend(q, k, v, cache, meta), backend.attend(q, k, v, cache, on_host))
    monkeypatch.undo()
    got, expected, scale = run_both(layout, spec, torch.Generator().manual_seed(0), tiles)  # the same batch
    assert_close(got, expected, scale, 1e-4)


def test_host_overhead_probe_launches_no_plan():
    """The probe's stand-in allocates the plan and launches nothing (its layers never attend)."""
    spec = importlib.util.spec_from_file_location(
        "host_overhead", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "host_overhead.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    from attention_backends.hstu_triton_plan import TileConfig

    common = int32_common(np.array([0, 5000]), np.array([5000]), np.array([5000]))
    plan = probe.HostOnlyUncutPlan().write(common, TileConfig(64, 32, 4, 1), 79, 79)
    assert plan.shape == (7 * 79,) and plan.dtype == torch.int32


# --- on the GPU ---------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
def test_gpu_large_step_equals_host_plan_bit_for_bit_and_the_reference():
    """A recompute-sized bf16 step (8 requests of 2-6k new rows, H200's processor count): device-planned attention is
    the host plan's bit for bit, and the torch reference's within bf16 rounding; one kernel, no host-to-device copy."""
    from attention_backends.hstu_triton import HSTUTritonMetadata
    from attention_backends.hstu_triton_plan import plan_tile_map
    from tests.test_hstu_triton import assert_close, cuda_activity, make_backend, make_batch, make_spec, run_both

    rng = np.random.default_rng(0)
    layout = [(0, int(rng.integers(2000, 6000)), 100) for _ in range(8)]
    spec, gen = make_spec(32, 4, 128, torch.bfloat16), torch.Generator().manual_seed(1)
    common, q, k, v, cache = make_batch(layout, spec, gen)
    backend = make_backend(spec)
    backend.build_metadata(common)  # compiled before it is profiled
    meta, names = cuda_activity(lambda: backend.build_metadata(common))
    assert len(names) == 1 and "uncut_plan" in names[0], names
    host = plan_tile_map(*(common.host[n] for n in ("query_start_loc", "num_history_rows", "kv_seq_lens")),
                         meta.config, spec.num_heads, backend.num_sms, backend.overhead_keys,
                         backend.min_tiles_per_split)
    assert np.array_equal(meta.tiles.cpu().numpy(), host[0]) and np.array_equal(meta.items.cpu().numpy(), host[1])
    on_host = HSTUTritonMetadata(common, *(torch.from_numpy(a).cuda() for a in host), meta.processors, meta.may_split,
                                 meta.config)
    cache = cache.nan_to_num(0.0)
    backend.append_kv(cache, k, v, meta)
    assert torch.equal(backend.attend(q, k, v, cache, meta), backend.attend(q, k, v, cache, on_host))
    got, expected, scale = run_both(layout, spec, torch.Generator().manual_seed(1))
    assert_close(got, expected, scale, 1.5e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_steps_of_any_size_share_one_compiled_plan_kernel():
    from attention_backends.hstu_triton_plan import TileConfig, uncut_sizes
    from attention_backends.hstu_triton_uncut import UncutPlanWriter, _uncut_plan_kernel

    def compiled() -> int:
        return sum(len(c[0]) for c in _uncut_plan_kernel.device_caches.values())

    rng, before, variants = np.random.default_rng(2), compiled(), []
    for trial in range(12):
        qsl, hist, seq_lens = random_step(rng, trial % 2 * 3)
        tiles = TileConfig(int(rng.choice([16, 64, 128])), int(rng.choice([32, 128])), 4, 1)
        sizes = uncut_sizes(qsl, hist, seq_lens, tiles, 4, 132)
        if sizes is not None:
            UncutPlanWriter().write(int32_common(qsl, hist, seq_lens), tiles, *sizes)
            variants.append(compiled() - before)
    torch.cuda.synchronize()
    assert len(variants) >= 3 and variants[-1] <= 1, variants


def warm_child() -> None:
    """A recompute engine whose steps (8 users of 3-3.5k events) are planned uncut: print its stall counts after
    warm-up and after serving, and how many plans its writer made in each, as JSON."""
    import msgspec

    from attention_backends.hstu_triton_uncut import UncutPlanWriter
    from gr_engine import GREngine
    from gr_engine.synthetic import synthetic_requests
    from tests.conftest import tiny_config, with_cache

    class Counting(UncutPlanWriter):
        count = 0

        def write(self, *args):
            self.count += 1
            return super().write(*args)

    config = tiny_config(page_size=16, max_num_seqs=8, max_num_batched_tokens=32768, num_gpu_pages=4096,
                         d_model=128, num_heads=8, head_dim=16, dtype="bfloat16", max_history_len=4096,
                         max_candidates=100)
    config = with_cache(msgspec.structs.replace(config, device="cuda", cuda_graph_max_rows=1024,
                                                attention_backend="hstu_triton"), mode="recompute")
    engine = GREngine(config)
    engine.backend.uncut_plan = writer = Counting()
    engine.warmup(use_tqdm=False)
    before, warm_plans = engine.stalls(), writer.count
    requests = synthetic_requests(config.model, 8, 2, first_history=(3000, 3500), new_events=(1, 8),
                                  num_candidates=(100, 100), seed=5)
    for start in range(0, len(requests), 8):
        outputs = engine.rank(requests[start:start + 8], use_tqdm=False)
        assert all(o.error is None for o in outputs)
    engine.close()
    print(json.dumps({"before": before.kernel_compilations, "after": engine.stalls().kernel_compilations,
                      "warm_plans": warm_plans, "served_plans": writer.count - warm_plans}))


@pytest.mark.gpu
@needs_cuda
def test_gpu_warmup_compiles_the_uncut_plan_kernel(tmp_path):
    """In a fresh process with an empty Triton cache, warm-up plans a step uncut (so compiles the kernel) and
    serving steps planned uncut compile nothing."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    code = "from tests.test_hstu_triton_uncut import warm_child; warm_child()"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert counts["warm_plans"] >= 1 and counts["served_plans"] >= 2, counts
    assert counts["after"] == counts["before"], counts
