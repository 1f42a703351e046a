"""The engine on CUDA: streams, pinned host chunks, per-layer onload events and the onload fallbacks (skipped without
CUDA)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from gr_engine import GREngine
from tests.conftest import requires_cuda, tiny_config, with_cache
from tests.test_engine_differential import rank_launching_ahead, stream

pytestmark = [pytest.mark.gpu, requires_cuda]


def cuda_config(dtype: str, num_layers: int = 2, **cache):
    config = tiny_config(max_num_seqs=8, max_num_batched_tokens=256, host_chunks=cache.pop("host_chunks", 400),
                         d_model=64, num_heads=2, head_dim=32, dtype=dtype, num_layers=num_layers)
    return with_cache(msgspec.structs.replace(config, device="cuda"), **cache)


def scores(outputs):
    assert all(o.error is None for o in outputs), [o.error for o in outputs if o.error][:3]
    return [np.asarray(o.scores) for o in outputs]


def closed_loop_scores(engine, requests):
    """The scores of ``requests`` ranked in closed-loop batches of 8, as the benchmark serves them (each ``rank()``
    call prefetches, with prefetch)."""
    return scores([o for i in range(0, len(requests), 8) for o in engine.rank(requests[i:i + 8], use_tqdm=False)])


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("mode", ["gpu_only", "hierarchical", "unlimited"])
def test_cuda_pipeline_equals_recompute(mode, dtype, tol):
    config = cuda_config(dtype, mode=mode, num_gpu_pages=4000 if mode == "unlimited" else 200)
    requests = stream(config, num_users=30, visits=20, seed=5)
    expected = scores(GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False))
    engine = GREngine(config)
    if engine.kv.host is not None:
        engine.kv.host.store.wait_until_allocated()
    got = scores(engine.rank(requests, use_tqdm=False))
    worst = max(float(np.abs(a - b).max()) for a, b in zip(got, expected))
    assert worst <= tol, worst
    if mode == "hierarchical":
        assert engine.stats.host_hit_tokens > 0 and engine.kv.stats.offloaded_bytes > 0
    engine.close()
    engine.kv.check_invariants()


@pytest.mark.parametrize("mode,backend", [("gpu_only", "torch_ref"), ("hierarchical", "hstu_triton")])
def test_steps_launched_ahead_equal_recompute_on_cuda(mode, backend):
    """Async scheduling on the device: with up to 3 steps launched and unfinished (eager steps, or step graphs, with
    onloads and offloads in flight across them), each step's scores are copied before a later step overwrites the
    graphs' outputs and each step reads the pages its predecessors wrote: scores equal recompute."""
    config = tiny_config(mode=mode, num_gpu_pages=50, page_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                         host_chunks=400, d_model=64, num_heads=2, head_dim=32)
    config = msgspec.structs.replace(config, device="cuda", attention_backend=backend)
    requests = stream(config, num_users=20, visits=12, seed=21)
    expected = scores(GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False))
    engine = GREngine(config)
    if engine.kv.host is not None:
        engine.kv.host.store.wait_until_allocated()
    outputs, overlapped = rank_launching_ahead(engine, requests)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(scores(outputs), expected))
    assert worst <= 1e-4 and overlapped > 20, (worst, overlapped)
    assert all(step.device_s is not None and step.device_s > 0 for step in engine.stats.recent_steps)
    assert engine.kv.stats.evicted_users > 0
    if backend == "hstu_triton":
        assert engine.runner.graphs.num_replays > engine.stats.num_steps // 2
        assert engine.stats.host_hit_tokens > 0
    engine.close()
    engine.kv.check_invariants()


def test_cuda_host_pool_grows_in_background():
    config = cuda_config("float32", mode="hierarchical", num_gpu_pages=200, host_chunks=4000,
                         host_segment_bytes=2**20)
    engine = GREngine(config)
    store = engine.kv.host.store
    assert store.num_slots == 4000
    engine.rank(stream(config, 4, 2, seed=0), use_tqdm=False)  # usable before the pool is complete
    store.wait_until_allocated()
    assert store.num_allocated == 4000 and store.slot(3999).is_pinned()
    engine.close()


