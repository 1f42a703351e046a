"""``hstu_triton`` against the ``torch_ref`` oracle on randomly built paged batches.

CPU tests run the kernel in Triton's interpreter (``TRITON_INTERPRET=1``, set here before the backend
module is imported, only when CUDA is unavailable) on tiny shapes in float32; ``gpu`` tests run the
compiled kernel at the benchmark's sizes (4 heads x 128, bf16, histories up to 16k, page size 32).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():  # the interpreter; the kernels read this when their module is imported
    os.environ["TRITON_INTERPRET"] = "1"

from attention_backends import AttentionSpec, BackendRegistry, PagedBatchMetadata
from attention_backends.torch_ref import TorchRefBackend

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    import attention_backends.hstu_triton as hstu_triton
    from attention_backends.hstu_triton import HSTUTritonBackend, TileConfig, build_tile_map

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


def segments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segment lengths ``counts [B]``: each element's segment and its offset inside it (int64)."""
    owner = torch.repeat_interleave(torch.arange(len(counts)), counts)
    starts = torch.cumsum(counts, 0) - counts
    return owner, torch.arange(len(owner)) - starts[owner]


def make_batch(layout: list[tuple[int, int, int]], spec: AttentionSpec, gen: torch.Generator, spare_pages: int = 3,
               head_major_cache: bool = False):
    """A paged batch: common metadata, fused-projection q/k/v views ``[T, H, D]`` and a cache whose
    history before this step is filled and whose every other slot is NaN, pages shuffled."""
    page, heads, dim, dtype = spec.page_size, spec.num_heads, spec.head_dim, spec.dtype
    cached = torch.tensor([c for c, _, _ in layout])
    hist = torch.tensor([h for _, h, _ in layout])
    cand = torch.tensor([c for _, _, c in layout])
    seq_lens = cached + hist
    num_pages = (seq_lens + page - 1) // page
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(num_pages, 0)])
    pool = int(indptr[-1]) + spare_pages
    indices = torch.randperm(pool, generator=gen)[: int(indptr[-1])]
    last = torch.where(num_pages > 0, seq_lens - (num_pages - 1) * page, 0)
    rows = hist + cand
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(rows, 0)])
    hist_owner, hist_within = segments(hist)
    cand_owner, cand_within = segments(cand)
    i32 = {"dtype": torch.int32, "device": spec.device_type}
    common = PagedBatchMetadata(
        query_start_loc=qsl.to(**i32), num_history_rows=hist.to(**i32), num_candidate_rows=cand.to(**i32),
        kv_indptr=indptr.to(**i32), kv_indices=indices.to(**i32), kv_last_page_len=last.to(**i32),
        kv_seq_lens=seq_lens.to(**i32), append_batch_indices=hist_owner.to(**i32),
        append_positions=(cached[hist_owner] + hist_within).to(**i32),
        history_rows=(qsl[hist_owner] + hist_within).to(**i32),
        candidate_rows=(qsl[cand_owner] + hist[cand_owner] + cand_within).to(**i32),
        candidate_batch_indices=cand_owner.to(**i32), page_size=page,
        max_query_len=int(rows.max()), max_kv_len=int(seq_lens.max()), max_pages=int(num_pages.max()),
    )
    total = int(qsl[-1])
    qkv = torch.randn(total, 3, heads, dim, generator=gen).to(device=spec.device_type, dtype=dtype)
    shape = (pool, 2, heads, page, dim) if head_major_cache else (pool, 2, page, heads, dim)
    cache = torch.full(shape, float("nan"), dtype=dtype, device=spec.device_type)
    if head_major_cache:
        cache = cache.transpose(2, 3)  # NHD view of HND storage: exercises the stride handling
    # History cached before this step: position p of request b lives in page indices[indptr[b] + p // page].
    owner, pos = segments(cached)
    slot_page = indices[indptr[owner] + pos // page].to(spec.device_type)
    old = torch.randn(len(owner), 2, heads, dim, generator=gen).to(device=spec.device_type, dtype=dtype)
    cache[slot_page, :, (pos % page).to(spec.device_type)] = old
    return common, qkv[:, 0], qkv[:, 1], qkv[:, 2], cache


def run_both(layout, spec, gen, tiles=None, num_sms=None, head_major_cache=False):
    """Append + attend with both backends; returns (hstu_triton output, torch_ref output, output scale).
    ``num_sms`` overrides the processor count that split-KV plans for (more: more, shorter parts)."""
    common, q, k, v, cache = make_batch(layout, spec, gen, head_major_cache=head_major_cache)
    hist_rows = common.history_rows.long()
    ref, ref_cache = TorchRefBackend(spec), cache.clone()
    ref_meta = ref.build_metadata(common)
    ref.append_kv(ref_cache, k[hist_rows], v[hist_rows], ref_meta)
    # NaN slots are never valid keys; the oracle multiplies its masked-out weights by them, so give it zeros.
    expected = ref.attend(q, k, v, torch.nan_to_num(ref_cache, nan=0.0), ref_meta)

    backend = HSTUTritonBackend(spec, tiles=tiles)
    meta = backend.build_metadata(common)
    if num_sms is not None:
        meta = build_tile_map(common, backend.tiles, spec.num_heads, num_sms, overhead_keys=0, min_tiles_per_split=1)
    backend.append_kv(cache, k[hist_rows], v[hist_rows], meta)
    assert torch.equal(cache.nan_to_num(0.0), ref_cache.nan_to_num(0.0))
    got = backend.attend(q, k, v, cache, meta)
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
def test_float16_on_interpreter():
    # Not bf16: Triton 3.6's interpreter computes bf16 tl.dot wrongly; the gpu tests cover bf16.
    gen = torch.Generator().manual_seed(7)
    spec = make_spec(16, 2, 16, torch.float16)
    got, expected, scale = run_both(EDGE_BATCH, spec, gen, TileConfig(16, 16, 4, 1), num_sms=32)
    assert_close(got, expected, scale, 3e-3)


@needs_triton
@cpu_only
def test_default_tiles_and_page_size_64():
    gen = torch.Generator().manual_seed(11)
    spec = make_spec(64, 1, 16, torch.float32)
    backend = HSTUTritonBackend(spec)
    assert backend.tiles.block_n % 64 == 0
    got, expected, scale = run_both([(70, 3, 2), (0, 0, 2), (64, 1, 1)], spec, gen)
    assert_close(got, expected, scale, 1e-5)


@needs_triton
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_sms", [1, 8, 100])
def test_tile_map_covers_every_row_and_key_range_once(seed, num_sms):
    gen = torch.Generator().manual_seed(seed)
    spec = make_spec(16, 2, 16, torch.float32)
    layout = EDGE_BATCH if seed == 0 else random_layout(gen, 6, 300, 100, 10)
    common = make_batch(layout, spec, gen)[0]
    tiles = TileConfig(16, 16, 4, 1)
    meta = build_tile_map(common, tiles, spec.num_heads, num_sms, overhead_keys=0, min_tiles_per_split=1)
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


class _NoDeviceSync(TorchDispatchMode):
    """Fails on ops that synchronise a CUDA device with the host (reading a value, uploading host data)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func not in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default), func
        return func(*args, **(kwargs or {}))


@needs_triton
@cpu_only
def test_no_device_sync_in_build_metadata_or_attend():
    spec = make_spec(16, 2, 16, torch.float32)
    common, q, k, v, cache = make_batch(EDGE_BATCH, spec, torch.Generator().manual_seed(5))
    backend = HSTUTritonBackend(spec, tiles=TileConfig(16, 16, 4, 1))
    cache = cache.nan_to_num(0.0)
    with _NoDeviceSync():
        backend.attend(q, k, v, cache, backend.build_metadata(common))
        split = build_tile_map(common, backend.tiles, spec.num_heads, 64, overhead_keys=0, min_tiles_per_split=1)
        backend.attend(q, k, v, cache, split)
    assert int(split.tiles[2].max()) > 1  # the split path ran too


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


@pytest.mark.parametrize(
    ("layout", "num_sms"),
    [
        ([(16000, 256, 100)], None),  # delta queries over a long history: split-KV
        ([(16000, 256, 100), (4000, 0, 100), (0, 2048, 0), (9000, 17, 50), (0, 0, 100)], None),
        ([(0, 8192, 0)], None),  # full causal prefill
        ([(12345, 300, 100), (31, 1, 0)], 1000),  # many short split-KV parts
    ],
)
@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_bf16_matches_reference(layout, num_sms):
    gen = torch.Generator().manual_seed(len(layout))
    got, expected, scale = run_both(layout, make_spec(32, 4, 128, torch.bfloat16), gen, num_sms=num_sms)
    assert_close(got, expected, scale, 1.5e-2)


@pytest.mark.parametrize(
    ("dtype", "dim", "page_size", "rtol"),
    [
        (torch.float16, 128, 32, 3e-3),
        (torch.bfloat16, 64, 16, 1.5e-2),
        (torch.bfloat16, 256, 64, 1.5e-2),
        (torch.float32, 128, 32, 1e-4),
        (torch.float32, 256, 16, 1e-4),
    ],
)
@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_dtypes_and_shapes(dtype, dim, page_size, rtol):
    gen = torch.Generator().manual_seed(dim + page_size)
    layout = [*EDGE_BATCH, (3000, 200, 100), (0, 700, 30)]
    got, expected, scale = run_both(layout, make_spec(page_size, 4, dim, dtype), gen)
    assert_close(got, expected, scale, rtol)
