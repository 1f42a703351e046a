"""The engine on CUDA: streams, pinned host chunks and per-layer onload events (skipped without CUDA)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from gr_engine import GREngine
from tests.conftest import requires_cuda, tiny_config, with_cache
from tests.test_engine_differential import stream

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


@pytest.mark.parametrize("host_dtype,quantise_bytes", [("kv", 2**30), ("float8_e4m3fn", 2**30),
                                                        ("float8_e4m3fn", 1)])
def test_kernel_onload_engine_equals_copy_engine(monkeypatch, host_dtype, quantise_bytes):
    """The transfer kernels (offloads packed and quantised by one kernel, onloads read from host pages), launched
    eagerly or replayed from CUDA graphs, with or without users loaded as their requests arrive (``prefetch``), give
    exactly the copy engine's scores: the same quantisation and dequantisation (also when the copy engine quantises
    one chunk at a time: ``quantise_bytes`` 1)."""
    monkeypatch.setattr("cache_engine.transfer._QUANTISE_BYTES", quantise_bytes)
    config = cuda_config("bfloat16", mode="hierarchical", num_gpu_pages=200, host_dtype=host_dtype)
    requests = stream(config, num_users=30, visits=20, seed=6)
    outputs = {}
    # name: (onload engine, graphs, prefetch). FP8 host chunks are lossy: a policy that changes which users' KV
    # comes from host changes scores, so each variant is compared with the copy engine under the same policy.
    variants = {"copy": ("copy", False, False), "kernel": ("kernel", False, False),
                "kernel_graphs": ("kernel", True, False), "copy_prefetch": ("copy", False, True),
                "kernel_prefetch": ("kernel", False, True), "kernel_graphs_prefetch": ("kernel", True, True)}
    for name, (engine_name, graphs, prefetch) in variants.items():
        engine = GREngine(with_cache(config, onload_engine=engine_name, onload_graphs=graphs, prefetch=prefetch))
        engine.kv.host.store.wait_until_allocated()
        outputs[name] = closed_loop_scores(engine, requests)
        assert engine.stats.host_hit_tokens > 0
        assert (engine.kv.stats.prefetched_tokens > 0) == prefetch
        captured = engine.kv.host.transfer._graphs
        assert (captured is not None and captured.enabled and len(captured._graphs) > 0) == graphs
        engine.close()
        engine.kv.check_invariants()
    for name, baseline in (("kernel", "copy"), ("kernel_graphs", "copy"), ("kernel_prefetch", "copy_prefetch"),
                           ("kernel_graphs_prefetch", "copy_prefetch")):
        assert all(np.array_equal(a, b) for a, b in zip(outputs[name], outputs[baseline])), name


@pytest.mark.parametrize("prefetch", [False, True])
def test_forward_graph_waits_for_slow_onloads(monkeypatch, prefetch):
    """With onloads replayed from graphs and the forward from per-layer graphs, every onload held back ~10 ms on the
    device (the forward would read pages not loaded yet if a wait were missing): scores still equal the copy engine's
    exactly. With ``prefetch``, served in closed-loop batches of 8, the onloads launched as requests arrive are the
    ones held back: the step's forward must wait for their events."""
    from cache_engine.onload_graphs import OnloadGraphs

    config = tiny_config(mode="hierarchical", num_gpu_pages=50, page_size=16, max_num_seqs=8,
                         max_num_batched_tokens=256, host_chunks=400, d_model=64, num_heads=2, head_dim=32,
                         dtype="bfloat16")
    # hstu_triton (pages of 16 tokens): replayable, small steps run from graphs
    config = msgspec.structs.replace(config, device="cuda", attention_backend="hstu_triton")
    requests = stream(config, num_users=20, visits=8, seed=7)

    def serve(engine):  # with prefetch, closed-loop batches of 8 (each rank() call prefetches); both engines alike
        # (the copy engine prefetches too: a prefetch may change what a step admits)
        if not prefetch:
            return scores(engine.rank(requests, use_tqdm=False))
        return closed_loop_scores(engine, requests)

    expected_engine = GREngine(with_cache(config, onload_engine="copy", prefetch=prefetch))
    expected_engine.kv.host.store.wait_until_allocated()
    expected = serve(expected_engine)
    expected_engine.close()
    replay = OnloadGraphs.replay

    def slow_replay(self, *args):
        torch.cuda._sleep(20_000_000)  # on the scatter stream, before the onload kernels
        return replay(self, *args)

    monkeypatch.setattr(OnloadGraphs, "replay", slow_replay)
    engine = GREngine(with_cache(config, onload_engine="kernel", onload_graphs=True, prefetch=prefetch))
    engine.kv.host.store.wait_until_allocated()
    got = serve(engine)
    assert (engine.kv.stats.prefetched_tokens > 0) == prefetch
    assert engine.stats.host_hit_tokens > 0
    step_graphs = engine.runner.graphs
    assert step_graphs.enabled and any(not whole for _, _, whole in step_graphs._graphs)  # per-layer graphs replayed
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    engine.close()


