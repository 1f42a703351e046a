"""``hstu_triton``'s tile plan written on the device inside the first layer's graph, for CUDA-graph replays, so the
host neither plans nor uploads it.

:func:`write_plan` writes exactly the padded host plan: same cuts, same float32 costs (no fused multiply-add), same
order. Per (plan, tile), in closed form: ``b`` key tiles in parts of ``p`` are ``b // p`` parts of ``p`` and one of
``b % p``; a plan's ``k``-th longest part is found by bisection. One program holds everything in registers, so only
small capacities (:func:`fits`) are planned here. Imports Triton.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .hstu_triton_plan import MAX_PROGRAMS_PER_SM, MAX_SPLITS, TileConfig

_MAX_ONE_HOT = 1 << 15  # most (item, tile) pairs one program holds at once
PLAN_WARPS = 32  # the one program's warps (fastest of 4-32 on the H200: benchmarks/results/plan_ab_b1ae0f4.json)
_LAST = tl.constexpr(1 << 62)  # sorts after every item


def fits(num_tiles: int, num_items: int, max_requests: int) -> bool:
    """Whether a key with these capacities can be planned on the device (one program's registers)."""
    return (triton.next_power_of_2(num_items) * triton.next_power_of_2(num_tiles) <= _MAX_ONE_HOT
            and triton.next_power_of_2(max_requests) * triton.next_power_of_2(num_tiles) <= _MAX_ONE_HOT)


@triton.jit
def _kth_longest(full, rem, part_len, k, bmax, entries, S: tl.constexpr):
    """Per plan (row): the ``k``-th longest (0-based) of its ``entries`` part lengths: ``full [S, T]`` parts of
    ``part_len`` and one of ``rem`` per tile, zeros for the rest. Bisection until every row's range is one value:
    ``log2(bmax + 2)`` steps (further steps would leave ``lo`` as it is: ``mid == lo`` is good)."""
    lo = tl.zeros([S], dtype=tl.int32)  # count(parts >= lo) > k always holds
    hi = tl.zeros([S], dtype=tl.int32) + bmax + 1  # count(parts >= hi) > k never holds
    while tl.max(hi - lo, 0) > 1:
        mid = (lo + hi) // 2
        at_least = tl.sum(full * (part_len >= mid[:, None]) + (rem >= mid[:, None]), 1)  # for mid >= 1
        good = tl.where(mid == 0, entries, at_least) > k
        lo, hi = tl.where(good, mid, lo), tl.where(good, hi, mid)
    return lo


@triton.jit
def _item_of(index, item_end, first_item, blocks, part_len, tiles, num_tiles, tile_mask):
    """For item ``index [I]``: its tile (clamped to the last), its part within the tile, and the part's length
    in key tiles (from the per-tile ``item_end``, ``first_item``, ``blocks``, ``part_len [T]``)."""
    before = (item_end[None, :] <= index[:, None]) & tile_mask[None, :]
    tile = tl.minimum(tl.sum(before.to(tl.int32), 1), num_tiles - 1)
    own = tiles[None, :] == tile[:, None]
    split = index - tl.sum(tl.where(own, first_item[None, :], 0), 1)
    length = tl.sum(tl.where(own, blocks[None, :], 0), 1)
    plen = tl.sum(tl.where(own, part_len[None, :], 0), 1)
    return tile, split, tl.minimum(length - split * plen, plen)


@triton.jit
def _plan_kernel(
    QueryStartLoc, NumHistory, SeqLens, Plan,
    MAX_REQUESTS: tl.constexpr, R_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES_CAP: tl.constexpr, T_P2: tl.constexpr, ITEMS_CAP: tl.constexpr, I_P2: tl.constexpr, MIN_ITEMS: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_SMS: tl.constexpr, OVERHEAD: tl.constexpr, MIN_TILES: tl.constexpr,
    RANK0: tl.constexpr, RANK1: tl.constexpr, S: tl.constexpr,
):
    """One program: ``Plan`` (int32 ``[5 * TILES_CAP + 2 * ITEMS_CAP]``) from the padded ``QueryStartLoc
    [MAX_REQUESTS + 1]``, ``NumHistory`` and ``SeqLens [MAX_REQUESTS]``; requests without rows are spare.
    ``R_P2``, ``T_P2``, ``I_P2``: powers of two >= MAX_REQUESTS, TILES_CAP, ITEMS_CAP."""
    b = tl.arange(0, R_P2)
    qsl = tl.load(QueryStartLoc + b, mask=b < MAX_REQUESTS, other=0)
    rows = tl.where(b < MAX_REQUESTS, tl.load(QueryStartLoc + b + 1, mask=b < MAX_REQUESTS, other=0) - qsl, 0)
    num_requests = tl.sum((rows > 0).to(tl.int32), 0)
    num_tiles = tl.minimum((tl.sum(rows, 0) + num_requests * (BLOCK_M - 1)) // BLOCK_M,
                           num_requests * ((tl.max(rows, 0) + BLOCK_M - 1) // BLOCK_M))
    num_items = tl.maximum(num_tiles, MIN_ITEMS)
    tiles_per_request = (rows + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles_per_request, 0)

    # Tiles: request, first row, key tiles visited (blocks).
    t = tl.arange(0, T_P2)
    tile_mask = t < num_tiles
    in_use = t < tl.sum(tiles_per_request, 0)
    real = b[None, :] < num_requests
    req = tl.maximum(tl.minimum(tl.sum(((tile_end[None, :] <= t[:, None]) & real).to(tl.int32), 1),
                                num_requests - 1), 0)
    tile_start = tl.sum(tl.where((b[None, :] < req[:, None]) & real, tiles_per_request[None, :], 0), 1)
    first = (t - tile_start) * BLOCK_M
    req_qsl = tl.load(QueryStartLoc + req, mask=tile_mask, other=0)
    req_rows = tl.load(QueryStartLoc + req + 1, mask=tile_mask, other=0) - req_qsl
    seq = tl.load(SeqLens + req, mask=tile_mask, other=0)
    last_limit = seq - tl.load(NumHistory + req, mask=tile_mask, other=0) + tl.minimum(first + BLOCK_M, req_rows)
    blocks = (tl.where(in_use, tl.minimum(last_limit, seq), 0) + BLOCK_N - 1) // BLOCK_N

    # Plans s = 1..S parts of the longest tile, as plan_tile_map, costed in closed form per (plan, tile).
    s = tl.arange(0, S)
    bmax = tl.max(blocks, 0)
    max_part = tl.maximum((bmax + s) // (s + 1), MIN_TILES)
    previous = tl.maximum((bmax + s - 1) // tl.maximum(s, 1), MIN_TILES)
    parts = tl.where(in_use[None, :], tl.maximum((blocks[None, :] + max_part[:, None] - 1) // max_part[:, None], 1), 0)
    part_len = (blocks[None, :] + tl.maximum(parts, 1) - 1) // tl.maximum(parts, 1)
    items = tl.sum(parts, 1)
    ok = (items <= num_items) & ((s == 0) | (max_part != previous))
    columns = tl.minimum(tl.max(tl.where(ok, tl.max(parts, 1), 0), 0) + 1, S)
    entries = num_tiles * columns
    full = blocks[None, :] // tl.maximum(part_len, 1)
    rem = blocks[None, :] - full * part_len
    longest = tl.max(part_len, 1)
    near = (3 * longest + 3) // 4
    near_longest = tl.sum(full * (part_len >= near[:, None]) + (rem >= near[:, None]), 1)  # for near >= 1
    near_longest = tl.where(near == 0, entries, near_longest)
    waves = (near_longest * NUM_HEADS + NUM_SMS - 1) // NUM_SMS
    pair = (_kth_longest(full, rem, part_len, tl.minimum(RANK0, entries - 1), bmax, entries, S)
            + _kth_longest(full, rem, part_len, tl.minimum(RANK1, entries - 1), bmax, entries, S))
    bound = tl.maximum(waves * longest, pair).to(tl.float32)
    work = tl.math.div_rn((tl.sum(blocks, 0) * NUM_HEADS).to(tl.float32), tl.full([], NUM_SMS, tl.float32))
    cost = tl.maximum(bound, work) + OVERHEAD * items.to(tl.float32)
    best = tl.argmin(tl.where(ok, cost, float("inf")), 0)
    chosen = (s == best)[:, None]
    splits = tl.sum(tl.where(chosen, parts, 0), 0)
    best_len = tl.sum(tl.where(chosen, part_len, 0), 0)
    item_end = tl.cumsum(splits, 0)
    first_item = item_end - splits

    to_tiles = t < TILES_CAP
    tl.store(Plan + t, tl.where(in_use & tile_mask, req, -1), mask=to_tiles)
    tl.store(Plan + TILES_CAP + t, tl.where(tile_mask, first, 0), mask=to_tiles)
    tl.store(Plan + 2 * TILES_CAP + t, tl.where(tile_mask, splits, 0), mask=to_tiles)
    tl.store(Plan + 3 * TILES_CAP + t, tl.where(tile_mask, first_item, 0), mask=to_tiles)
    tl.store(Plan + 4 * TILES_CAP + t, tl.where(tile_mask, best_len * BLOCK_N, 0), mask=to_tiles)

    # Items: longest first (stable), spare items after; recomputed for the sorted order.
    i = tl.arange(0, I_P2)
    num_used = tl.sum(splits, 0)
    _, _, length = _item_of(i, item_end, first_item, blocks, best_len, t, num_tiles, tile_mask)
    key = tl.where(i < num_used, -1 - length, 1).to(tl.int64) + (1 << 30)
    order = (tl.sort(tl.where(i < num_items, key * I_P2 + i, _LAST), 0) % I_P2).to(tl.int32)
    tile, split, _ = _item_of(order, item_end, first_item, blocks, best_len, t, num_tiles, tile_mask)
    valid = (i < num_items) & (num_tiles > 0)
    tl.store(Plan + 5 * TILES_CAP + i, tl.where(valid & (order < num_used), tile, -1), mask=i < ITEMS_CAP)
    tl.store(Plan + 5 * TILES_CAP + ITEMS_CAP + i, tl.where(valid, split, 0), mask=i < ITEMS_CAP)


def write_plan(plan: torch.Tensor, query_start_loc: torch.Tensor, num_history_rows: torch.Tensor,
               kv_seq_lens: torch.Tensor, tiles: TileConfig, num_tiles: int, num_items: int, num_heads: int,
               num_sms: int, overhead_keys: int, min_tiles_per_split: int) -> None:
    """Write a step's padded tile plan into int32 ``plan [5 * num_tiles + 2 * num_items]`` (laid out as
    :func:`~.hstu_triton_plan.padded_plan`; check :func:`fits` first) on the current stream, graph-capturable.
    ``query_start_loc [B + 1]``, ``num_history_rows [B]``, ``kv_seq_lens [B]``: int32, spare requests (after the
    real ones) without rows; the rest as for ``plan_tile_map``."""
    constants = plan_constants(num_history_rows.shape[0], tiles, num_tiles, num_items, num_heads, num_sms,
                               overhead_keys, min_tiles_per_split)
    # Costs round each product and sum as numpy does: no fused multiply-adds.
    _plan_kernel[(1,)](query_start_loc, num_history_rows, kv_seq_lens, plan, **constants, num_warps=PLAN_WARPS,
                       enable_fp_fusion=False)


def plan_constants(max_requests: int, tiles: TileConfig, num_tiles: int, num_items: int, num_heads: int,
                   num_sms: int, overhead_keys: int, min_tiles_per_split: int) -> dict[str, int | float]:
    """The plan kernel's ``tl.constexpr`` arguments for a key's capacities (as :func:`write_plan`'s)."""
    return dict(
        MAX_REQUESTS=max_requests, R_P2=triton.next_power_of_2(max_requests), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, TILES_CAP=num_tiles, T_P2=triton.next_power_of_2(num_tiles), ITEMS_CAP=num_items,
        I_P2=triton.next_power_of_2(num_items), MIN_ITEMS=-(-MAX_PROGRAMS_PER_SM * num_sms // num_heads),
        NUM_HEADS=num_heads, NUM_SMS=num_sms,
        OVERHEAD=float(np.float32(overhead_keys / tiles.block_n * num_heads / num_sms)),
        MIN_TILES=min_tiles_per_split, RANK0=(num_sms - 1) // num_heads, RANK1=num_sms // num_heads, S=MAX_SPLITS,
    )
