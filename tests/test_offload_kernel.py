"""The offload kernel (:mod:`cache_engine.offload_kernel`) against plain indexing and the copy path's
quantisation: chunks of pool pages written into their slots (at the addresses given), exact, and FP8 with the
same scales and values. CPU runs it in Triton's interpreter (``TRITON_INTERPRET=1`` set before the module
imports Triton)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def chunk_pages(gen: torch.Generator, pool_pages: int, slot_pages: int, lengths: list[int]) -> torch.Tensor:
    """int64 ``[J * slot_pages]``: distinct random pool pages per chunk, partial chunks padded with -1 (gaps)."""
    picked = torch.randperm(pool_pages, generator=gen)[: sum(lengths)].tolist()
    rows = []
    for n in lengths:
        row, picked = picked[:n], picked[n:]
        rows += row + [-1] * (slot_pages - n)
    return torch.tensor(rows)


def addresses(out: torch.Tensor) -> torch.Tensor:
    """int64 ``[J]``: the address of each chunk ``out[j]`` (slot-shaped), as the kernel takes its destinations."""
    return torch.tensor([out[j].data_ptr() for j in range(len(out))], device=out.device)


@pytest.mark.parametrize("pinned_indices", [False, True])
@pytest.mark.parametrize("heads,dim,page", [(2, 16, 4), (3, 8, 2), (1, 32, 8)])
def test_chunks_are_gathered_into_slot_layout_exactly(heads, dim, page, pinned_indices):
    """With ``pinned_indices`` (CUDA), the kernel reads its index arrays from pinned host memory, as the transfer
    engine gives them."""
    from cache_engine.offload_kernel import ChunkPacker

    if pinned_indices and DEVICE != "cuda":
        pytest.skip("pinned host memory needs CUDA")

    gen = torch.Generator().manual_seed(0)
    layers, pool_pages, slot_pages = 3, 30, 4
    kv = torch.randn(layers, pool_pages, 2, page, heads, dim, generator=gen).to(DEVICE)
    pages = chunk_pages(gen, pool_pages, slot_pages, [4, 1, 3])
    out = torch.full((3, layers, slot_pages, 2, page, heads, dim), float("nan"), device=DEVICE)
    order = [2, 0, 1]  # chunk j goes to slot order[j]: each chunk's own address is used
    out_addr = addresses(out)[order]
    if pinned_indices:
        pages_arg, out_addr = pages.pin_memory(), out_addr.cpu().pin_memory()
    else:
        pages_arg = pages.to(DEVICE)
    ChunkPacker()(kv, pages_arg, out_addr, out.dtype, slot_pages)
    expected = kv.cpu()[:, pages].view(layers, 3, slot_pages, 2, page, heads, dim).transpose(0, 1)
    gaps = (pages < 0).view(3, slot_pages)
    expected[gaps.nonzero(as_tuple=True)[0], :, gaps.nonzero(as_tuple=True)[1]] = float("nan")  # never written
    torch.testing.assert_close(out.cpu()[order], expected, rtol=0, atol=0, equal_nan=True)


def test_fp8_chunks_match_the_copy_paths_quantisation():
    """Values and scales as the copy path's :func:`cache_engine.fp8.quantize` computes them; other slots' scales
    untouched."""
    from cache_engine.fp8 import quantize
    from cache_engine.offload_kernel import ChunkPacker

    gen = torch.Generator().manual_seed(1)
    layers, pool_pages, slot_pages, page, heads, dim = 2, 24, 3, 4, 2, 16
    kv = torch.randn(layers, pool_pages, 2, page, heads, dim, generator=gen)
    kv[1, :, 1, :, 0] *= 300.0  # one (layer, V, head) far larger: its own scale
    kv[0, :, 0, :, 1] = 0.0  # an all-zero (layer, K, head): the smallest scale, zeros out
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the interpreter's bf16 casts differ from torch's
    kv = kv.to(dtype)
    pages = chunk_pages(gen, pool_pages, slot_pages, [3, 2])
    slot_ids, tokens = torch.tensor([4, 1]), torch.tensor([3 * page, 2 * page - 1])  # the second ends mid-page
    scales = torch.full((6, layers, 2, heads), -1.0)
    expected_scales = scales.clone()
    last = torch.stack([row.where(row >= 0, row[row >= 0][-1]) for row in pages.view(2, slot_pages)]).view(-1)
    chunks = kv[:, last].view(layers, 2, slot_pages, 2, page, heads, dim).transpose(0, 1)  # the copy path's padding
    expected = quantize(chunks, tokens, expected_scales, slot_ids)
    got_scales = scales.to(DEVICE)
    # The interpreter's FP8 cast is not torch's (it rounds values just below a power of two down to half of it):
    # there, the scaled values before the cast are compared, in float32.
    out = torch.zeros((2, layers, slot_pages, 2, page, heads, dim), dtype=FP8 if DEVICE == "cuda" else torch.float32,
                      device=DEVICE)
    ChunkPacker()(kv.to(DEVICE), pages.to(DEVICE), addresses(out), out.dtype, slot_pages, slot_ids.to(DEVICE),
                  got_scales, tokens=tokens.to(DEVICE))
    torch.testing.assert_close(got_scales.cpu(), expected_scales, rtol=0, atol=0)
    if DEVICE != "cuda":
        own = chunks.clone()
        own[1, :, 1, :, page - 1] = 0  # the second chunk's last token slot is not its own
        expected = own.float() / expected_scales[slot_ids][:, :, None, :, None, :, None]
    for j, written in enumerate(pages.view(2, slot_pages) >= 0):  # a partial chunk's gap stays as it was (zero)
        torch.testing.assert_close(out.cpu().float()[j][:, written], expected.float()[j][:, written], rtol=0, atol=0)
        assert not out.cpu().float()[j][:, ~written].any()
    assert (~(pages.view(2, slot_pages) >= 0)).any()  # the test has a gap
    assert (out.cpu().float()[:, 0, :, 0, :, 1] == 0).all()  # the all-zero head stays zero
    assert (got_scales.cpu()[[0, 2, 3, 5]] == -1).all()


def test_scales_need_slot_ids_and_tokens():
    from cache_engine.offload_kernel import ChunkPacker

    kv = torch.zeros(1, 4, 2, 2, 1, 8, device=DEVICE)
    out = torch.empty((1, 1, 2, 2, 2, 1, 8), dtype=FP8, device=DEVICE)
    index = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="slot_ids and tokens"):
        ChunkPacker()(kv, index, addresses(out), FP8, 2, None, torch.ones(1, 1, 2, 1, device=DEVICE), tokens=index[:1])
    with pytest.raises(ValueError, match="slot_ids and tokens"):
        ChunkPacker()(kv, index, addresses(out), FP8, 2, index[:1], torch.ones(1, 1, 2, 1, device=DEVICE))


def test_one_packer_serves_several_slot_shapes():
    """A packer keeps each pool shape's launch constants: reused for chunks of 4, then 2, then 4 pages, each launch
    gathers its own slots exactly (constants kept for the wrong shape would misplace pages)."""
    from cache_engine.offload_kernel import ChunkPacker

    gen = torch.Generator().manual_seed(3)
    packer = ChunkPacker()
    kv = torch.randn(2, 12, 2, 4, 1, 8, generator=gen).to(DEVICE)
    for slot_pages in (4, 2, 4):
        pages = chunk_pages(gen, 12, slot_pages, [slot_pages, slot_pages])
        out = torch.zeros((2, 2, slot_pages, 2, 4, 1, 8), device=DEVICE)
        packer(kv, pages.to(DEVICE), addresses(out), out.dtype, slot_pages)
        expected = kv.cpu()[:, pages].view(2, 2, slot_pages, 2, 4, 1, 8).transpose(0, 1)
        torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)


def test_fp8_scales_and_values_ignore_what_a_reused_page_holds_past_the_chunks_tokens():
    """A tail chunk's last page keeps its previous owner's rows after the chunk's tokens: huge values there change
    neither the scales nor the stored values (those rows are stored as zeros), so a user's FP8 host copy does not
    depend on who held its pages before."""
    from cache_engine.offload_kernel import ChunkPacker

    gen = torch.Generator().manual_seed(4)
    layers, pool_pages, slot_pages, page, heads, dim = 2, 10, 3, 4, 2, 16
    pages, tokens = torch.tensor([5, 2, -1, 7, 1, 3]), torch.tensor([2 * page - 3, 3 * page])
    clean = torch.randn(layers, pool_pages, 2, page, heads, dim, generator=gen)
    clean[:, 2, :, page - 3:] = 0  # chunk 0's page 2 past its tokens
    stale = clean.clone()
    stale[:, 2, :, page - 3:] = 1e4 * torch.rand(layers, 2, 3, heads, dim, generator=gen)
    out_dtype = FP8 if DEVICE == "cuda" else torch.float32  # the interpreter's FP8 cast is not torch's
    results = []
    for kv in (clean, stale):
        scales = torch.zeros(2, layers, 2, heads, device=DEVICE)
        out = torch.full((2, layers, slot_pages, 2, page, heads, dim), 7.0, device=DEVICE).to(out_dtype)
        ChunkPacker()(kv.to(DEVICE), pages.to(DEVICE), addresses(out), out_dtype, slot_pages,
                      torch.tensor([1, 0], device=DEVICE), scales, tokens=tokens.to(DEVICE))
        results.append((scales.cpu(), out.cpu().float()))
    (clean_scales, clean_out), (stale_scales, stale_out) = results
    assert (stale[:, 2].abs().amax() > 1e3) and (clean_scales.amax() < 1.0)  # the stale rows would dominate
    torch.testing.assert_close(stale_scales, clean_scales, rtol=0, atol=0)
    torch.testing.assert_close(stale_out[:, :, :2], clean_out[:, :, :2], rtol=0, atol=0)
    assert (stale_out[0, :, 1, :, page - 3:] == 0).all()  # rows past the tokens: zeros
    assert (stale_out[0, :, 2] == 7).all()  # the gap: not written