@pytest.mark.parametrize("prefetch", [False, True])
def test_onload_first_equals_recompute_with_slow_copies_to_host(monkeypatch, prefetch):
    """``onload_first`` with every copy to host held back ~10 ms on the device before its gather: an onload or a
    forward that skipped waiting for a copy still reading its pages would overwrite what the copy reads, and the
    user's next visit from host would score differently. Served in closed-loop batches of 8 (each call prefetches);
    the onloads went first while copies were pending at least once."""
    from cache_engine.host_tier import HostTier
    from cache_engine.offload_kernel import ChunkPacker

    config = cuda_config("float32", mode="hierarchical", num_gpu_pages=200, onload_first=True, prefetch=prefetch)
    requests = stream(config, num_users=30, visits=20, seed=5)
    expected = scores(GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False))
    pack, must_wait, went_first = ChunkPacker.__call__, HostTier.writes_must_wait, []

    def slow_pack(self, *args, **kwargs):
        torch.cuda._sleep(20_000_000)  # on the offload stream, before the gather
        return pack(self, *args, **kwargs)

    def recording(self, pages):
        wait = must_wait(self, pages)
        went_first.append(not wait and bool(self._gathers or self._batch))
        return wait

    monkeypatch.setattr(ChunkPacker, "__call__", slow_pack)
    monkeypatch.setattr(HostTier, "writes_must_wait", recording)
    engine = GREngine(config)
    engine.kv.host.store.wait_until_allocated()
    got = closed_loop_scores(engine, requests)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(got, expected, strict=True))
    assert worst <= 1e-4, worst
    assert engine.stats.host_hit_tokens > 0 and any(went_first)
    engine.close()
    engine.kv.check_invariants()