def test_onload_waits_per_layer_event():
    """Pages loaded from host are only read after their layer's event: results equal a synchronous copy."""
    config = cuda_config("float32", mode="hierarchical", num_gpu_pages=120)
    requests = stream(config, num_users=12, visits=8, seed=9)
    engine = GREngine(config)
    engine.kv.host.store.wait_until_allocated()
    outputs = engine.rank(requests, use_tqdm=False)
    reference = GREngine(with_cache(msgspec.structs.replace(config, device="cpu"), mode="recompute"))
    expected = scores(reference.rank(requests, use_tqdm=False))
    assert engine.stats.host_hit_tokens > 0
    assert max(float(np.abs(a - b).max()) for a, b in zip(scores(outputs), expected)) <= 1e-4
    torch.cuda.synchronize()


@pytest.mark.parametrize("host_dtype", ["kv", "float8_e4m3fn"])
def test_onload_fallbacks_score_exactly_as_the_staged_path(monkeypatch, host_dtype):
    """Onloads staged by batched DMA, then the onload kernel reading the staging buffer; and the fallbacks, which
    read the same bytes straight from pinned host memory and dequantise them the same way: a staging buffer smaller
    than most onloads, a driver without batched copies, a batched copy that fails (logged; host memory from then on).
    Every variant gives exactly the same scores. One variant holds every onload's copies back ~10 ms on the copy
    stream: a kernel that did not wait for its layer's copies would read what the staging buffer held before."""
    from cache_engine.batched_copy import BatchedCopier
    from cache_engine.dma_staging import DmaStaging

    copy, load, call = DmaStaging.copy, BatchedCopier.load, BatchedCopier._call

    def slow_copy(self, *args):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(20_000_000)  # before the copies' wait and the copies themselves
        return copy(self, *args)

    def failing_call(self, *args):
        raise RuntimeError("cuMemcpyBatchAsync failed with CUDA error 1 (a stand-in)")

    outputs = []
    # (copies held back, staging pages, driver without batched copies, failing driver calls)
    for slow, staging, no_batches, failing in ((False, 4096, False, False), (True, 4096, False, False),
                                               (False, 8, False, False), (False, 4096, True, False),
                                               (False, 4096, False, True)):
        monkeypatch.setattr(DmaStaging, "copy", slow_copy if slow else copy)
        monkeypatch.setattr(BatchedCopier, "load", classmethod(lambda cls, index: None) if no_batches else load)
        monkeypatch.setattr(BatchedCopier, "_call", call)
        engine = GREngine(cuda_config("bfloat16", 5, mode="hierarchical", num_gpu_pages=200, host_dtype=host_dtype,
                                      staging_pages=staging))
        engine.kv.host.store.wait_until_allocated()
        engine.kv.warm_transfers()  # (warm-up runs a batched copy: the failing driver's calls start after it)
        transfer = engine.kv.host.transfer
        assert (transfer._staging is None) == no_batches  # else a driver of CUDA 12.8 or later
        if not no_batches:
            assert transfer._staging.capacity == min(staging, 200)
        monkeypatch.setattr(BatchedCopier, "_call", failing_call if failing else call)
        outputs.append(closed_loop_scores(engine, stream(engine.config, num_users=30, visits=12, seed=7)))
        assert engine.kv.stats.onloaded_bytes > 0
        assert (transfer._staging is None) == (no_batches or failing)
        engine.close()
        engine.kv.check_invariants()
    for other in outputs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(outputs[0], other, strict=True))


