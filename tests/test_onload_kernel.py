"""The onload kernel (:mod:`cache_engine.onload_kernel`) against plain indexing: host pages of any layer into
pool pages, with and without FP8 dequantisation. CPU runs it in Triton's interpreter (``TRITON_INTERPRET=1``
is set before the module imports Triton, as in ``test_hstu_triton``); CUDA reads pinned host memory."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def host_slots(num_slots: int, layers: int, chunk_pages: int, page: int, heads: int, dim: int, dtype, gen):
    """Host chunk slots ``[slots, L, chunk_pages, 2, page, H, D]`` (pinned on CUDA) and their fp32 values."""
    values = torch.randn(num_slots, layers, chunk_pages, 2, page, heads, dim, generator=gen)
    slots = values.to(dtype)
    return (slots.pin_memory() if DEVICE == "cuda" else slots), values


def random_picks(slots: torch.Tensor, count: int, gen) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]:
    """``count`` distinct random (slot, page within the chunk) of ``slots`` (as :func:`host_slots`), the host address
    of each one's first layer and its slot id (both int64 on the device)."""
    num_slots, chunk_pages = slots.shape[0], slots.shape[2]
    picks = [(int(f) // chunk_pages, int(f) % chunk_pages)
             for f in torch.randperm(num_slots * chunk_pages, generator=gen)[:count]]
    addr = torch.tensor([slots[s, 0, p].data_ptr() for s, p in picks], device=DEVICE)
    return picks, addr, torch.tensor([s for s, _ in picks], device=DEVICE)


def expected_page(slots: torch.Tensor, scales: torch.Tensor | None, slot: int, page: int) -> torch.Tensor:
    """Page ``page`` of slot ``slot`` over every layer, ``[L, 2, page, H, D]`` float32, dequantised with ``scales``
    (``[slots, L, 2, H]``) if given."""
    expected = slots[slot, :, page].float()
    return expected if scales is None else expected * scales[slot].cpu()[:, :, None, :, None]


@pytest.mark.parametrize("rows_per_program", [1, 4, 64])  # 64: capped at the page's 2 * 8 rows
@pytest.mark.parametrize("dtype,heads,dim", [(torch.float32, 2, 16), (torch.bfloat16, 3, 32), (torch.float16, 1, 8)])
def test_pages_of_every_layer_land_in_their_pool_pages(dtype, heads, dim, rows_per_program):
    from cache_engine.onload_kernel import OnloadLauncher

    gen = torch.Generator().manual_seed(0)
    layers, chunk_pages, page = 3, 4, 8
    slots, _ = host_slots(5, layers, chunk_pages, page, heads, dim, dtype, gen)
    pool = torch.zeros(layers, 40, 2, page, heads, dim, dtype=dtype, device=DEVICE)
    picks = [(4, 0), (1, 3), (1, 0), (2, 2), (0, 1)]  # (slot, page within the chunk), any order
    dst = torch.tensor([7, 0, 39, 12, 21])
    addr = torch.tensor([slots[s, 0, p].data_ptr() for s, p in picks])
    layer_bytes = slots.stride(1) * slots.element_size()
    OnloadLauncher(rows_per_program).all_layers(pool, addr.to(DEVICE), dst.to(DEVICE), layer_bytes, dtype)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    for (s, p), d in zip(picks, dst.tolist()):
        torch.testing.assert_close(pool[:, d].cpu(), slots[s, :, p], rtol=0, atol=0)
    untouched = sorted(set(range(40)) - set(dst.tolist()))
    assert not pool[:, untouched].any()


@pytest.mark.parametrize("rows_per_program", [1, 2, 8])  # 8: K and V rows in one program
def test_fp8_pages_are_dequantised_with_their_slot_scales(rows_per_program):
    from cache_engine.onload_kernel import OnloadLauncher

    gen = torch.Generator().manual_seed(1)
    layers, chunk_pages, page, heads, dim = 2, 2, 4, 2, 16
    slots, _ = host_slots(3, layers, chunk_pages, page, heads, dim, torch.float8_e4m3fn, gen)
    scales = torch.rand(3, layers, 2, heads, generator=gen) + 0.5
    # bf16 on CUDA; float32 in the interpreter, whose float32 -> bf16 conversion does not round to nearest
    pool_dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    pool = torch.zeros(layers, 10, 2, page, heads, dim, dtype=pool_dtype, device=DEVICE)
    picks, dst = [(2, 1), (0, 0), (1, 1)], torch.tensor([9, 3, 5])
    addr = torch.tensor([slots[s, 0, p].data_ptr() for s, p in picks])
    slot_ids = torch.tensor([s for s, _ in picks])
    layer_bytes = slots.stride(1) * slots.element_size()
    OnloadLauncher(rows_per_program).all_layers(pool, addr.to(DEVICE), dst.to(DEVICE), layer_bytes,
                                                torch.float8_e4m3fn, slot_ids.to(DEVICE), scales.to(DEVICE))
    for (s, p), d in zip(picks, dst.tolist()):
        expected = slots[s, :, p].float() * scales[s][:, :, None, :, None]  # [L, 2, page, H, D]
        torch.testing.assert_close(pool[:, d].cpu(), expected.to(pool_dtype), rtol=0, atol=0)


@pytest.mark.parametrize("fp8", [False, True])
def test_a_launcher_reused_over_layers_and_page_counts_loads_every_page(fp8):
    """One :class:`OnloadLauncher` for many launches, as the transfer engine uses it: on CUDA every launch after
    the first of a specialisation goes through the kept compiled kernel (other grids, offsets, index tensors), on
    the stream given (a side stream, as the transfer engine's), each layer's event recorded."""
    from cache_engine.onload_kernel import OnloadLauncher

    gen = torch.Generator().manual_seed(2)
    layers, chunk_pages, page, heads, dim, num_slots = 3, 4, 8, 2, 16, 6
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    slots, _ = host_slots(num_slots, layers, chunk_pages, page, heads, dim, dtype, gen)
    scales = (torch.rand(num_slots, layers, 2, heads, generator=gen) + 0.5) if fp8 else None
    pool_dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    layer_bytes = slots.stride(1) * slots.element_size()
    launcher = OnloadLauncher()
    for count in (1, 7, 3, 12):  # a new set of (slot, page) -> pool page picks each round, of another size
        pool = torch.zeros(layers, 50, 2, page, heads, dim, dtype=pool_dtype, device=DEVICE)
        picks, addr, slot_ids = random_picks(slots, count, gen)
        dst = torch.randperm(50, generator=gen)[:count]
        scales_here = None if scales is None else scales.to(DEVICE)
        if DEVICE == "cuda":
            side, events = torch.cuda.Stream(), [torch.cuda.Event() for _ in range(layers)]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                launcher.all_layers(pool, addr, dst.to(DEVICE), layer_bytes, dtype, slot_ids, scales_here, events, side)
            for event in events:
                torch.cuda.current_stream().wait_event(event)
        else:
            launcher.all_layers(pool, addr, dst.to(DEVICE), layer_bytes, dtype, slot_ids, scales_here)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            assert len(launcher._kernels) == 1  # one specialisation, kept after the first launch
        for (s, p), d in zip(picks, dst.tolist()):
            torch.testing.assert_close(pool[:, d].cpu(), expected_page(slots, scales, s, p).to(pool_dtype), rtol=0,
                                       atol=0)
        untouched = sorted(set(range(50)) - set(dst.tolist()))
        assert not pool[:, untouched].any()


@pytest.mark.skipif(DEVICE == "cuda", reason="a CPU cache manager's (unpinned) host memory: the interpreter only")
def test_engine_job_addresses_load_like_the_copy_path():
    """The transfer engine's job -> address plan (from the jobs' tensors or the store's address table), fed to the
    kernel, gives what the CPU copy path gives."""
    from cache_engine import CacheConfig, KVCacheManager
    from cache_engine.jobs import OnloadJob, host_page_addresses
    from cache_engine.onload_kernel import OnloadLauncher

    gen = torch.Generator().manual_seed(2)
    slot_bytes = 3 * 3 * 2 * 4 * 2 * 8 * 4  # layers, chunk pages, K/V, page size, heads, head dim, float32
    config = CacheConfig(mode="hierarchical", page_size=4, num_gpu_pages=32, chunk_tokens=12,
                         host_budget_bytes=8 * slot_bytes, host_segment_bytes=3 * slot_bytes)
    kv = KVCacheManager(config, num_layers=3, num_heads=2, head_dim=8, dtype=torch.float32, device="cpu")
    store = kv.host.store
    assert store.num_slots == 8 and len(store._segments) == 3
    for s in range(store.num_slots):
        store.slot(s).copy_(torch.randn(store.slot(s).shape, generator=gen))
    jobs = [OnloadJob(5, store.slot(5), [7, 2, 30]), OnloadJob(1, store.slot(1), [4]),
            OnloadJob(7, store.slot(7), [0, 9])]  # slots in several segments, partial chunks
    expected = torch.zeros_like(kv.kv_cache)
    kv.host.transfer.onload(expected, jobs)  # the CPU path: plain indexed copies
    got = torch.zeros_like(kv.kv_cache)
    addresses, layer_bytes = host_page_addresses(jobs)
    # The store's address table (what the engine's transfers read) gives the same addresses, over its 3 segments.
    assert store.addresses.tolist() == [store.slot(s).data_ptr() for s in range(store.num_slots)]
    assert np.array_equal(host_page_addresses(jobs, store.addresses)[0], addresses)
    dst = torch.tensor([p for job in jobs for p in job.pages])
    OnloadLauncher().all_layers(got, torch.from_numpy(addresses), dst, layer_bytes, torch.float32)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert expected.abs().sum() > 0


def test_before_layer_is_called_in_order_before_each_layers_launch():
    """``all_layers(before_layer=...)``: the hook runs once per layer, in order, before that layer's launch (an
    onload from the staging buffer queues its wait for the layer's copies there): at each call, exactly the earlier
    layers are written, and at the end every layer."""
    from cache_engine.onload_kernel import OnloadLauncher

    gen = torch.Generator().manual_seed(4)
    layers, chunk_pages, page, heads, dim = 5, 2, 8, 2, 16
    slots, _ = host_slots(2, layers, chunk_pages, page, heads, dim, torch.bfloat16, gen)
    pool_dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    pool = torch.zeros(layers, 6, 2, page, heads, dim, dtype=pool_dtype, device=DEVICE)
    addr = torch.tensor([slots[s, 0, p].data_ptr() for s in range(2) for p in range(chunk_pages)], device=DEVICE)
    dst = torch.tensor([5, 0, 3, 1], device=DEVICE)
    written = []

    def before_layer(layer: int) -> None:
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        written.append((layer, [bool(pool[other].any()) for other in range(layers)]))

    OnloadLauncher().all_layers(pool, addr, dst, slots.stride(1) * slots.element_size(), torch.bfloat16,
                                before_layer=before_layer)
    assert written == [(layer, [other < layer for other in range(layers)]) for layer in range(layers)]
    for (s, p), d in zip([(s, p) for s in range(2) for p in range(chunk_pages)], dst.tolist(), strict=True):
        torch.testing.assert_close(pool[:, d].cpu(), slots[s, :, p].to(pool_dtype), rtol=0, atol=0)