@pytest.mark.parametrize("group_bytes", [0, 2**24])
@pytest.mark.parametrize("dma", [False, True])
@pytest.mark.parametrize("graphs", [False, True])
def test_each_layer_event_covers_that_layers_onload(graphs, dma, group_bytes):
    """A stream that waits for layer ``l``'s event and reads that layer's pages at once sees the loaded pages,
    whether the onload was launched eagerly or replayed from a graph (whose external event nodes record the
    events), reading host memory or (``dma``) a staging buffer filled by DMA first, one layer or (eager onloads with
    ``group_bytes``) as many layers as fit in 16 MiB per launch and driver call: onloads of 2-100 MiB a layer over
    PCIe (groups of 4, 1, 2 and 1 layers), read right after each wait, in rounds of several capacities."""
    from cache_engine import HostChunkStore, OnloadJob, TransferEngine

    layers, chunk_pages, page, heads, dim, num_chunks = 4, 32, 32, 4, 128, 48
    shape = (layers, chunk_pages, 2, page, heads, dim)
    store = HostChunkStore(num_chunks, shape, torch.bfloat16, num_chunks, pin=True)
    store.wait_until_allocated()
    gen = torch.Generator().manual_seed(4)
    for s in range(num_chunks):
        store.slot(s).copy_(torch.randn(shape, generator=gen).to(torch.bfloat16))
    kv = torch.zeros(layers, num_chunks * chunk_pages + 10, 2, page, heads, dim, dtype=torch.bfloat16, device="cuda")
    transfer = TransferEngine(torch.device("cuda"), kernels=True, graphs=graphs, dma=dma, dma_graphs=dma,
                              group_bytes=group_bytes)
    assert transfer.dma == dma  # a driver of CUDA 12.8 or later
    compute = torch.cuda.current_stream()
    rng = np.random.default_rng(1)
    for chunks, pages_each in ((5, 7), (num_chunks, chunk_pages), (3, chunk_pages), (num_chunks, 9)):
        kv.zero_()
        order = rng.permutation(kv.shape[1])[: chunks * pages_each].reshape(chunks, pages_each)
        jobs = [OnloadJob(c, store.slot(c), order[c]) for c in range(chunks)]
        events = transfer.onload(kv, jobs)
        group = 1 if graphs or not group_bytes else max(1, min(layers, group_bytes // (chunks * pages_each * 2**16)))
        assert len(events) == layers and len({id(event) for event in events}) == -(-layers // group)
        dst = torch.from_numpy(order.ravel()).cuda()
        seen = []
        for layer, event in enumerate(events):
            compute.wait_event(event)
            seen.append(kv[layer, dst].clone())  # queued right after the wait
        torch.cuda.synchronize()
        for layer in range(layers):
            expected = torch.stack([store.slot(c)[layer, :pages_each] for c in range(chunks)]).flatten(0, 1)
            assert torch.equal(seen[layer].cpu(), expected), (chunks, pages_each, layer)
    assert (transfer._graphs is not None and len(transfer._graphs._graphs) >= 2) == graphs


@pytest.mark.parametrize("graphs", [False, True])
def test_transfer_kernels_index_buffers_are_not_rewritten_while_queued(graphs):
    """The transfer kernels read their indices from pinned buffers reused in turn: with the device held busy, a
    run of onloads (graphs alternate two buffers, eager launches a ring of four) and of kernel offloads (a ring of
    four) queued back to back, each with different pages and slots, all land where their own indices say."""
    from cache_engine import HostChunkStore, OffloadJob, OnloadJob, TransferEngine

    layers, chunk_pages, page, heads, dim, rounds = 2, 4, 8, 2, 64, 7
    shape = (layers, chunk_pages, 2, page, heads, dim)
    store = HostChunkStore(4 * rounds, shape, torch.bfloat16, 4 * rounds, pin=True)
    store.wait_until_allocated()
    gen = torch.Generator().manual_seed(5)
    for s in range(2 * rounds):
        store.slot(s).copy_(torch.randn(shape, generator=gen).to(torch.bfloat16))
    kv = torch.zeros(layers, 4 * rounds * chunk_pages, 2, page, heads, dim, dtype=torch.bfloat16, device="cuda")
    transfer = TransferEngine(torch.device("cuda"), kernels=True, graphs=graphs)
    order = np.random.default_rng(2).permutation(2 * rounds * chunk_pages).reshape(rounds, 2, chunk_pages)
    for _ in range(2):  # compile, and capture both graphs, before the stalls
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
    assert all(h.copy_done() for h in handles)
    for r in range(rounds):
        for c in range(2):
            assert torch.equal(kv[:, order[r, c]].cpu(), store.slot(2 * r + c)), ("onload", r, c)
            assert torch.equal(store.slot(2 * rounds + 2 * r + c), kv[:, offloaded[r, c]].cpu()), ("offload", r, c)


def test_index_uploads_never_rewrite_a_pinned_buffer_whose_copy_is_queued():
    """Uploads stage through torch's caching host allocator and drop the staging tensor at once; while the stream
    is busy (copies still queued) its memory must not be handed to the next upload, so every upload arrives
    intact, and so do later ones that reuse the freed blocks."""
    from cache_engine.transfer import TransferEngine

    transfer = TransferEngine(torch.device("cuda"))
    rng = np.random.default_rng(0)
    expected = [rng.integers(0, 2**40, n) for n in (5, 3000, 17, 1, 9000, 64, 2, 100, 5000, 7, 11, 13, 4000, 3)]
    torch.cuda._sleep(100_000_000)  # the copies below queue behind this
    got = [transfer._upload(values) for values in expected]
    torch.cuda.synchronize()
    assert all(np.array_equal(g.cpu().numpy(), e) for g, e in zip(got, expected, strict=True))
    again = [transfer._upload(values) for values in expected[:3]]  # freed blocks, now reusable
    assert all(np.array_equal(g.cpu().numpy(), e) for g, e in zip(again, expected[:3], strict=True))


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



def test_onloads_confined_to_a_few_multiprocessors_score_the_same():
    """``cache.onload_sms``: the onload kernels run on a green context's stream (where this torch and driver have
    green contexts) and every score equals that of an engine with the onloads on an ordinary stream."""
    from torch.cuda.green_contexts import SUPPORTED

    outputs = []
    for sms in (0, 16):
        engine = GREngine(cuda_config("bfloat16", mode="hierarchical", num_gpu_pages=200, onload_sms=sms))
        engine.kv.host.store.wait_until_allocated()
        transfer = engine.kv.host.transfer
        assert (transfer._confined is not None) == (sms > 0 and SUPPORTED)
        outputs.append(closed_loop_scores(engine, stream(engine.config, num_users=30, visits=12, seed=4)))
        assert engine.kv.stats.onloaded_bytes > 0
        engine.close()
        engine.kv.check_invariants()
    assert all(np.array_equal(a, b) for a, b in zip(*outputs, strict=True))


def test_batched_copies_score_exactly_as_copies_one_chunk_at_a_time():
    """The copy engine issues each layer's copies in one ``cuMemcpyBatchAsync`` call where the driver has it (the
    H200 machine's does): scores equal those of the same engine copying one chunk at a time (FP8 host chunks)."""
    outputs = []
    for batched in (True, False):
        engine = GREngine(cuda_config("bfloat16", mode="hierarchical", num_gpu_pages=200, onload_engine="copy",
                                      host_dtype="float8_e4m3fn"))
        engine.kv.host.store.wait_until_allocated()
        transfer = engine.kv.host.transfer
        assert transfer._copier is not None  # a driver of CUDA 12.8 or later
        if not batched:
            transfer._copier = None
        outputs.append(closed_loop_scores(engine, stream(engine.config, num_users=30, visits=12, seed=5)))
        assert engine.kv.stats.onloaded_bytes > 0
        engine.close()
        engine.kv.check_invariants()
    assert all(np.array_equal(a, b) for a, b in zip(*outputs, strict=True))


@pytest.mark.parametrize("host_dtype", ["kv", "float8_e4m3fn"])
def test_dma_onload_engine_equals_kernel_engine(monkeypatch, host_dtype):
    """``onload_engine="dma"``: host pages copied into a staging buffer by batched DMA, then the onload kernel reads
    the buffer (offloads as ``kernel``), launched eagerly or replayed from CUDA graphs (``dma_graphs``), one layer
    or a group of layers per launch and copy call (``onload_layer_group``): exactly the ``kernel`` engine's scores,
    which read the same bytes straight from host memory and dequantise them the same way. Some variants run with
    every onload's copies held back ~10 ms on the copy stream: a kernel that did not wait (inside its graph, or
    eagerly) for its group's copies would read what the staging buffer held before."""
    from cache_engine.dma_staging import DmaStaging
    from cache_engine.onload_kernel import OnloadLauncher

    copy = DmaStaging.copy

    def slow_copy(self, *args):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(20_000_000)  # before the copies' wait and the copies themselves
        return copy(self, *args)

    launch_all_layers, groups = OnloadLauncher.all_layers, []

    def all_layers(self, *args, group=1, **kwargs):
        groups.append(group)
        return launch_all_layers(self, *args, group=group, **kwargs)

    monkeypatch.setattr(OnloadLauncher, "all_layers", all_layers)
    outputs = []
    # (engine, dma_graphs, copies held back, staging pages: 8 is fewer than most onloads, which then read host memory,
    # bytes of host pages per onload group)
    for engine_name, graphs, slow, staging, group in (
            ("kernel", True, False, 4096, 0), ("dma", False, False, 4096, 0), ("dma", True, True, 4096, 0),
            ("dma", False, False, 8, 0), ("dma", False, True, 4096, 2**15), ("dma", False, True, 4096, 2**30),
            ("kernel", False, False, 4096, 2**15)):  # 5 layers; groups of 1 to 5 layers by the onload's size
        monkeypatch.setattr(DmaStaging, "copy", slow_copy if slow else copy)
        engine = GREngine(cuda_config("bfloat16", 5, mode="hierarchical", num_gpu_pages=200,
                                      onload_engine=engine_name, dma_graphs=graphs, host_dtype=host_dtype,
                                      staging_pages=staging, onload_group_bytes=group,
                                      onload_graphs=graphs or engine_name == "dma"))
        engine.kv.host.store.wait_until_allocated()
        transfer = engine.kv.host.transfer
        assert transfer.dma == (engine_name == "dma")  # a driver of CUDA 12.8 or later
        captured = engine.kv.warm_transfers()  # every capacity up to the pool's 200 pages (256), for each turn
        assert captured == (2 if graphs else 0)
        if transfer.dma:
            assert transfer._staging.capacity == min(staging, 200)
        groups.clear()
        outputs.append(closed_loop_scores(engine, stream(engine.config, num_users=30, visits=12, seed=7)))
        assert engine.kv.stats.onloaded_bytes > 0
        # (graph replays launch nothing eagerly: the graphs' variants may record no launch here)
        assert (max(groups, default=1) > 1) == (group > 0) and (set(groups) == {5}) == (group == 2**30), groups
        replayed = transfer._graphs is not None and transfer._graphs.enabled and len(transfer._graphs._graphs) > 0
        assert replayed == graphs
        engine.close()
        engine.kv.check_invariants()
    for other in outputs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(outputs[0], other, strict=True))