@pytest.mark.parametrize("prefetch", [False, True])
def test_forward_graph_waits_for_slow_onloads(monkeypatch, prefetch):
    """With the forward replayed from per-layer graphs and every onload's copies held back ~10 ms on the device (the
    forward would read pages not loaded yet if a wait were missing): scores still equal those without the delay
    exactly. With ``prefetch``, served in closed-loop batches of 8, the onloads launched as requests arrive are the
    ones held back: the step's forward must wait for their events."""
    from cache_engine.dma_staging import DmaStaging

    config = tiny_config(mode="hierarchical", num_gpu_pages=50, page_size=16, max_num_seqs=8,
                         max_num_batched_tokens=256, host_chunks=400, d_model=64, num_heads=2, head_dim=32,
                         dtype="bfloat16")
    # hstu_triton (pages of 16 tokens): replayable, small steps run from graphs
    config = msgspec.structs.replace(config, device="cuda", attention_backend="hstu_triton")
    config = with_cache(config, prefetch=prefetch)
    requests = stream(config, num_users=20, visits=8, seed=7)

    def serve(engine):  # with prefetch, closed-loop batches of 8 (each rank() call prefetches); both engines alike
        engine.kv.host.store.wait_until_allocated()
        got = scores(engine.rank(requests, use_tqdm=False)) if not prefetch else closed_loop_scores(engine, requests)
        assert (engine.kv.stats.prefetched_tokens > 0) == prefetch and engine.stats.host_hit_tokens > 0
        engine.close()
        return got

    expected = serve(GREngine(config))
    copy = DmaStaging.copy

    def slow_copy(self, *args):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(20_000_000)  # on the copy stream, before the onload's copies
        return copy(self, *args)

    monkeypatch.setattr(DmaStaging, "copy", slow_copy)
    engine = GREngine(config)
    got = serve(engine)
    step_graphs = engine.runner.graphs
    assert step_graphs.enabled and any(not whole for _, _, whole, _ in step_graphs._graphs)  # per-layer graphs replayed
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("staged", [False, True])
def test_each_layer_event_covers_that_layers_onload(staged):
    """A stream that waits for layer ``l``'s event and reads that layer's pages at once sees the loaded pages,
    whether the onload kernel read a staging buffer filled by DMA first (``staged``) or host memory (a staging buffer
    of one page: every onload is larger): onloads of 2-100 MiB a layer over PCIe, read right after each wait, in
    rounds of several sizes."""
    from cache_engine import HostChunkStore, OnloadJob, TransferEngine

    layers, chunk_pages, page, heads, dim, num_chunks = 4, 32, 32, 4, 128, 48
    shape = (layers, chunk_pages, 2, page, heads, dim)
    store = HostChunkStore(num_chunks, shape, torch.bfloat16, num_chunks, pin=True)
    store.wait_until_allocated()
    gen = torch.Generator().manual_seed(4)
    for s in range(num_chunks):
        store.slot(s).copy_(torch.randn(shape, generator=gen).to(torch.bfloat16))
    kv = torch.zeros(layers, num_chunks * chunk_pages + 10, 2, page, heads, dim, dtype=torch.bfloat16, device="cuda")
    transfer = TransferEngine(torch.device("cuda"), staging_pages=4096 if staged else 1)
    compute = torch.cuda.current_stream()
    rng = np.random.default_rng(1)
    for chunks, pages_each in ((5, 7), (num_chunks, chunk_pages), (3, chunk_pages), (num_chunks, 9)):
        kv.zero_()
        order = rng.permutation(kv.shape[1])[: chunks * pages_each].reshape(chunks, pages_each)
        jobs = [OnloadJob(c, store.slot(c), order[c]) for c in range(chunks)]
        events = transfer.onload(kv, jobs)
        assert len(events) == layers and len({id(event) for event in events}) == layers
        dst = torch.from_numpy(order.ravel()).cuda()
        seen = []
        for layer, event in enumerate(events):
            compute.wait_event(event)
            seen.append(kv[layer, dst].clone())  # queued right after the wait
        torch.cuda.synchronize()
        for layer in range(layers):
            expected = torch.stack([store.slot(c)[layer, :pages_each] for c in range(chunks)]).flatten(0, 1)
            assert torch.equal(seen[layer].cpu(), expected), (chunks, pages_each, layer)
    assert transfer._staging is not None  # a driver of CUDA 12.8 or later; used only where the onload fits


