"""``hstu_triton`` against the ``torch_ref`` oracle on randomly built paged batches.

CPU tests run the kernel in Triton's interpreter (``TRITON_INTERPRET=1``, set here before the backend
module is imported, only when CUDA is unavailable) on tiny shapes in float32; ``gpu`` tests run the
compiled kernel at the benchmark's sizes (4 heads x 128, bf16, histories up to 16k, page size 32). Time bias
tests give the step event times (:class:`StepTimestamps`) and a ``[buckets, H]`` table to both backends.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():  # the interpreter; the kernels read this when their module is imported
    os.environ["TRITON_INTERPRET"] = "1"

from attention_backends import AttentionSpec, BackendRegistry, PagedBatchMetadata
from attention_backends.base import time_bucket
from attention_backends.torch_ref import TorchRefBackend

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    import triton
    import triton.language as tl

    import attention_backends.hstu_triton as hstu_triton
    from attention_backends.hstu_triton import HSTUTritonBackend, TileConfig
    from attention_backends.hstu_triton_kernels import _time_bias, hstu_paged_attention_kernel
    from attention_backends.hstu_triton_plan import uncut_sizes

    @triton.jit
    def _time_bias_kernel(Table, QueryTimes, KeyTimes, Out, num_heads, max_bucket, M: tl.constexpr, N: tl.constexpr):
        """``Out[h] = _time_bias`` of head ``program_id(0)`` for every (query, key) pair: ``[H, M, N]``."""
        head, rows, cols = tl.program_id(0), tl.arange(0, M), tl.arange(0, N)
        bias = _time_bias(Table + head, tl.load(QueryTimes + rows), tl.load(KeyTimes + cols), num_heads, max_bucket)
        tl.store(Out + head * M * N + rows[:, None] * N + cols[None, :], bias)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available() or (HAS_TRITON and not hstu_triton.INTERPRETED),
    reason="interpreter tests (CUDA runs the gpu tests); on CPU they need triton imported after TRITON_INTERPRET=1 "
    "was set: run this file on its own or with TRITON_INTERPRET=1",
)

# (tokens already cached, new history rows, candidate rows) per request.
EDGE_BATCH = [
    (37, 5, 3),  # crosses page boundaries
    (0, 20, 4),  # no cached history: only new rows
    (31, 1, 0),  # exactly one new history row; last page full at page size 16 and 32
    (32, 0, 6),  # candidates only, last page full
    (0, 0, 3),  # no history at all: candidates see only themselves
    (16, 1, 2),  # last page holds one token at page size 16
    (70, 40, 5),  # many query and key tiles
    (5, 0, 1),  # short, one candidate
]


def make_spec(page_size: int, heads: int, dim: int, dtype: torch.dtype, device: str = DEVICE) -> AttentionSpec:
    return AttentionSpec(kind="hstu", num_heads=heads, head_dim=dim, page_size=page_size, dtype=dtype,
                         device_type=device, alpha=dim**-0.5, scaling_seqlen=64)


def make_common(layout: list[tuple[int, int, int]], page: int, gen: torch.Generator, spare_pages: int = 3,
                device: str = DEVICE, times: list[np.ndarray] | None = None) -> PagedBatchMetadata:
    """The common metadata of ``layout`` over shuffled pages of a pool of ``spare_pages`` more pages; with
    ``times`` (each request's int64 history event times ``[cached + new]``), its :class:`StepTimestamps`."""
    cached, hist, cand = (np.array([x[i] for x in layout], dtype=np.int64) for i in range(3))
    num_pages = -(-(cached + hist) // page)
    indptr = np.concatenate([[0], np.cumsum(num_pages)])
    indices = torch.randperm(int(indptr[-1]) + spare_pages, generator=gen)[: int(indptr[-1])].numpy()
    query_times = key_times = None
    if times is not None:  # a history row's time is its event's; a candidate's, the last event's (0 without one)
        query_times = np.concatenate([np.concatenate([t[c:], np.full(x, t[-1] if len(t) else 0)])
                                      for (c, _, x), t in zip(layout, times)]).astype(np.int64)
        key_times = np.concatenate([np.zeros(0), *times]).astype(np.int64)
    return PagedBatchMetadata.from_layout(cached, hist, cand, indptr, indices, page, device, query_times, key_times)


def random_times(layout: list[tuple[int, int, int]], gen: torch.Generator) -> list[np.ndarray]:
    """Increasing event times per request with gaps from 0 to about 2**34 (every bucket up to 34 is hit)."""
    times = []
    for c, h, _ in layout:
        gaps = torch.where(torch.rand(c + h, generator=gen) < 0.2, 0, 2 ** (torch.rand(c + h, generator=gen) * 34))
        times.append(1_700_000_000 + torch.cumsum(gaps.long(), 0).numpy())
    return times


def make_batch(layout: list[tuple[int, int, int]], spec: AttentionSpec, gen: torch.Generator, spare_pages: int = 3,
               head_major_cache: bool = False, times: list[np.ndarray] | None = None):
    """A paged batch: common metadata, fused-projection q/k/v views ``[T, H, D]`` and a cache whose
    history before this step is filled and whose every other slot is NaN, pages shuffled."""
    page, heads, dim, dtype = spec.page_size, spec.num_heads, spec.head_dim, spec.dtype
    common = make_common(layout, page, gen, spare_pages, spec.device_type, times)
    indptr, indices = (torch.from_numpy(common.host[k]) for k in ("kv_indptr", "kv_indices"))
    pool, total = int(indptr[-1]) + spare_pages, int(common.host["query_start_loc"][-1])
    qkv = torch.randn(total, 3, heads, dim, generator=gen).to(device=spec.device_type, dtype=dtype)
    shape = (pool, 2, heads, page, dim) if head_major_cache else (pool, 2, page, heads, dim)
    cache = torch.full(shape, float("nan"), dtype=dtype, device=spec.device_type)
    if head_major_cache:
        cache = cache.transpose(2, 3)  # NHD view of HND storage: exercises the stride handling
    # History cached before this step: position p of request b lives in page indices[indptr[b] + p // page].
    cached = torch.tensor([c for c, _, _ in layout])
    owner = torch.repeat_interleave(torch.arange(len(cached)), cached)
    pos = torch.arange(len(owner)) - (torch.cumsum(cached, 0) - cached)[owner]
    slot_page = indices[indptr[owner] + pos // page].to(spec.device_type)
    old = torch.randn(len(owner), 2, heads, dim, generator=gen).to(device=spec.device_type, dtype=dtype)
    cache[slot_page, :, (pos % page).to(spec.device_type)] = old
    return common, qkv[:, 0], qkv[:, 1], qkv[:, 2], cache


def cuda_activity(call) -> tuple[object, list[str]]:
    """``call()``'s result and the names of the CUDA kernels and copies it queued (profiled, after a synchronise)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = call()
        torch.cuda.synchronize()
    return result, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def make_backend(spec: AttentionSpec, tiles: TileConfig | None = None, num_sms: int | None = None):
    """The backend; ``num_sms`` overrides the processor count that split-KV plans for (more: more, shorter
    parts), with no per-program overhead and parts of any length (so tiny batches split too)."""
    backend = HSTUTritonBackend(spec, tiles=tiles)
    if num_sms is not None:
        backend.num_sms, backend.overhead_keys, backend.min_tiles_per_split = num_sms, 0, 1
    return backend


def run_both(layout, spec, gen, tiles=None, num_sms=None, head_major_cache=False, times=None):
    """Append + attend with both backends; returns (hstu_triton output, torch_ref output, output scale). With
    ``times`` (see :func:`make_common`) both add a random ``[spec.time_bias_buckets, H]`` bias in ``spec.dtype``."""
    common, q, k, v, cache = make_batch(layout, spec, gen, head_major_cache=head_major_cache, times=times)
    table = None
    if times is not None:
        table = torch.randn(spec.time_bias_buckets, spec.num_heads, generator=gen).to(spec.device_type, spec.dtype)
    ref, ref_cache = TorchRefBackend(spec), cache.clone()
    ref_meta = ref.build_metadata(common)
    ref.append_kv(ref_cache, k, v, ref_meta)
    # NaN slots are never valid keys; the oracle multiplies its masked-out weights by them, so give it zeros.
    expected = ref.attend(q, k, v, torch.nan_to_num(ref_cache, nan=0.0), ref_meta, time_bias=table)

    backend = make_backend(spec, tiles, num_sms)
    meta = backend.build_metadata(common)
    backend.append_kv(cache, k, v, meta)
    assert torch.equal(cache.nan_to_num(0.0), ref_cache.nan_to_num(0.0))
    got = backend.attend(q, k, v, cache, meta, time_bias=table)
    assert got.dtype == q.dtype and got.shape == q.shape
    return got.float(), expected.float(), expected.float().abs().max().clamp(min=1e-6)


def assert_close(got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor, rtol: float) -> None:
    assert torch.isfinite(got).all(), "non-finite output"
    err = ((got - expected).abs().max() / scale).item()
    assert err <= rtol, f"max error {err:.3g} x output scale exceeds {rtol}"


def random_layout(gen: torch.Generator, num_requests: int, max_cached: int, max_new: int, max_cand: int):
    def draw(hi: int) -> int:
        r = torch.rand((), generator=gen).item()
        return 0 if r < 0.2 else (1 if r < 0.3 else int(torch.randint(0, hi + 1, (), generator=gen)))

    layout = [(draw(max_cached), draw(max_new), draw(max_cand)) for _ in range(num_requests)]
    return [(c, h, x if h + x else 1) for c, h, x in layout]  # every request has at least one row


@needs_triton
@cpu_only
@pytest.mark.parametrize(
    ("page_size", "dim", "block_m", "block_n", "num_sms"),
    [(16, 16, 16, 16, 1), (16, 32, 32, 32, None), (32, 16, 16, 32, 40), (16, 16, 64, 64, 8), (16, 16, 16, 16, 200)],
)
def test_edge_batch_matches_reference(page_size, dim, block_m, block_n, num_sms):
    gen = torch.Generator().manual_seed(page_size * 1000 + dim)
    spec = make_spec(page_size, 2, dim, torch.float32)
    got, expected, scale = run_both(EDGE_BATCH, spec, gen, TileConfig(block_m, block_n, 4, 1), num_sms)
    assert_close(got, expected, scale, 1e-5)


@needs_triton
@cpu_only
@pytest.mark.parametrize("seed", range(3))
def test_random_batches_match_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    layout = random_layout(gen, 5, 90, 40, 8)
    spec = make_spec(32 if seed % 2 else 16, 2, 16, torch.float32)
    got, expected, scale = run_both(layout, spec, gen, TileConfig(16, 32, 4, 1), num_sms=(1, 16, 64)[seed],
                                    head_major_cache=seed == 2)
    assert_close(got, expected, scale, 1e-5)


@needs_triton
@cpu_only
def test_programs_per_sm_multiplies_the_persistent_grid():
    """``TileConfig.programs_per_sm``: the grid and the split-KV plan count SMs x programs_per_sm processors (the
    plan of 3 an SM on 4 SMs is the plan of one on 12), and the output still equals the oracle's."""
    gen = torch.Generator().manual_seed(5)
    spec = make_spec(16, 2, 16, torch.float32)
    layout = [(300, 4, 9), (90, 0, 5), (0, 40, 0), (17, 1, 3)]
    common = make_common(layout, 16, gen)
    three = HSTUTritonBackend(spec, tiles=TileConfig(16, 16, 4, 1, programs_per_sm=3))
    three.num_sms = 4
    one = make_backend(spec, TileConfig(16, 16, 4, 1))
    one.num_sms = 12
    meta3, meta1 = three.build_metadata(common), one.build_metadata(common)
    assert meta3.processors == 12 and three.processors(three.tiles) == 12
    assert torch.equal(meta3.tiles, meta1.tiles) and torch.equal(meta3.items, meta1.items)
    got, expected, scale = run_both(layout, spec, gen, TileConfig(16, 16, 4, 1, programs_per_sm=3), num_sms=4)
    assert_close(got, expected, scale, 1e-5)


@needs_triton
@cpu_only
def test_float16_on_interpreter():
    # Not bf16: Triton 3.6's interpreter computes bf16 tl.dot wrongly; the gpu tests cover bf16.
    gen = torch.Generator().manual_seed(7)
    spec = make_spec(16, 2, 16, torch.float16)
    got, expected, scale = run_both(EDGE_BATCH, spec, gen, TileConfig(16, 16, 4, 1), num_sms=32)
    assert_close(got, expected, scale, 3e-3)


@needs_triton
@cpu_only
@pytest.mark.parametrize(("dtype", "tiles", "num_sms"), [(torch.float32, TileConfig(16, 16, 4, 1), 1),
                                                          (torch.float32, TileConfig(16, 32, 4, 1), 64),
                                                          (torch.float16, TileConfig(32, 16, 4, 1), 200),
                                                          (torch.float16, TileConfig(128, 128, 8, 3), 64)])
def test_new_rows_read_densely_equal_the_paged_read(dtype, tiles, num_sms):
    """``attend_new_rows`` (K/V of every key read from the step's rows by TMA) against ``attend`` after the append,
    on steps where no request has cached keys: several requests, candidates, split tiles (``num_sms`` 64 and 200),
    a relative time bias, and rows past the step's (a graph step's padding) holding NaN, which masked tiles read and
    must not use. The 128 x 128 prefill tiles' dense read steps over 64 keys at a time (``own_rows_block_n``)."""
    gen = torch.Generator().manual_seed(num_sms)
    layout = [(0, 70, 5), (0, 1, 0), (0, 0, 3), (0, 33, 2), (0, 40, 0)]
    for times in (None, random_times(layout, gen)):  # without and with a relative time bias
        spec = make_spec(16, 2, 16, dtype) if times is None else with_time_bias(make_spec(16, 2, 16, dtype), 24)
        table = None if times is None else torch.randn(24, 2, generator=gen).to(dtype)
        common, q, k, v, cache = make_batch(layout, spec, gen, times=times)
        backend = make_backend(spec, tiles, num_sms)
        meta = backend.build_metadata(common)
        backend.append_kv(cache, k, v, meta)
        expected = backend.attend(q, k, v, cache, meta, time_bias=table)
        padded = torch.cat([torch.stack([q, k, v], 1), torch.full((5, 3, 2, 16), float("nan"), dtype=dtype)])
        got = backend.attend_new_rows(padded[:, 0], padded[:, 1], padded[:, 2], meta, time_bias=table)
        assert torch.isfinite(got[: q.shape[0]]).all()
        torch.testing.assert_close(got[: q.shape[0]], expected, rtol=0, atol=0)  # the same sums in the same order


@needs_triton
@cpu_only
def test_default_tiles_and_page_size_64():
    gen = torch.Generator().manual_seed(11)
    spec = make_spec(64, 1, 16, torch.float32)
    assert HSTUTritonBackend(spec).tiles.block_n % 64 == 0
    got, expected, scale = run_both([(70, 3, 2), (0, 0, 2), (64, 1, 1)], spec, gen)
    assert_close(got, expected, scale, 1e-5)


def test_default_pipeline_depth_is_the_swept_one():
    """3 key tiles in flight only where the tile sweep measured them faster: 16-bit 128 x 128 tiles of heads up to
    128 wide without a time bias; 2 with the bias, for wider heads and for decode-like tiles; 1 in float32. Decode
    tiles run two an SM in 16 bits, where the sweep measured it."""
    from attention_backends.hstu_triton_plan import TileConfig, default_tile_config

    bf16 = make_spec(32, 4, 128, torch.bfloat16, "cuda")
    assert default_tile_config(bf16) == TileConfig(128, 128, 8, 3)
    assert default_tile_config(dataclasses.replace(bf16, dtype=torch.float16)).num_stages == 3
    assert default_tile_config(with_time_bias(bf16, 32)) == TileConfig(128, 128, 8, 2)
    assert default_tile_config(bf16, max_query_len=20) == TileConfig(32, 128, 4, 2, programs_per_sm=2)
    assert default_tile_config(make_spec(32, 4, 128, torch.float32, "cuda"), max_query_len=20).programs_per_sm == 1
    assert default_tile_config(make_spec(32, 2, 256, torch.bfloat16, "cuda")).num_stages == 2
    assert default_tile_config(make_spec(32, 4, 128, torch.float32, "cuda")).num_stages == 1


def with_time_bias(spec: AttentionSpec, buckets: int) -> AttentionSpec:
    return dataclasses.replace(spec, time_bias_buckets=buckets)


def power_of_two_gaps(max_k: int) -> np.ndarray:
    """Every ``2**k - 2, 2**k - 1, 2**k, 2**k + 1`` for ``k = 1..max_k`` (``1 + gap`` at and around powers of
    two: where a float32 log2 is wrong), and 0, sorted."""
    return np.unique(np.array([2**k + d for k in range(1, max_k + 1) for d in (-2, -1, 0, 1)] + [0], np.int64))


needs_kernels = pytest.mark.skipif(not HAS_TRITON or not (torch.cuda.is_available() or hstu_triton.INTERPRETED),
                                   reason="needs triton, and CUDA or TRITON_INTERPRET=1 set before it was imported")


@needs_kernels
@pytest.mark.parametrize("num_buckets", [64, 41, 20, 1])
def test_time_bucket_is_exact_at_powers_of_two(num_buckets):
    # The kernel's bucket, read back through a table whose entry [b, h] is b * H + h, against bit lengths.
    gaps = power_of_two_gaps(62)  # 249 gaps; key times -gap and +gap
    keys = np.concatenate([-gaps, gaps, np.arange(512 - 2 * len(gaps)) * 7919])
    queries = np.array([0, 1, -1, 2, 3, -5, 2**20, 2**24 + 1, 2**31, -(2**31) - 1, 2**32 - 1, 2**40, -(2**40),
                        2**53, 12345678901, -98765], np.int64)
    heads, expected = 3, np.empty((len(queries), len(keys)), np.int64)
    for i, t_query in enumerate(queries.tolist()):
        expected[i] = [min((abs(t_query - t_key) + 1).bit_length() - 1, num_buckets - 1) for t_key in keys.tolist()]
    table = torch.arange(num_buckets * heads, dtype=torch.float32, device=DEVICE).view(num_buckets, heads)
    out = torch.empty(heads, len(queries), len(keys), device=DEVICE)
    query_times, key_times = (torch.from_numpy(x).to(DEVICE) for x in (queries, keys))
    _time_bias_kernel[(heads,)](table, query_times, key_times, out, heads, num_buckets - 1, len(queries), len(keys))
    got = out.cpu().long()
    assert torch.equal(got // heads, torch.from_numpy(expected)[None].expand(heads, -1, -1))
    assert torch.equal(got % heads, torch.arange(heads)[:, None, None].expand_as(got))
    # time_bucket agrees below 2**48 (above, float64 log2 rounds log2(2**k - 1) up to k: one bucket too many).
    small = torch.from_numpy(np.abs(queries[:, None] - keys[None, :]) < 2**48)
    delta = torch.from_numpy(queries[:, None] - keys[None, :])
    assert torch.equal(time_bucket(delta, num_buckets)[small], torch.from_numpy(expected)[small])


def gap_layout_and_times(max_k: int = 40) -> tuple[list[tuple[int, int, int]], list[np.ndarray]]:
    """Requests whose queries see keys exactly ``power_of_two_gaps(max_k)`` before (and after) them: history
    times ``T - gap`` (increasing) ending with a new row at ``T``, then candidates (time ``T``); the same
    into the future (``|dt|``); a mix with several new rows; and one without history."""
    gaps, start = power_of_two_gaps(max_k), 2**42
    before = np.concatenate([start - gaps[::-1]])  # ends with T (gap 0)
    after = start + gaps
    mixed = np.concatenate([start - gaps[::-1][:80], start + gaps[::7]])
    layout = [(len(before) - 1, 1, 3), (len(after) - 5, 5, 2), (50, len(mixed) - 50, 4), (0, 0, 2)]
    return layout, [before, after, mixed, np.zeros(0, np.int64)]


@needs_triton
@cpu_only
@pytest.mark.parametrize(("num_buckets", "num_sms"), [(42, None), (42, 64), (64, 1), (20, None), (1, None)])
def test_time_bias_at_power_of_two_gaps_matches_reference(num_buckets, num_sms):
    layout, times = gap_layout_and_times(40)
    gen = torch.Generator().manual_seed(num_buckets)
    spec = with_time_bias(make_spec(16, 2, 16, torch.float32), num_buckets)
    got, expected, scale = run_both(layout, spec, gen, TileConfig(16, 32, 4, 1), num_sms, times=times)
    assert_close(got, expected, scale, 1e-5)
    # And the bias matters: without it the output is different.
    plain = run_both(layout, spec, torch.Generator().manual_seed(num_buckets), TileConfig(16, 32, 4, 1), num_sms)[0]
    assert (plain - got).abs().max() > 1e-3 * scale


@needs_triton
@cpu_only
@pytest.mark.parametrize("seed", range(3))
def test_time_bias_with_split_kv_matches_reference(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    layout = [*EDGE_BATCH, *random_layout(gen, 3, 200, 40, 8)]
    spec = with_time_bias(make_spec(16 if seed else 32, 2, 16, torch.float32), 36)
    tiles = TileConfig(16, 32, 4, 1)
    common = make_common(layout, spec.page_size, gen, device="cpu")
    split = make_backend(spec, tiles, num_sms=200).build_metadata(common)
    assert int(split.tiles[2].max()) > 1  # several parts per tile: each adds its own keys' bias
    got, expected, scale = run_both(layout, spec, gen, tiles, num_sms=200, head_major_cache=seed == 2,
                                    times=random_times(layout, gen))
    assert_close(got, expected, scale, 1e-5)


@needs_triton
@cpu_only
def test_time_bias_float16_default_tiles_and_missing_timestamps():
    gen = torch.Generator().manual_seed(3)
    spec = with_time_bias(make_spec(16, 2, 16, torch.float16), 24)  # fp16 table, added in fp32
    got, expected, scale = run_both(EDGE_BATCH, spec, gen, times=random_times(EDGE_BATCH, gen))
    assert_close(got, expected, scale, 3e-3)
    common, q, k, v, cache = make_batch(EDGE_BATCH, spec, gen)  # no timestamps
    backend = HSTUTritonBackend(spec)
    with pytest.raises(ValueError, match="timestamps"):
        backend.attend(q, k, v, cache, backend.build_metadata(common), time_bias=torch.zeros(24, 2))


@needs_triton
@cpu_only
def test_engine_with_time_bias_equals_recompute():
    import msgspec

    from gr_engine import GREngine
    from tests.conftest import tiny_config, with_cache
    from tests.test_engine_differential import max_diff, stream

    config = tiny_config(page_size=16, head_dim=16, num_gpu_pages=60, max_history_len=128, time_bias_buckets=20)
    requests = stream(config, num_users=4, visits=4, seed=6)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)  # torch_ref, no reuse
    engine = GREngine(msgspec.structs.replace(config, attention_backend="hstu_triton"))
    assert type(engine.backend) is HSTUTritonBackend
    assert max_diff(engine.rank(requests, use_tqdm=False), expected) <= 1e-4


@needs_triton
@cpu_only
@pytest.mark.parametrize("mode", ["recompute", "gpu_only"])
def test_engines_read_uncached_steps_from_their_own_rows_with_the_same_scores(monkeypatch, mode):
    """An engine on ``hstu_triton`` attends through ``attend_new_rows`` in every step where no request has keys
    before its new rows (first visits, a history's first chunk) and through the pages in the others (one request a
    step, histories over 100 events in chunks, returning users): every score equals the same engine's with the
    own-rows read off, and ``recompute`` on ``torch_ref`` within 1e-5. A ``recompute`` engine appends nothing in a
    step that also finishes every request; a caching one appends in every step."""
    import msgspec

    from gr_engine import GREngine
    from tests.conftest import tiny_config, with_cache
    from tests.test_engine_differential import max_diff, stream

    config = msgspec.structs.replace(tiny_config(mode=mode, page_size=16, head_dim=16, max_history_len=128,
                                                 max_num_seqs=1, max_num_batched_tokens=200),
                                     attention_backend="hstu_triton")
    requests = stream(config, num_users=4, visits=3, seed=4)
    paged = GREngine(config)
    paged.runner.own_rows = False
    expected = paged.rank(requests, use_tqdm=False)
    reads = {"own_rows": 0, "pages": 0, "append": 0}
    backend = HSTUTritonBackend
    attend, attend_new_rows, append = backend.attend, backend.attend_new_rows, backend.append_kv

    def count(label, read):
        def counted(*args, **kwargs):
            reads[label] += 1
            return read(*args, **kwargs)
        return counted

    monkeypatch.setattr(HSTUTritonBackend, "attend", count("pages", attend))
    monkeypatch.setattr(HSTUTritonBackend, "attend_new_rows", count("own_rows", attend_new_rows))
    monkeypatch.setattr(HSTUTritonBackend, "append_kv", count("append", append))
    engine = GREngine(config)
    assert engine.runner.own_rows
    outputs = engine.rank(requests, use_tqdm=False)
    assert max_diff(outputs, expected) == 0.0
    assert reads["own_rows"] > 0 and reads["pages"] > 0, reads
    reference = GREngine(msgspec.structs.replace(with_cache(config, mode="recompute"), attention_backend="torch_ref"))
    assert max_diff(outputs, reference.rank(requests, use_tqdm=False)) <= 1e-5
    if mode == "recompute":
        assert reads["pages"] <= reads["append"] < reads["own_rows"] + reads["pages"], reads
    else:
        assert reads["append"] == reads["own_rows"] + reads["pages"], reads


@needs_triton
@cpu_only
@pytest.mark.parametrize("concat_ua", [False, True])
def test_engine_on_the_cuda_layer_path_equals_recompute(monkeypatch, concat_ua):
    """The layers as on CUDA (every fused kernel: the input norm writing the residual plus the output bias, the gate)
    in an ``hstu_triton`` engine with a pool small enough to evict: scores equal ``recompute`` on ``torch_ref`` with
    torch's ops."""
    import msgspec

    from gr_engine import GREngine
    from gr_engine.models.layers import FusedLayerNorm, HSTULayer
    from tests.conftest import tiny_config, with_cache
    from tests.test_engine_differential import max_diff, stream

    config = tiny_config(page_size=16, head_dim=16, num_gpu_pages=24, max_history_len=128)
    config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, concat_ua=concat_ua))
    requests = stream(config, num_users=4, visits=3, seed=9)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    layer_forward, norm_forward = HSTULayer.forward, FusedLayerNorm.forward
    monkeypatch.setattr(HSTULayer, "forward", lambda self, x, attend, fused=None: layer_forward(self, x, attend, True))
    monkeypatch.setattr(FusedLayerNorm, "forward", lambda self, x, fused=None: norm_forward(self, x, True))
    engine = GREngine(msgspec.structs.replace(config, attention_backend="hstu_triton"))
    outputs = engine.rank(requests, use_tqdm=False)
    assert engine.kv.stats.evicted_tokens > 0  # the pool was too small to keep every user
    assert max_diff(outputs, expected) <= 1e-5


@needs_triton
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_sms", [1, 8, 100])
def test_tile_map_covers_every_row_and_key_range_once(seed, num_sms):
    gen = torch.Generator().manual_seed(seed)
    spec = make_spec(16, 2, 16, torch.float32)
    layout = EDGE_BATCH if seed == 0 else random_layout(gen, 6, 300, 100, 10)
    common = make_common(layout, spec.page_size, gen, device="cpu")
    tiles = TileConfig(16, 16, 4, 1)
    meta = make_backend(spec, tiles, num_sms).build_metadata(common)
    qsl, seq_lens, hist = (x.long() for x in (common.query_start_loc, common.kv_seq_lens, common.num_history_rows))
    tile_request, tile_start, tile_splits, _, tile_part_len = meta.tiles.tolist()
    item_tile, item_split = meta.items.tolist()
    covered = torch.zeros(int(qsl[-1]), dtype=torch.long)
    parts = {}
    for tile, (req, start) in enumerate(zip(tile_request, tile_start)):
        if req < 0:
            assert tile_splits[tile] == 0
            continue
        end = min(int(qsl[req]) + start + tiles.block_m, int(qsl[req + 1]))
        covered[int(qsl[req]) + start: end] += 1
        visible = min(int(seq_lens[req] - hist[req]) + end - int(qsl[req]), int(seq_lens[req]))
        splits, part_len = tile_splits[tile], tile_part_len[tile]
        assert part_len % tiles.block_n == 0 and splits * part_len >= visible  # the parts cover its keys
        assert splits == 1 or (splits - 1) * part_len < visible  # and none is empty
        parts[tile] = []
    assert covered.eq(1).all()
    # The grid (one program per item slot and head) must hold every part of every tile exactly once.
    for tile, split in zip(item_tile, item_split):
        if tile >= 0:
            parts[tile].append(split)
    assert all(sorted(p) == list(range(tile_splits[t])) for t, p in parts.items())
    assert min(item_tile[: sum(len(p) for p in parts.values())]) >= 0  # spare slots come last
    if num_sms == 100:
        assert max(tile_splits) > 1


class _RecordOps(TorchDispatchMode):
    """Records every torch op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@needs_triton
@cpu_only
def test_no_device_sync_in_build_metadata_or_attend():
    spec, gen = with_time_bias(make_spec(16, 2, 16, torch.float32), 12), torch.Generator().manual_seed(5)
    common, q, k, v, cache = make_batch(EDGE_BATCH, spec, gen, times=random_times(EDGE_BATCH, gen))
    backend, cache = HSTUTritonBackend(spec, tiles=TileConfig(16, 16, 4, 1)), cache.nan_to_num(0.0)
    table = torch.randn(12, 2, generator=gen)
    with _RecordOps() as record:  # ops that synchronise a CUDA device: reading a value, uploading host data
        backend.attend(q, k, v, cache, backend.build_metadata(common))
        split = make_backend(spec, backend.tiles, num_sms=64).build_metadata(common)
        backend.attend(q, k, v, cache, split)
        backend.attend(q, k, v, cache, split, time_bias=table)  # the time bias path too
    assert not {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default} & set(record.ops)
    assert int(split.tiles[2].max()) > 1  # the split path ran too


def torch_tile_map(common, tiles, num_heads, num_sms, overhead_keys, min_tiles_per_split, max_splits=32):
    """The reference: hstu_triton's planning before it moved to the host (torch ops, then on the device)."""
    block_m, block_n, num_requests = tiles.block_m, tiles.block_n, common.num_requests
    num_tiles = min((len(common.history_rows) + len(common.candidate_rows) + num_requests * (block_m - 1)) // block_m,
                    num_requests * -(-common.max_query_len // block_m))
    num_items = max(num_tiles, -(-4 * num_sms // num_heads))
    if num_tiles == 0:
        return torch.zeros(5, 0, dtype=torch.int32), torch.zeros(2, 0, dtype=torch.int32)
    rows = common.query_start_loc.long().diff()
    tiles_per_request = (rows + block_m - 1) // block_m
    tile_end, tile = torch.cumsum(tiles_per_request, 0), torch.arange(num_tiles)
    req = torch.searchsorted(tile_end, tile, right=True)
    in_use, req = req < num_requests, req.clamp(max=num_requests - 1)
    first = (tile - (tile_end - tiles_per_request)[req]) * block_m
    seq_len = common.kv_seq_lens.long()[req]
    last_limit = seq_len - common.num_history_rows.long()[req] + torch.minimum(first + block_m, rows[req])
    blocks = (torch.where(in_use, torch.minimum(last_limit, seq_len), 0) + block_n - 1) // block_n
    longest = torch.arange(1, max_splits + 1)[:, None]
    max_part = ((blocks.max() + longest - 1) // longest).clamp(min=min_tiles_per_split)
    parts = torch.where(in_use, ((blocks + max_part - 1) // max_part).clamp(min=1), 0)
    part_len = (blocks + parts.clamp(min=1) - 1) // parts.clamp(min=1)
    lengths = torch.minimum((blocks[:, None] - torch.arange(max_splits) * part_len[..., None]).clamp(min=0),
                            part_len[..., None]).flatten(1).sort(dim=1, descending=True).values
    items, longest_part, last = parts.sum(1), lengths[:, 0], lengths.shape[1] - 1
    waves = ((4 * lengths >= 3 * longest_part[:, None]).sum(1) * num_heads + num_sms - 1) // num_sms
    pair = lengths[:, min((num_sms - 1) // num_heads, last)] + lengths[:, min(num_sms // num_heads, last)]
    bound = torch.maximum(torch.maximum(waves * longest_part, pair), blocks.sum() * num_heads / num_sms)
    cost = bound + overhead_keys / block_n * num_heads / num_sms * items
    best = torch.argmin(torch.where(items <= num_items, cost, float("inf")))[None]
    splits, part_len = parts[best][0], part_len[best][0]
    item_end, item = torch.cumsum(splits, 0), torch.arange(num_items)
    item_tile = torch.searchsorted(item_end, item, right=True)
    item_in_use, item_tile = item_tile < num_tiles, item_tile.clamp(max=num_tiles - 1)
    item_split = item - (item_end - splits)[item_tile]
    item_len = torch.minimum(blocks[item_tile] - item_split * part_len[item_tile], part_len[item_tile])
    order = torch.argsort(torch.where(item_in_use, item_len + 1, -1), descending=True, stable=True)
    tile_arrays = torch.stack([torch.where(in_use, req, -1), first, splits, item_end - splits, part_len * block_n])
    item_arrays = torch.stack([torch.where(item_in_use, item_tile, -1), item_split])[:, order]
    return tile_arrays.to(torch.int32), item_arrays.to(torch.int32)


@needs_triton
@pytest.mark.parametrize("seed", range(6))
def test_host_plan_equals_torch_planning(seed):
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    for case in range(40):
        page = int(rng.choice([16, 32, 64]))
        tiles = TileConfig(int(rng.choice([16, 32, 64, 128])), page * int(rng.choice([1, 2, 4])), 4, 1)
        heads, num_sms, overhead, min_tiles = (int(rng.choice(c)) for c in ([1, 2, 4, 8], [1, 3, 8, 40, 132, 1000],
                                                                          [0, 64, 640], [1, 4]))
        if case % 3 == 0:  # decode-like: a few rows per request over long histories
            layout = [(int(rng.integers(0, 20_000)), int(rng.integers(0, 3)), int(rng.integers(1, 12)))
                      for _ in range(int(rng.integers(1, 17)))]
        else:
            layout = random_layout(gen, int(rng.integers(1, 13)), 20_000, 700, 120)
        common, spec = make_common(layout, page, gen, device="cpu"), make_spec(page, heads, 16, torch.float32)
        backend = HSTUTritonBackend(spec, tiles=tiles)
        backend.num_sms, backend.overhead_keys, backend.min_tiles_per_split = num_sms, overhead, min_tiles
        expected = torch_tile_map(common, tiles, heads, num_sms, overhead, min_tiles)
        for host in (common.host, None):  # planned from the host arrays, or from the device's when there are none
            meta = backend.build_metadata(dataclasses.replace(common, host=host))
            assert torch.equal(meta.tiles, expected[0]) and torch.equal(meta.items, expected[1]), (layout, case)
            uncut = uncut_sizes(*(common.host[n] for n in ("query_start_loc", "num_history_rows", "kv_seq_lens")),
                                tiles, heads, num_sms, min_tiles)
            splittable = uncut is None and common.max_kv_len > min_tiles * tiles.block_n
            assert meta.config == tiles and meta.may_split == splittable


@needs_triton
@pytest.mark.parametrize("seed", range(3))
def test_large_steps_are_planned_without_costing_cuts(seed, monkeypatch):
    """A step whose tiles cut for s = 2 already need more items than the budget (recompute-like: thousands of new
    rows a request, or many over a long cached history) is planned uncut without costing any plan, exactly as the
    torch reference plans it."""
    import attention_backends.hstu_triton_plan as plan

    def never(*args):
        raise AssertionError("a large step costed its cuts")

    monkeypatch.setattr(plan, "_cheapest_cut", never)
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    for case in range(10):
        page, heads, num_sms = int(rng.choice([16, 32])), int(rng.choice([1, 4])), int(rng.choice([4, 8]))
        tiles = TileConfig(int(rng.choice([64, 128])), page * int(rng.choice([1, 2])), 4, 1)
        cached = 0 if case % 2 else int(rng.integers(20_000, 40_000))
        layout = [(cached, int(rng.integers(5_000, 15_000)), int(rng.integers(0, 101)))
                  for _ in range(int(rng.integers(1, 9)))]
        common, spec = make_common(layout, page, gen, device="cpu"), make_spec(page, heads, 16, torch.float32)
        backend = HSTUTritonBackend(spec, tiles=tiles)
        backend.num_sms = num_sms
        expected = torch_tile_map(common, tiles, heads, num_sms, backend.overhead_keys, backend.min_tiles_per_split)
        meta = backend.build_metadata(common)
        assert torch.equal(meta.tiles, expected[0]) and torch.equal(meta.items, expected[1]), (layout, case)


@needs_triton
def test_build_metadata_is_one_host_to_device_copy():
    # On the "meta" device, a stand-in for CUDA (the same code path, no data): the host plans, one copy uploads.
    # (With the H200's 132 processors: on the CPU's nominal 4 this step would be large enough to plan on the device.)
    common = make_common([(16000, 1, 8)] * 8, 32, torch.Generator().manual_seed(0), device="meta")
    backend = HSTUTritonBackend(make_spec(32, 4, 16, torch.float32))
    backend.num_sms = 132
    with _RecordOps() as record:
        meta = backend.build_metadata(common)
    computing = [str(f) for f in record.ops if not f.is_view]
    assert computing == ["aten.empty.memory_format", "aten._to_copy.default"], computing  # host buffer, one copy
    assert meta.tiles.device.type == "meta" and meta.tiles.untyped_storage() is meta.items.untyped_storage()


@needs_triton
@cpu_only
@pytest.mark.parametrize(("layout", "block_m"), [([(37, 1, 8), (100, 0, 9), (5, 3, 2), (0, 0, 1)], 16),
                                               ([(37, 2, 20), (300, 0, 9), (64, 1, 31)], 32),
                                               ([(37, 2, 40), (30, 1, 9)], 64)])  # > 32 rows: the default shape
def test_decode_tiles_for_steps_with_few_rows(layout, block_m):
    gen = torch.Generator().manual_seed(block_m)
    spec = make_spec(16, 2, 16, torch.float32)
    assert HSTUTritonBackend(spec).build_metadata(make_common(layout, 16, gen)).config.block_m == block_m
    for num_sms in (None, 64):  # default split-KV, and many short parts
        got, expected, scale = run_both(layout, spec, gen, num_sms=num_sms)
        assert_close(got, expected, scale, 1e-5)


@needs_triton
def test_reasons_unsupported(monkeypatch):
    monkeypatch.setattr(hstu_triton, "INTERPRETED", False)
    reasons = HSTUTritonBackend.reasons_unsupported(make_spec(16, 2, 16, torch.float32, device="cpu"))
    assert any("TRITON_INTERPRET=1" in r for r in reasons)
    assert HSTUTritonBackend.reasons_unsupported(make_spec(32, 4, 128, torch.bfloat16, device="cuda")) == []
    softmax = dataclasses.replace(make_spec(32, 4, 128, torch.bfloat16, device="cuda"), kind="softmax")
    assert HSTUTritonBackend.reasons_unsupported(softmax)
    assert BackendRegistry(load_entry_points=False).get("hstu_triton") is HSTUTritonBackend
    with pytest.raises(ValueError, match="block_n"):
        HSTUTritonBackend(make_spec(32, 4, 128, torch.bfloat16, device="cuda"), tiles=TileConfig(64, 16, 4, 1))


def test_importing_attention_backends_does_not_import_triton():
    code = "import sys, attention_backends; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


# ---- GPU: the compiled kernel at the benchmark's sizes ----------------------------------------------


@pytest.mark.parametrize(("layout", "num_sms"), [
    ([(16000, 256, 100)], None),  # delta queries over a long history: split-KV
    ([(16000, 256, 100), (4000, 0, 100), (0, 2048, 0), (9000, 17, 50), (0, 0, 100)], None),
    ([(0, 8192, 0)], None),  # full causal prefill
    ([(12345, 300, 100), (31, 1, 0)], 1000),  # many short split-KV parts
    ([(16000, 1, 8), (9000, 0, 9), (15000, 2, 7), (300, 1, 8)], None),  # decode tiles (16 rows) over 16k
    ([(12000, 4, 20), (5000, 0, 30), (31, 1, 0)], 1000),  # decode tiles (32 rows), many parts
])
@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_bf16_matches_reference(layout, num_sms):
    gen = torch.Generator().manual_seed(len(layout))
    got, expected, scale = run_both(layout, make_spec(32, 4, 128, torch.bfloat16), gen, num_sms=num_sms)
    assert_close(got, expected, scale, 1.5e-2)


@pytest.mark.parametrize("layout", [
    [(0, 8192, 0)],  # full causal prefill
    [(2000, 4, 100), (5000, 4, 100), (12500, 4, 100), (31, 1, 0)],  # serving: split-KV, candidates
])
@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_bf16_two_programs_per_sm(layout):
    """64 x 64 tiles over 4 warps, two programs an SM (as tile_sweep.py times them)."""
    gen = torch.Generator().manual_seed(len(layout) + 40)
    tiles = TileConfig(64, 64, 4, 3, programs_per_sm=2)
    got, expected, scale = run_both(layout, make_spec(32, 4, 128, torch.bfloat16), gen, tiles)
    assert_close(got, expected, scale, 1.5e-2)


@pytest.mark.parametrize(("dtype", "dim", "page_size", "rtol"), [
    (torch.float16, 128, 32, 3e-3), (torch.bfloat16, 64, 16, 1.5e-2), (torch.bfloat16, 256, 64, 1.5e-2),
    (torch.float32, 128, 32, 1e-4), (torch.float32, 256, 16, 1e-4),
])
@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_dtypes_and_shapes(dtype, dim, page_size, rtol):
    gen = torch.Generator().manual_seed(dim + page_size)
    layout = [*EDGE_BATCH, (3000, 200, 100), (0, 700, 30)]
    got, expected, scale = run_both(layout, make_spec(page_size, 4, dim, dtype), gen)
    assert_close(got, expected, scale, rtol)


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_build_metadata_is_one_copy_and_no_kernel():
    common = make_common([(16000, 1, 8)] * 8, 32, torch.Generator().manual_seed(0))
    backend = HSTUTritonBackend(make_spec(32, 4, 128, torch.bfloat16))
    backend.build_metadata(common)
    meta, device_events = cuda_activity(lambda: backend.build_metadata(common))
    assert len(device_events) == 1 and "HtoD" in device_events[0], device_events
    assert meta.config.block_m == 16 and meta.tiles.is_cuda


@pytest.mark.parametrize(("layout", "num_sms", "num_buckets"), [
    ([(8192, 256, 100)], None, 32),  # delta queries over an 8k history: split-KV
    ([(8000, 192, 64), (3000, 0, 100), (0, 1024, 0), (0, 0, 50)], None, 40),
    ([(0, 8192, 0)], None, 32),  # full causal prefill
    ([(8192, 1, 8), (7000, 0, 9), (8100, 2, 7)], None, 32),  # decode tiles (16 rows) over 8k
    ([(8190, 4, 20), (5000, 0, 30), (31, 1, 0)], 1000, 48),  # decode tiles (32 rows), many short parts
])
@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_bf16_time_bias_matches_reference(layout, num_sms, num_buckets):
    gen = torch.Generator().manual_seed(len(layout) + num_buckets)
    spec = with_time_bias(make_spec(32, 4, 128, torch.bfloat16), num_buckets)
    got, expected, scale = run_both(layout, spec, gen, num_sms=num_sms, times=random_times(layout, gen))
    assert_close(got, expected, scale, 1.5e-2)


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_time_bias_at_power_of_two_gaps():
    layout, times = gap_layout_and_times(40)
    layout, times = [*layout, (8000, 192, 8)], [*times, random_times([(8000, 192, 8)], torch.Generator())[0]]
    gen = torch.Generator().manual_seed(41)
    for dtype, rtol in ((torch.bfloat16, 1.5e-2), (torch.float32, 1e-4)):
        spec = with_time_bias(make_spec(32, 4, 128, dtype), 42)
        got, expected, scale = run_both(layout, spec, gen, times=times)
        assert_close(got, expected, scale, rtol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_steps_of_any_shape_share_one_compiled_kernel():
    """Per-step sizes and metadata offsets must not trigger Triton recompiles (seconds each, mid-serving)."""
    spec = make_spec(32, 4, 128, torch.bfloat16, "cuda")
    backend = HSTUTritonBackend(spec, tiles=TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=2))
    gen = torch.Generator().manual_seed(3)
    kernel = hstu_paged_attention_kernel

    def compiled() -> int:
        return sum(len(c[0]) for c in kernel.device_caches.values())

    before = compiled()  # earlier tests in this process compiled variants of their own
    variants = []
    for layout in ([(300, 40, 7)], [(0, 33, 0), (65, 1, 5)], [(1000, 5, 100)] * 3, [(17, 200, 3)] * 5,
                   [(4000, 64, 0), (31, 1, 1), (64, 0, 9), (2, 9, 2), (500, 77, 13), (96, 3, 0), (1, 1, 1)]):
        common, q, k, v, cache = make_batch(layout, spec, gen)
        meta = backend.build_metadata(common)
        backend.append_kv(cache, k, v, meta)
        backend.attend(q, k, v, cache, meta)
        variants.append(compiled() - before)
    torch.cuda.synchronize()
    assert variants[-1] <= 2, variants  # new variants: with and without split-KV partial buffers at most


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available() and not (HAS_TRITON and hstu_triton.INTERPRETED),
                    reason="needs CUDA or the interpreter")
@pytest.mark.parametrize("head_major_cache", [False, True])
def test_append_kernel_equals_indexed_writes(head_major_cache):
    from attention_backends.hstu_triton_kernels import append_rows
    from attention_backends.paged import write_appended

    gen = torch.Generator().manual_seed(4)
    heads, dim, page = 3, 16, 8
    shape = (12, 2, heads, page, dim) if head_major_cache else (12, 2, page, heads, dim)
    cache = torch.randn(shape, generator=gen).to(DEVICE)
    if head_major_cache:
        cache = cache.transpose(2, 3)
    qkv = torch.randn(9, 3, heads, dim, generator=gen).to(DEVICE)  # strided k/v views, as the model makes them
    key, value = qkv[:, 1], qkv[:, 2]
    rows = torch.tensor([8, 0, 2, 5, 6, 6, 6], dtype=torch.int32, device=DEVICE)  # rows 1, 3, 4, 7: not appended
    pages = torch.tensor([3, 3, 0, 11, 5, 5, 5], dtype=torch.int32, device=DEVICE)
    entries = torch.tensor([0, 7, 4, 2, 1, 1, 1], dtype=torch.int32, device=DEVICE)  # repeated: graph padding
    expected = cache.clone()
    write_appended(expected, key[rows.long()], value[rows.long()], pages.long(), entries.long())
    append_rows(cache, key, value, rows, pages, entries)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)
    # one row to two slots in a row: not a repeat (only an entry equal to the one before in row, page and entry is)
    rows, pages, entries = (torch.tensor(x, dtype=torch.int32, device=DEVICE)
                            for x in ([4, 4, 4], [1, 2, 2], [0, 0, 3]))
    write_appended(expected, key[rows.long()], value[rows.long()], pages.long(), entries.long())
    append_rows(cache, key, value, rows, pages, entries)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)
    # more rows than one program writes: 19 appends into distinct slots, rows in any order
    slots = torch.randperm(12 * page, generator=gen)[:19]
    rows = torch.randint(0, 9, (19,), generator=gen).to(DEVICE, torch.int32)
    pages, entries = (slots // page).to(DEVICE, torch.int32), (slots % page).to(DEVICE, torch.int32)
    write_appended(expected, key[rows.long()], value[rows.long()], pages.long(), entries.long())
    append_rows(cache, key, value, rows, pages, entries)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


@needs_triton
@cpu_only
def test_time_bias_same_with_32_and_64_bit_times():
    """A step spanning less than 2**31 time units gets int32 offsets; spreading its requests far apart in time
    (int64) changes no difference within a request, so no output."""
    gen = torch.Generator().manual_seed(9)
    layout = [(40, 9, 3), (0, 7, 2), (70, 1, 4)]
    spec = with_time_bias(make_spec(16, 2, 16, torch.float32), 40)
    near = [t - 1_700_000_000 for t in random_times(layout, gen)]
    near = [np.cumsum(np.minimum(np.diff(t, prepend=t[:1]), 2**20)) for t in near]  # span < 2**31
    far = [t + b * 2**40 for b, t in enumerate(near)]
    outputs = []
    for times in (near, far):
        common, q, k, v, cache = make_batch(layout, spec, torch.Generator().manual_seed(1), times=times)
        outputs.append((common.timestamps.keys.dtype, q, k, v, cache, common))
    assert [o[0] for o in outputs] == [torch.int32, torch.int64]
    backend = make_backend(spec, TileConfig(16, 32, 4, 1))
    table = torch.randn(40, 2, generator=gen)
    got = []
    for _, q, k, v, cache, common in outputs:
        meta = backend.build_metadata(common)
        backend.append_kv(cache, k, v, meta)
        got.append(backend.attend(q, k, v, cache, meta, time_bias=table))
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)
