"""Steps replayed from CUDA graphs (:mod:`gr_engine.step_graphs`) score exactly like eager steps.

On CPU the staged, padded step runs eagerly through ``hstu_triton`` in Triton's interpreter (``TRITON_INTERPRET=1``
is set below before anything imports its kernels, as in ``test_hstu_triton``), so padding and staging are tested in
CI; on CUDA the graphs themselves are captured and replayed.
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

from gr_engine import GREngine
from gr_engine.step_graphs import StepGraphs, bucket_rows, synthetic_step
from tests.conftest import requires_cuda, tiny_config, with_cache
from tests.test_engine_differential import max_diff, stream

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    import attention_backends.hstu_triton as hstu_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: hstu_triton runs on CUDA, or on CPU in Triton's interpreter.
needs_hstu_triton = pytest.mark.skipif(
    not HAS_TRITON or not (torch.cuda.is_available() or hstu_triton.INTERPRETED),
    reason="needs triton, and CUDA or triton imported after TRITON_INTERPRET=1")
needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not HAS_TRITON or not hstu_triton.INTERPRETED,
    reason="CPU interpreter test (needs triton imported after TRITON_INTERPRET=1)")


def graph_engine(config, max_rows: int) -> GREngine:
    """An hstu_triton engine whose small steps go through :class:`StepGraphs` (on CPU: forced on)."""
    config = msgspec.structs.replace(config, attention_backend="hstu_triton", cuda_graph_max_rows=max_rows)
    engine = GREngine(config)
    if engine.runner.graphs is None:
        engine.runner.graphs = StepGraphs(engine.backend, engine.device, config.cache.page_size, max_rows,
                                          config.scheduler.max_num_seqs, config.cache.num_gpu_pages)
    return engine


@needs_interpreter
@pytest.mark.parametrize("mode,pages,plan_on_device", [
    pytest.param("gpu_only", 45, True, marks=pytest.mark.slow), ("hierarchical", 45, True),
    pytest.param("unlimited", 500, True, marks=pytest.mark.slow), ("hierarchical", 45, False)])
def test_staged_steps_equal_recompute_on_cpu(mode, pages, plan_on_device):
    """Staged steps (the tile plan written on the device, or uploaded from the host) against recompute."""
    config = tiny_config(mode=mode, num_gpu_pages=pages, page_size=16, max_num_seqs=3, max_num_batched_tokens=96,
                         head_dim=16, chunk_pages=2, host_chunks=200)
    requests = stream(config, num_users=8, visits=5, seed=11)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    engine = graph_engine(config, max_rows=64)
    engine.backend.plan_on_device = plan_on_device
    got = engine.rank(requests, use_tqdm=False)
    assert all((pinned is None) == plan_on_device for _, pinned, _ in engine.runner.graphs._plans.values())
    assert max_diff(got, expected) <= 1e-4
    graphs = engine.runner.graphs
    assert 0 < graphs.num_replays < engine.stats.num_steps  # both paths ran: staged steps and eager ones
    assert (engine.kv.stats.evicted_users > 0) == (mode != "unlimited")
    assert engine.stats.gpu_hit_tokens > 0 and (engine.stats.host_hit_tokens > 0) == (mode == "hierarchical")
    engine.kv.check_invariants()


@needs_interpreter
@pytest.mark.slow
def test_unpadded_fallback_equals_recompute_on_cpu(monkeypatch):
    """The path a step takes after a failed capture (its real size, the backend's host-planned eager metadata, no
    device plan) scores like recompute; on CPU it stands in for every replay here."""
    config = tiny_config(mode="hierarchical", num_gpu_pages=45, page_size=16, max_num_seqs=3,
                         max_num_batched_tokens=96, head_dim=16, chunk_pages=2, host_chunks=200)
    requests = stream(config, num_users=8, visits=5, seed=3)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    engine = graph_engine(config, max_rows=64)

    def no_device_plan(*args):
        raise AssertionError("the fallback must not write a device plan")

    monkeypatch.setattr(engine.backend, "write_device_plan", no_device_plan)
    monkeypatch.setattr(StepGraphs, "_run_eagerly", StepGraphs._run_unpadded)
    got = engine.rank(requests, use_tqdm=False)
    assert max_diff(got, expected) <= 1e-4 and all(out.error is None for out in got)
    assert engine.runner.graphs.num_replays > 0


@needs_interpreter
def test_staged_retrieval_steps_equal_recompute_on_cpu():
    """``generate`` through staged steps: the heads read the last history row of the replayed states."""
    from gr_engine import GenerateParams

    config = tiny_config(mode="gpu_only", num_gpu_pages=300, page_size=16, max_num_seqs=3, max_num_batched_tokens=96,
                         head_dim=16)
    requests = [r for r in stream(config, num_users=6, visits=4, seed=4) if len(r.item_ids) > 0]
    params = GenerateParams(top_k=5)
    expected = GREngine(with_cache(config, mode="recompute")).generate(requests, params, use_tqdm=False)
    engine = graph_engine(config, max_rows=64)
    got = engine.generate(requests, params, use_tqdm=False)
    for out, ref in zip(got, expected, strict=True):
        assert out.error is None and out.item_ids == ref.item_ids
        np.testing.assert_allclose(out.scores, ref.scores, atol=1e-4, rtol=0)
    assert engine.runner.graphs.num_replays > 0


def test_fits_bounds():
    config = tiny_config()
    engine = GREngine(config)
    graphs = StepGraphs(engine.backend, engine.device, 4, max_rows=64, max_requests=4, max_pages=100)
    assert graphs.buckets == [64]
    assert graphs.fits(64, 4, 1, 100)
    assert not graphs.fits(65, 4, 1, 100) and not graphs.fits(64, 5, 1, 100)
    assert not graphs.fits(64, 4, 0, 100)  # candidates only: nothing to append, runs eagerly
    assert not graphs.fits(64, 4, 1, 101)
    assert StepGraphs(engine.backend, engine.device, 4, 1000, 4, 10).buckets == [128, 256, 512, 1000]
    assert not StepGraphs.supported(engine.backend)  # torch_ref: eager only


def test_bucket_rows_are_fine_above_4096():
    """Powers of two to 4,096 rows, then 16 buckets a doubling: a long step is padded by at most 1/16 of its rows."""
    assert bucket_rows(4096) == [128, 256, 512, 1024, 2048, 4096]
    assert bucket_rows(5000) == [128, 256, 512, 1024, 2048, 4096, 4352, 4608, 4864, 5000]
    buckets = bucket_rows(16384)
    assert buckets[5:] == list(range(4096, 8192, 256)) + list(range(8192, 16385, 512))
    for rows in range(4097, 16385, 37):
        bucket = next(b for b in buckets if b >= rows)
        assert bucket - rows < rows / 16


@needs_hstu_triton
def test_hstu_triton_is_replayable():
    config = tiny_config(page_size=16, num_heads=2, head_dim=16)
    engine = GREngine(msgspec.structs.replace(config, attention_backend="hstu_triton", device=DEVICE))
    assert StepGraphs.supported(engine.backend)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("mode", ["gpu_only", "hierarchical", "unlimited"])
def test_cuda_graph_replays_equal_recompute_and_eager(mode, dtype, tol):
    config = tiny_config(mode=mode, num_gpu_pages=1000 if mode == "unlimited" else 50, page_size=16, max_num_seqs=8,
                         max_num_batched_tokens=256, host_chunks=400, d_model=64, num_heads=2, head_dim=32,
                         dtype=dtype)
    config = msgspec.structs.replace(config, device="cuda")
    requests = stream(config, num_users=20, visits=12, seed=5)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    eager = GREngine(msgspec.structs.replace(config, attention_backend="hstu_triton", cuda_graph_max_rows=0))
    eager_out = eager.rank(requests, use_tqdm=False)
    engine = graph_engine(config, max_rows=256)
    if engine.kv.host is not None:
        engine.kv.host.store.wait_until_allocated()
    got = engine.rank(requests, use_tqdm=False)
    assert max_diff(got, expected) <= tol
    assert max_diff(got, eager_out) <= tol / 10
    graphs = engine.runner.graphs
    assert graphs.num_graphs > 0 and graphs.num_replays > engine.stats.num_steps // 2
    engine.close()
    engine.kv.check_invariants()
    np.testing.assert_equal(eager.runner.graphs, None)


@pytest.mark.gpu
@requires_cuda
def test_failed_capture_falls_back_to_eager_without_failing_requests(monkeypatch, caplog):
    config = tiny_config(mode="gpu_only", num_gpu_pages=200, page_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                         d_model=64, num_heads=2, head_dim=32)
    config = msgspec.structs.replace(config, device="cuda")
    requests = stream(config, num_users=10, visits=6, seed=2)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)

    def broken(*args):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(StepGraphs, "_capture", broken)
    engine = graph_engine(config, max_rows=256)
    engine.backend.write_device_plan = broken  # the fallback must not need the device plan either
    got = engine.rank(requests, use_tqdm=False)
    assert max_diff(got, expected) <= 1e-4  # every request served, none failed
    assert not engine.runner.graphs.enabled and engine.runner.graphs.num_graphs == 0
    assert "CUDA graph capture failed" in caplog.text


def random_step(rng: np.random.Generator, max_requests: int, largest: bool) -> tuple[dict, dict, dict, np.ndarray]:
    """A random step of at most ``max_requests`` requests over a pool of 200 pages of 16 tokens (``largest``: all
    requests, over 256 rows): ``(layout, tokens, layout_arrays' fields, token positions)``."""
    from attention_backends.base import layout_arrays

    b = max_requests if largest else int(rng.integers(1, max_requests + 1))
    start, hist, cand = rng.integers(0, 160, b), rng.integers(0, 6, b), rng.integers(0, 61, b)
    if not hist.any():  # a staged step has a new history row somewhere (any request may have none)
        hist[rng.integers(b)] = 1
    cand[rng.random(b) < 0.3] = 0
    if largest:
        cand[:] = 280 // b
    pages = -(-(start + hist) // 16)
    indptr = np.concatenate([[0], np.cumsum(pages)])
    kv_indices = rng.permutation(200)[: indptr[-1]]
    arrays = layout_arrays(start, hist, cand, indptr, kv_indices, 16)
    rows = int(arrays["query_start_loc"][-1])
    tokens = {name: rng.integers(0, 1000, rows) for name in ("item_ids", "action_ids")}
    positions = np.empty(rows, dtype=np.int64)  # history rows at their event, candidates one past the last
    positions[arrays["history_rows"]] = arrays["append_positions"]
    positions[arrays["candidate_rows"]] = arrays["kv_seq_lens"][arrays["candidate_batch_indices"]]
    layout = {"history_start": start, "num_history_rows": hist, "num_candidate_rows": cand, "kv_indptr": indptr,
              "kv_indices": kv_indices}
    return layout, tokens, arrays, positions


def staging_graphs(max_requests: int) -> StepGraphs:
    config = tiny_config(page_size=16, num_heads=2, head_dim=16)
    engine = GREngine(msgspec.structs.replace(config, attention_backend="hstu_triton", device=DEVICE))
    return StepGraphs(engine.backend, engine.device, 16, max_rows=300, max_requests=max_requests, max_pages=200)


@needs_hstu_triton
@pytest.mark.parametrize("max_requests", [4, 1])
def test_staging_and_expansion_write_every_field_and_pad_inertly(max_requests):
    """Steps of many shapes and buckets, in a random order (each over whatever the previous one left), are staged in
    compact form and expanded on the device (:meth:`StepGraphs._expand`, the replay's first work): every field, the
    token positions and the page ids read back at their real length equal the host's layout
    (:func:`~attention_backends.base.layout_arrays`), and the bucket-padded views a graph reads repeat the last append
    row and the last offsets, with zeros elsewhere."""
    from gr_engine.step_expand import FIELDS
    from gr_engine.step_graphs import TOKEN_FIELDS

    repeated = ("append_batch_indices", "append_positions", "append_pages", "append_entries", "history_rows",
                "query_start_loc", "kv_indptr")
    graphs = staging_graphs(max_requests)
    rng = np.random.default_rng(max_requests)
    buckets = set()
    for step in range(90):
        layout, tokens, arrays, positions = random_step(rng, max_requests, largest=step % 10 == 9)
        staged = graphs.stage(layout, tokens)
        graphs._expand(staged.bucket)
        tokens["positions"] = positions
        buckets.add(staged.bucket)
        real_tokens, real = graphs.step_inputs(staged)
        for name, values in arrays.items():
            assert np.array_equal(getattr(real, name).cpu().numpy(), values), name
        for name, values in tokens.items():
            assert np.array_equal(real_tokens[name].cpu().numpy(), values), name
        static, common, _ = graphs._static_inputs(staged)
        for name in FIELDS:
            view = (static[name] if name in TOKEN_FIELDS else getattr(common, name)).cpu().numpy()
            values = tokens[name] if name in TOKEN_FIELDS else arrays[name]
            assert np.array_equal(view[:len(values)], values), name
            spare = view[len(values):]
            if name in repeated:
                assert (spare == values[-1]).all(), name
            else:
                assert not spare.any(), name
        assert np.array_equal(common.kv_indices.cpu().numpy()[:layout["kv_indptr"][-1]], arrays["kv_indices"])
    assert {128, 300} <= buckets  # the smallest bucket and the largest (not a power of two)


@pytest.mark.gpu
@requires_cuda
def test_graph_replays_wait_for_a_slow_device_plan():
    """The device-written tile plan runs on a side stream beside the first layer's embedding and projection: every
    attention must wait for it. Here each plan is queued behind ~1 ms of sleep on that stream (captured into the
    graphs too), so an attention that did not wait would read the plan of an earlier step: scores must still equal
    recompute's."""
    config = tiny_config(mode="gpu_only", num_gpu_pages=200, page_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                         d_model=64, num_heads=2, head_dim=32, dtype="float32")
    config = msgspec.structs.replace(config, device="cuda")
    requests = stream(config, num_users=12, visits=8, seed=11)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    engine = graph_engine(config, max_rows=256)
    write, calls = engine.backend.write_device_plan, []

    def slow_write(key, common, plan):
        calls.append(key)
        torch.cuda._sleep(2_000_000)  # ~1 ms on the plan's stream before it is written
        write(key, common, plan)

    engine.backend.write_device_plan = slow_write  # graph_plan binds the instance's method for new keys
    got = engine.rank(requests, use_tqdm=False)
    assert max_diff(got, expected) <= 1e-4
    assert calls and engine.runner.graphs.num_replays > engine.stats.num_steps // 2
    engine.close()


@pytest.mark.gpu
@requires_cuda
def test_staging_waits_until_the_last_expansion_has_read_the_compact_step():
    """The compact step lives in one pinned buffer that the device reads when the expansion runs: staging the next
    step while the device is still busy (here 0.1 s of sleep queued first) must wait for that read, so each expansion
    sees its own step."""
    graphs = staging_graphs(4)
    rng = np.random.default_rng(7)
    first, second = random_step(rng, 4, largest=False), random_step(rng, 4, largest=False)
    torch.cuda._sleep(200_000_000)  # ~0.1 s ahead of the first expansion
    staged = graphs.stage(first[0], first[1])
    graphs._expand(staged.bucket)
    seen_first = graphs.step_inputs(staged)[1].append_positions.clone()  # queued: copied when the device gets here
    staged = graphs.stage(second[0], second[1])
    graphs._expand(staged.bucket)
    seen_second = graphs.step_inputs(staged)[1].append_positions
    assert np.array_equal(seen_first.cpu().numpy(), first[2]["append_positions"])
    assert np.array_equal(seen_second.cpu().numpy(), second[2]["append_positions"])


@needs_hstu_triton
def test_graph_plan_keys_do_not_depend_on_the_steps_planned_before():
    """``hstu_triton``'s ``graph_plan`` remembers device-planned keys by the longest request's rows and by tile
    config: in any order, each step gets the key a fresh backend gives it, and steps of one key share one writer."""
    from attention_backends import AttentionSpec
    from attention_backends.hstu_triton import HSTUTritonBackend

    spec = AttentionSpec(kind="hstu", num_heads=2, head_dim=16, page_size=16, dtype=torch.float32, device_type=DEVICE,
                         alpha=0.25, scaling_seqlen=100)
    backend, writers = HSTUTritonBackend(spec), {}
    for longest in np.random.default_rng(0).permutation(np.repeat(np.arange(1, 70), 2)).tolist():
        rows = np.array([longest, 1])
        host = {"query_start_loc": np.concatenate([[0], np.cumsum(rows)]), "num_history_rows": rows,
                "num_candidate_rows": np.zeros(2, dtype=np.int64), "kv_indptr": np.array([0, 3, 4]),
                "kv_seq_lens": rows + 20}
        key, writer = backend.graph_plan(host, 256, 4)
        assert key == HSTUTritonBackend(spec).graph_plan(host, 256, 4)[0], longest
        assert writers.setdefault(key, writer) is writer
    assert len(writers) >= 3  # decode-like tiles of 16 and 32 rows, and the default


def _record_replayed_keys(graphs: StepGraphs) -> set:
    """Wrap ``graphs.replay`` to collect each replayed step's (bucket, launch shape, forward variant)."""
    keys, replay = set(), graphs.replay

    def recording(step, *args):
        keys.add((step.bucket, step.plan_key, step.variant))
        return replay(step, *args)

    graphs.replay = recording
    return keys


@needs_interpreter
def test_warmup_covers_every_shape_served_and_writes_only_free_pages():
    """``engine.warmup()`` between calls: cached users' pages are left as they were (only free pages are written),
    their scores still equal recompute afterwards, and every (bucket, launch shape) the stream's staged steps then
    use was among those warmed up (the probes of the longest request's rows find every launch shape)."""
    config = tiny_config(mode="hierarchical", num_gpu_pages=60, page_size=16, max_num_seqs=3,
                         max_num_batched_tokens=96, head_dim=16, chunk_pages=2, host_chunks=200)
    requests = stream(config, num_users=8, visits=5, seed=4)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    engine = graph_engine(config, max_rows=64)
    got = engine.rank(requests[:10], use_tqdm=False)
    held = np.concatenate([r.page_buffer[:r.num_pages] for r in engine.kv.users.values()])
    before = engine.kv.kv_cache[:, held].clone()
    warmed = _record_replayed_keys(engine.runner.graphs)
    assert engine.warmup(use_tqdm=False) == len(warmed) >= 2  # float32 tiles: a decode-like shape and the default
    assert torch.equal(engine.kv.kv_cache[:, held], before)
    assert engine.kv.pool.num_free == 60 - len(held)  # the pages it borrowed are free again
    served = _record_replayed_keys(engine.runner.graphs)
    got += engine.rank(requests[10:], use_tqdm=False)
    assert max_diff(got, expected) <= 1e-4
    assert served and served <= warmed
    engine.kv.check_invariants()


@needs_hstu_triton
def test_warmup_covers_one_request_in_a_bucket_between_powers_of_two():
    """An engine of one request a step: its steps above 4,096 rows land in buckets between powers of two, which
    requests of 1, 2, 4, ... rows cannot fill; warm-up must still stage (so capture) each of them as one request."""
    config = tiny_config(mode="recompute", num_gpu_pages=320, page_size=16, max_num_seqs=1,
                         max_num_batched_tokens=5000, head_dim=16)
    engine = graph_engine(config, max_rows=4608)
    graphs = engine.runner.graphs
    assert graphs.buckets[-3:] == [4096, 4352, 4608]
    warmed = set()
    graphs.replay = lambda step, *args: warmed.add((step.bucket, step.plan_key, step.variant))  # staging only
    pages = np.arange(320, dtype=np.int32)
    assert engine.runner.capture_graphs(pages, use_tqdm=False) == len(warmed)
    assert {bucket for bucket, _, _ in warmed} == set(graphs.buckets)
    for rows in (4100, 4400, 4608):  # one visit of that many uncached rows, as the scheduler would stage it
        layout, tokens = synthetic_step(rows, rows, pages, config.cache.page_size)
        staged = graphs.stage(layout, tokens, engine.runner.own_rows)  # an uncached, self-contained step
        assert (staged.bucket, staged.plan_key, staged.variant) in warmed


@pytest.mark.gpu
@requires_cuda
def test_warmed_up_engine_captures_nothing_while_serving():
    """After ``warmup()`` a stream of every kind of step (host onloads included: per-layer graphs) captures no
    graph, and scores exactly as an engine that captures as steps arrive."""
    config = tiny_config(mode="hierarchical", num_gpu_pages=50, page_size=16, max_num_seqs=8,
                         max_num_batched_tokens=256, host_chunks=400, d_model=64, num_heads=2, head_dim=32,
                         dtype="bfloat16")
    config = msgspec.structs.replace(config, device="cuda")
    requests = stream(config, num_users=20, visits=12, seed=8)
    outputs = []
    for warm in (False, True):
        engine = graph_engine(config, max_rows=256)
        engine.kv.host.store.wait_until_allocated()
        captured = engine.warmup(use_tqdm=False) if warm else 0
        graphs = engine.runner.graphs.num_graphs
        assert (graphs >= 2 * captured > 0) == warm  # each key: a whole-forward graph and a per-layer one
        outputs.append(engine.rank(requests, use_tqdm=False))
        assert engine.stats.host_hit_tokens > 0
        if warm:
            assert engine.runner.graphs.num_graphs == graphs, "a graph was captured while serving"
        engine.close()
    assert max_diff(outputs[1], outputs[0]) == 0


@pytest.mark.parametrize("mode", ["hierarchical", "gpu_only"])
def test_warmup_without_step_graphs_runs_eager_steps_on_free_pages_only(mode):
    """On CPU (no step graphs) ``warmup()`` between calls captures nothing, runs its eager steps (and the host
    tier's transfers) on free pages only: cached users' pages, the free list and later scores are as without it."""
    config = tiny_config(mode=mode, num_gpu_pages=120, page_size=16, max_num_seqs=3, max_num_batched_tokens=96,
                         chunk_pages=2, host_chunks=200)
    requests = stream(config, num_users=8, visits=4, seed=9)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    engine = GREngine(config)
    got = engine.rank(requests[:12], use_tqdm=False)
    held = np.concatenate([r.page_buffer[:r.num_pages] for r in engine.kv.users.values()])
    before, free = engine.kv.kv_cache[:, held].clone(), engine.kv.pool.free_page_ids()
    calls = []
    original = engine.runner.forward
    engine.runner.forward = lambda *args: calls.append(1) or original(*args)
    assert engine.warmup(use_tqdm=False) == 0
    assert len(calls) >= 10  # 1..512 rows, over no and a long cached history
    assert torch.equal(engine.kv.kv_cache[:, held], before) and engine.kv.pool.free_page_ids() == free
    assert engine.stalls().kernel_compilations == engine.stalls().graph_captures == 0  # nothing compiles on CPU
    got += engine.rank(requests[12:], use_tqdm=False)
    assert max_diff(got, expected) <= 1e-5
    engine.kv.check_invariants()