def test_transfer_kernels_index_buffers_are_not_rewritten_while_queued():
    """The transfer kernels read their indices from pinned buffers reused in turn (rings of four): with the device
    held busy, a run of onloads and of offloads queued back to back, each with different pages and slots, all land
    where their own indices say."""
    from cache_engine import HostChunkStore, OffloadJob, OnloadJob, TransferEngine

    layers, chunk_pages, page, heads, dim, rounds = 2, 4, 8, 2, 64, 7
    shape = (layers, chunk_pages, 2, page, heads, dim)
    store = HostChunkStore(4 * rounds, shape, torch.bfloat16, 4 * rounds, pin=True)
    store.wait_until_allocated()
    gen = torch.Generator().manual_seed(5)
    for s in range(2 * rounds):
        store.slot(s).copy_(torch.randn(shape, generator=gen).to(torch.bfloat16))
    kv = torch.zeros(layers, 4 * rounds * chunk_pages, 2, page, heads, dim, dtype=torch.bfloat16, device="cuda")
    transfer = TransferEngine(torch.device("cuda"))
    order = np.random.default_rng(2).permutation(2 * rounds * chunk_pages).reshape(rounds, 2, chunk_pages)
    for _ in range(2):  # compile before the stalls
        transfer.onload(kv, [OnloadJob(0, store.slot(0), order[0, 0])])
    offloaded = 2 * rounds * chunk_pages + np.arange(2 * rounds * chunk_pages).reshape(rounds, 2, chunk_pages)
    fresh = torch.randn(layers, offloaded.size, 2, page, heads, dim, generator=gen).to(kv)
    fresh_pages = torch.from_numpy(offloaded.ravel()).cuda()
    torch.cuda.synchronize()
    kv.zero_()
    torch.cuda._sleep(200_000_000)  # the offloads below queue behind this
    kv.index_copy_(1, fresh_pages, fresh)
    handles = [transfer.offload(kv, [OffloadJob(offloaded[r, c], 2 * rounds + 2 * r + c,
                                                store.slot(2 * rounds + 2 * r + c), chunk_pages * page)
                                     for c in range(2)])
               for r in range(rounds)]
    torch.cuda._sleep(200_000_000)  # and the onloads behind this
    for r in range(rounds):
        transfer.onload(kv, [OnloadJob(2 * r + c, store.slot(2 * r + c), order[r, c]) for c in range(2)])
    torch.cuda.synchronize()
    assert all(done.query() for done in handles)
    for r in range(rounds):
        for c in range(2):
            assert torch.equal(kv[:, order[r, c]].cpu(), store.slot(2 * r + c)), ("onload", r, c)
            assert torch.equal(store.slot(2 * rounds + 2 * r + c), kv[:, offloaded[r, c]].cpu()), ("offload", r, c)


def test_stream_fence_orders_a_side_stream_after_the_work_queued_so_far():
    """A fenced side stream sees the compute stream's earlier writes, and re-recording the kept event for a later
    fence does not make the first waiter wait for the later work."""
    from cache_engine.streams import StreamFence

    fence, compute = StreamFence(), torch.cuda.current_stream()
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(50_000_000)
    x.fill_(1)
    fence(side, compute)
    with torch.cuda.stream(side):
        y = x.clone()
    torch.cuda._sleep(400_000_000)  # later compute work, fenced for another stream only
    fence(other, compute)
    side.synchronize()
    assert not compute.query()  # the side stream finished while the later work still runs
    assert y.eq(1).all()
    torch.cuda.synchronize()


def test_on_stream_switches_and_restores_the_current_stream():
    """Work inside ``on_stream`` is queued on that stream; the previous stream is current again afterwards, also
    after an exception. :class:`CurrentStream` names the current stream as torch does, inside and outside."""
    from cache_engine.streams import CurrentStream, indexed, on_stream

    device = indexed(torch.device("cuda"))
    assert device.index == torch.cuda.current_device()
    current = CurrentStream(device)
    before, side = current(), torch.cuda.Stream(device)
    assert before == torch.cuda.current_stream(device)
    x = torch.zeros(1 << 20, device=device)
    with on_stream(side, before):
        assert torch.cuda.current_stream(device) == side and current() == side
        torch.cuda._sleep(50_000_000)
        x.add_(1)
    assert torch.cuda.current_stream(device) == before and current() == before
    assert not side.query()  # the work went to the side stream, still busy sleeping
    side.synchronize()
    assert x.eq(1).all()
    with torch.cuda.stream(side):  # switched by torch: seen too
        assert current() == side
    with pytest.raises(RuntimeError, match="inside"), on_stream(side, before):
        raise RuntimeError("inside")
    assert torch.cuda.current_stream(device) == before


