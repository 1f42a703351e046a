"""``hstu_triton``'s tile plan of a large uncut eager step, written on the device, so the host plans nothing.

When :func:`~.hstu_triton_plan.uncut_sizes` says :func:`~.hstu_triton_plan.plan_tile_map` would plan a step uncut,
every query tile is one work item over its whole key range, and the plan is a closed form of the per-request
numbers: request ``b`` has ``ceil(rows_b / block_m)`` tiles, tile ``j`` visiting ``L = ceil(min(seq_b - hist_b +
min((j + 1) block_m, rows_b), seq_b) / block_n)`` key tiles, nondecreasing in ``j``. Items are the tiles longest
first, ties in tile order (``plan_tile_map``'s stable sort), without a sort: a tile's place is the count of tiles
visiting more key tiles than it plus the equally long ones before it, each counted per request in closed form
(:func:`~.hstu_triton_plan.count_at_most`). :func:`_uncut_plan_kernel` writes exactly ``plan_tile_map``'s arrays,
spare slots included, from the device's ``query_start_loc``, ``num_history_rows`` and ``kv_seq_lens``, in programs
of :data:`_TILES` tiles that read the requests :data:`_REQUESTS` at a time (any step size, one compiled kernel).

Imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .base import PagedBatchMetadata
from .hstu_triton_plan import TileConfig

_TILES = 128  # tiles (or item slots) per program
_REQUESTS = 16  # requests read at once


@triton.jit
def _at_most(blocks, tiles, hist, seq, block_m, block_n):
    """:func:`~.hstu_triton_plan.count_at_most` per (tile, request): int32 ``blocks [T, 1]`` key tiles; ``tiles``,
    ``hist``, ``seq`` ``[1, R]`` per request (its tile count, new history rows, history length)."""
    limit = blocks * block_n
    within = tl.minimum(tl.maximum(limit - seq + hist, 0) // block_m, tiles)
    return tl.where(seq <= limit, tiles, within)


@triton.jit(do_not_specialize=["QueryStartLoc", "NumHistory", "SeqLens", "Tiles", "Items", "num_requests",
                               "num_tiles", "num_items", "block_m", "block_n"])
def _uncut_plan_kernel(QueryStartLoc, NumHistory, SeqLens, Tiles, Items, num_requests, num_tiles, num_items,
                       block_m, block_n, TILES: tl.constexpr, REQUESTS: tl.constexpr):
    """Program ``p``: tiles and item slots ``p * TILES ...`` of the plan (:func:`write_uncut_plan`)."""
    t = tl.program_id(0) * TILES + tl.arange(0, TILES)
    zero = tl.zeros([TILES], dtype=tl.int32)
    req, j, rows, hist, seq = zero, zero, zero, zero, zero
    used = tl.sum(zero, 0)  # tiles in use (before spare slots), counted over the requests
    for start in range(0, num_requests, REQUESTS):  # each tile's request: the one whose tile range holds it
        b = start + tl.arange(0, REQUESTS)
        real = b < num_requests
        first_row = tl.load(QueryStartLoc + b, mask=real, other=0)
        b_rows = tl.load(QueryStartLoc + b + 1, mask=real, other=0) - first_row
        b_tiles = (b_rows + block_m - 1) // block_m
        end = used + tl.cumsum(b_tiles, 0)
        owns = ((end - b_tiles)[None, :] <= t[:, None]) & (t[:, None] < end[None, :])
        req += tl.sum(tl.where(owns, b[None, :], 0), 1)
        j += tl.sum(tl.where(owns, t[:, None] - (end - b_tiles)[None, :], 0), 1)
        rows += tl.sum(tl.where(owns, b_rows[None, :], 0), 1)
        hist += tl.sum(tl.where(owns, tl.load(NumHistory + b, mask=real, other=0)[None, :], 0), 1)
        seq += tl.sum(tl.where(owns, tl.load(SeqLens + b, mask=real, other=0)[None, :], 0), 1)
        used += tl.sum(b_tiles, 0)
    in_use = t < used
    limit = tl.minimum(seq - hist + tl.minimum(j * block_m + block_m, rows), seq)
    blocks = tl.where(in_use, (limit + block_n - 1) // block_n, 0)

    place = j  # the tile's place among the items: equally long tiles of its own request before it, then the rest
    for start in range(0, num_requests, REQUESTS):
        b = start + tl.arange(0, REQUESTS)
        real = b < num_requests
        first_row = tl.load(QueryStartLoc + b, mask=real, other=0)
        b_tiles = ((tl.load(QueryStartLoc + b + 1, mask=real, other=0) - first_row + block_m - 1) // block_m)[None, :]
        b_hist = tl.load(NumHistory + b, mask=real, other=0)[None, :]
        b_seq = tl.load(SeqLens + b, mask=real, other=0)[None, :]
        at_most = _at_most(blocks[:, None], b_tiles, b_hist, b_seq, block_m, block_n)
        shorter = _at_most(blocks[:, None] - 1, b_tiles, b_hist, b_seq, block_m, block_n)
        before = b[None, :] < req[:, None]  # equally long tiles of earlier requests come first
        own = b[None, :] == req[:, None]  # of its own request, those before it: j - shorter
        place += tl.sum(b_tiles - at_most + tl.where(before, at_most - shorter, 0) - tl.where(own, shorter, 0), 1)

    # Spare tiles (past the used ones) as plan_tile_map leaves them: request -1, the first row they would have in
    # the last request, no parts, their first item slot after the used ones.
    last_rows = tl.load(QueryStartLoc + num_requests + zero) - tl.load(QueryStartLoc + num_requests - 1 + zero)
    spare_first = (t - used + (last_rows + block_m - 1) // block_m) * block_m
    is_tile = t < num_tiles
    tl.store(Tiles + t, tl.where(in_use, req, -1), mask=is_tile)
    tl.store(Tiles + num_tiles + t, tl.where(in_use, j * block_m, spare_first), mask=is_tile)
    tl.store(Tiles + 2 * num_tiles + t, in_use.to(tl.int32), mask=is_tile)
    tl.store(Tiles + 3 * num_tiles + t, tl.where(in_use, t, used), mask=is_tile)
    tl.store(Tiles + 4 * num_tiles + t, blocks * block_n, mask=is_tile)
    tl.store(Items + place, t, mask=in_use)
    tl.store(Items + num_items + place, zero, mask=in_use)
    # Spare item slots keep their order after the used ones: tile -1, part counted from the last tile's first slot.
    spare = (t >= used) & (t < num_items)
    last_first_item = tl.where(zero + num_tiles > used, used, used - 1)
    tl.store(Items + t, zero - 1, mask=spare)
    tl.store(Items + num_items + t, t - last_first_item, mask=spare)


class UncutPlanWriter:
    """Writes the plans of uncut eager steps on the device (:attr:`HSTUTritonBackend.uncut_plan
    <.hstu_triton.HSTUTritonBackend.uncut_plan>`; the host-overhead probe's stand-in launches nothing)."""

    def write(self, common: PagedBatchMetadata, tiles: TileConfig, num_tiles: int, num_items: int) -> torch.Tensor:
        """A new int32 ``[5 * num_tiles + 2 * num_items]`` buffer on ``common``'s device (``tiles [5, num_tiles]``,
        then ``items [2, num_items]``, row-major, as :func:`~.hstu_triton_plan.plan_tile_map` returns them for this
        step; ``num_tiles``, ``num_items`` from :func:`~.hstu_triton_plan.uncut_sizes`) and the queued kernel that
        fills it from ``common``'s int32 ``query_start_loc [B + 1]``, ``num_history_rows``, ``kv_seq_lens [B]``."""
        plan = torch.empty(5 * num_tiles + 2 * num_items, dtype=torch.int32, device=common.query_start_loc.device)
        _uncut_plan_kernel[(triton.cdiv(num_items, _TILES),)](
            common.query_start_loc, common.num_history_rows, common.kv_seq_lens, plan, plan[5 * num_tiles:],
            common.num_requests, num_tiles, num_items, tiles.block_m, tiles.block_n, TILES=_TILES,
            REQUESTS=_REQUESTS, num_warps=4)
        return plan