def test_quick_benchmark_runs_its_engines_one_after_another_on_cuda():
    """``gr-engine bench``'s whole sequence at a tiny scale on the GPU: every mode, then the chunk-size and budget
    sweeps' engines built and closed one after another over one pinned host arena (kernel transfers, CUDA graphs,
    the fastest backend), the length scan and the score drift. A transfer still running on memory an engine gave
    back would surface here as a CUDA error in a later engine."""
    import dataclasses

    from gr_engine.bench.experiments import run_benchmark
    from gr_engine.bench.runner import quick_settings

    settings = dataclasses.replace(quick_settings(), device="cuda", backend="auto", page_size=16, chunk_tokens=64,
                                   gpu_pages=24, chunk_sweep=(32, 128), budget_sweep=(16, 32))
    result = run_benchmark(settings, echo=lambda line: None)
    torch.cuda.synchronize()
    assert result["modes"]["hierarchical"]["batch_sizes"][8]["total_hit_ratio"] > 0.5
    assert all(e["onloaded_bytes_per_batch"] > 0 for e in result["chunk_sweep"]["hierarchical"].values())
    assert result["score_drift"]["kv"]["requests_from_host"] > 0
    assert result["score_drift"]["kv"]["max_abs"] < 1e-3  # float32 host chunks: only kernel rounding differs


@pytest.mark.parametrize("graph_rows", [0, 4096])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_recompute_dense_read_scores_exactly_as_the_paged_read_on_cuda(dtype, graph_rows):
    """A ``recompute`` engine on ``hstu_triton`` runs its self-contained steps (every step here: no history is cut
    into chunks) without the append, reading keys by TMA from the step's rows, eagerly and from step graphs; with the
    dense read off it appends and reads the pages. The same sums in the same order: equal scores."""
    config = tiny_config(mode="recompute", num_gpu_pages=400, page_size=16, max_num_seqs=8,
                         max_num_batched_tokens=4096, d_model=64, num_heads=2, head_dim=32, dtype=dtype)
    config = msgspec.structs.replace(config, device="cuda", attention_backend="hstu_triton",
                                     cuda_graph_max_rows=graph_rows)
    requests = stream(config, num_users=20, visits=4, seed=8)
    paged = GREngine(config)
    paged.runner.own_rows = False
    expected = scores(paged.rank(requests, use_tqdm=False))
    engine = GREngine(config)
    assert engine.runner.own_rows
    got = scores(engine.rank(requests, use_tqdm=False))
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("graph_rows", [0, 4096])
@pytest.mark.parametrize("mode", ["gpu_only", "hierarchical"])
def test_caching_engines_own_rows_read_scores_exactly_as_the_paged_read_on_cuda(mode, graph_rows):
    """A caching engine on ``hstu_triton`` reads its uncached steps' keys (first visits, users evicted from both
    tiers) from the step's rows and still appends them; its graphs hold both forwards. A small pool forces
    evictions (and, in ``hierarchical``, host onloads), so later visits read the pages the own-rows steps wrote.
    Against the same engine with the own-rows read off: the same sums in the same order, equal scores."""
    config = tiny_config(mode=mode, num_gpu_pages=60, page_size=16, max_num_seqs=8, max_num_batched_tokens=1024,
                         host_chunks=400, d_model=64, num_heads=2, head_dim=32, dtype="bfloat16")
    config = msgspec.structs.replace(config, device="cuda", attention_backend="hstu_triton",
                                     cuda_graph_max_rows=graph_rows)
    requests = stream(config, num_users=20, visits=6, seed=12)
    results = []
    for own_rows in (False, True):
        engine = GREngine(config)
        assert engine.runner.own_rows
        engine.runner.own_rows = own_rows
        if engine.kv.host is not None:
            engine.kv.host.store.wait_until_allocated()
        results.append(closed_loop_scores(engine, requests))
        assert engine.kv.stats.evicted_users > 0
        engine.kv.check_invariants()
    assert all(np.array_equal(a, b) for a, b in zip(*results))
