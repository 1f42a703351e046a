"""Host-side planning for ``hstu_triton`` (numpy, no Triton): launch shapes and the split-KV tile map."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .base import AttentionSpec

# Split-KV: at most MAX_SPLITS parts per tile, MAX_PROGRAMS_PER_SM (item, head) pairs per processor (this
# sizes the partial buffer), parts of at least MIN_TILES_PER_SPLIT key tiles; each program costs as much
# time as SPLIT_OVERHEAD_KEYS keys (prologue, partial write and read; 640 lies on the measured plateau,
# benchmarks/results/README.md).
MAX_SPLITS, MAX_PROGRAMS_PER_SM, MIN_TILES_PER_SPLIT, SPLIT_OVERHEAD_KEYS = 32, 4, 4, 640


@dataclass(frozen=True)
class TileConfig:
    """Launch shape: ``block_m`` query rows and ``block_n`` keys (a multiple of the page size) per step, powers of
    two >= 16; ``num_warps`` per program; ``num_stages`` of key-loop pipelining; ``programs_per_sm`` programs of the
    persistent grid on each SM at once (the grid and the split-KV plan count ``SMs * programs_per_sm`` processors;
    more than 1 only where the compiled kernel's registers and shared memory let that many share an SM, else the
    extra programs wait for a free SM and the plan's estimate is off)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1


def default_tile_config(spec: AttentionSpec, max_query_len: int | None = None) -> TileConfig:
    """Launch shape for ``spec`` (any valid one is correct); with ``max_query_len <= 32`` rows per request
    (decode-like), 16 or 32 query rows per tile over 4 warps, sparing the padded rows' math; 16-bit ones with
    ``head_dim <= 128`` two programs an SM (their registers and shared memory fit two; on the H200 two gave 15-17%
    more than one on a decode step of 8 users, benchmarks/tile_sweep.py). 16-bit 128 x 128 tiles without a time
    bias pipeline 3 key tiles (4-6% over 2 at 8k and 16k prefill and a recompute batch of 8; with the bias's extra
    loads 3 stages were 3% slower, so it keeps 2)."""
    if spec.dtype == torch.float32:
        config = TileConfig(block_m=32 if spec.head_dim >= 256 else 64, block_n=32, num_warps=4, num_stages=1)
    elif spec.head_dim >= 256:
        config = TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    else:
        stages = 2 if spec.time_bias_buckets or spec.head_dim > 128 else 3
        config = TileConfig(block_m=128, block_n=128, num_warps=8 if spec.head_dim >= 128 else 4, num_stages=stages)
    block_m, num_warps, num_stages, programs = config.block_m, config.num_warps, config.num_stages, 1
    decode_m = None if max_query_len is None or max_query_len > 32 else 16 if max_query_len <= 16 else 32
    if decode_m is not None and decode_m < block_m:  # a decode-like step
        block_m, num_warps, num_stages = decode_m, 4, min(num_stages, 2)
        programs = 2 if spec.dtype != torch.float32 and spec.head_dim <= 128 else 1  # as compiled and measured
    return TileConfig(block_m, max(config.block_n, spec.page_size), num_warps, num_stages, programs)


def own_rows_block_n(tiles: TileConfig) -> int:
    """Keys per step of the own-rows read (``attend_new_rows``, TMA blocks of ``[keys, D]``) under the paged read's
    ``tiles``: 64 for the 16-bit prefill tiles (128 x 128, 8 warps, 3 stages), where on an H100 it was 0-3% faster
    than 128 at 8k and 16k prefill, recompute's batch of 8 and the cold 8,192-event visit, never slower, with the same
    outputs, and compiled without spills (benchmarks/results/README.md, "64-key own-rows tiles"); else
    ``tiles.block_n``. The plan's key ranges stay multiples of ``tiles.block_n``, hence of 64."""
    if (tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages) == (128, 128, 8, 3):
        return 64
    return tiles.block_n


def plan_tile_map(query_start_loc: np.ndarray, num_history_rows: np.ndarray, kv_seq_lens: np.ndarray,
                  tiles: TileConfig, num_heads: int, num_sms: int, overhead_keys: int = SPLIT_OVERHEAD_KEYS,
                  min_tiles_per_split: int = MIN_TILES_PER_SPLIT) -> tuple[np.ndarray, np.ndarray]:
    """Cut the step's rows into query tiles and their key ranges into work items, from host copies of
    ``query_start_loc [B + 1]``, ``num_history_rows [B]``, ``kv_seq_lens [B]``. Returns ``tiles`` int32
    ``[5, num_tiles]`` and ``items`` int32 ``[2, num_items]`` (:class:`~.hstu_triton.HSTUTritonMetadata`).

    For ``s = 1..MAX_SPLITS`` parts of the longest tile, every tile is cut into equal parts of at most as
    many keys; the ``s`` with the least estimated time (list-scheduling lower bounds on ``num_sms``
    processors plus ``overhead_keys`` per program, in float32) and at most ``max(num_tiles,
    MAX_PROGRAMS_PER_SM * num_sms / num_heads)`` items wins (ties: fewest parts).
    """
    qsl, hist, seq_lens = (np.asarray(a, dtype=np.int64) for a in (query_start_loc, num_history_rows, kv_seq_lens))
    block_m, block_n, num_requests = tiles.block_m, tiles.block_n, len(seq_lens)
    rows = qsl[1:] - qsl[:-1]
    num_tiles = min((int(qsl[-1]) + num_requests * (block_m - 1)) // block_m,  # both bound sum_b ceil(rows_b / block_m)
                    num_requests * -(-int(rows.max(initial=0)) // block_m))  # spare slots (req -1) follow
    num_items = max(num_tiles, -(-MAX_PROGRAMS_PER_SM * num_sms // num_heads))
    if num_tiles == 0:
        return np.zeros((5, 0), np.int32), np.zeros((2, 0), np.int32)
    tiles_per_request = -(-rows // block_m)
    tile_end, tile = np.cumsum(tiles_per_request), np.arange(num_tiles)
    in_use = tile < tile_end[-1]
    req = np.minimum(np.searchsorted(tile_end, tile, side="right"), num_requests - 1)
    first = (tile - (tile_end - tiles_per_request)[req]) * block_m
    last_limit = seq_lens[req] - hist[req] + np.minimum(first + block_m, rows[req])
    blocks = -(-np.where(in_use, np.minimum(last_limit, seq_lens[req]), 0) // block_n)  # key tiles it visits

    # Parts only grow with the plan s (see _cheapest_cut): when s = 2 is over the item budget (a large step: items
    # for a few spare tiles only), s = 1 (no tile cut) is the only plan within it, and nothing is costed.
    bmax = int(blocks.max())
    halves = np.maximum(-(-blocks // max(-(-bmax // 2), min_tiles_per_split)), 1)
    if np.add.reduce(halves, where=in_use) > num_items:
        splits, part_len = in_use.astype(np.int64), blocks
    else:
        splits, part_len = _cheapest_cut(blocks, in_use, num_items, block_n, num_heads, num_sms, overhead_keys,
                                         min_tiles_per_split)

    item_end, item = np.cumsum(splits), np.arange(num_items)
    first_item, item_in_use = item_end - splits, item < item_end[-1]
    item_tile = np.minimum(np.searchsorted(item_end, item, side="right"), num_tiles - 1)
    item_split = item - first_item[item_tile]
    # Longest items first; self-only candidate tiles (length 0) still sort before spare slots.
    item_len = np.minimum(blocks[item_tile] - item_split * part_len[item_tile], part_len[item_tile])
    order = np.argsort(np.where(item_in_use, -1 - item_len, 1), kind="stable")
    tile_arrays = np.array([np.where(in_use, req, -1), first, splits, first_item, part_len * block_n], np.int32)
    return tile_arrays, np.array([np.where(item_in_use, item_tile, -1)[order], item_split[order]], np.int32)


def uncut_sizes(query_start_loc: np.ndarray, num_history_rows: np.ndarray, kv_seq_lens: np.ndarray,
                tiles: TileConfig, num_heads: int, num_sms: int,
                min_tiles_per_split: int = MIN_TILES_PER_SPLIT) -> tuple[int, int] | None:
    """Whether :func:`plan_tile_map` plans this step uncut through its large-step test (tiles cut in two exceed the
    item budget), decided from the ``[B]``-sized host arrays alone (``query_start_loc [B + 1]``, ``num_history_rows``,
    ``kv_seq_lens [B]``, any int): its ``(num_tiles, num_items)`` then, else ``None`` (the plan may cut).

    A request's tiles visit nondecreasingly many key tiles, its last ``ceil(kv_seq_len / block_n)``; at most twice
    the cut length, so a tile's halves are 2 exactly where it visits more (:func:`count_at_most`), else 1.
    """
    qsl, hist, seq_lens = (np.asarray(a, dtype=np.int64) for a in (query_start_loc, num_history_rows, kv_seq_lens))
    block_m, num_requests = tiles.block_m, len(seq_lens)
    tiles_per_request = (qsl[1:] - qsl[:-1] + (block_m - 1)) // block_m
    most = int(tiles_per_request.max(initial=0))
    num_tiles = min((int(qsl[-1]) + num_requests * (block_m - 1)) // block_m, num_requests * most)  # plan_tile_map's
    num_items = max(num_tiles, -(-MAX_PROGRAMS_PER_SM * num_sms // num_heads))
    if num_tiles == 0:
        return None
    longest = int(seq_lens.max(initial=0, where=tiles_per_request > 0))  # the longest tile's keys
    half = max(-(-longest // (2 * tiles.block_n)), min_tiles_per_split)  # = max(ceil(bmax / 2), min_tiles_per_split)
    longer = tiles_per_request - count_at_most(half, tiles_per_request, hist, seq_lens, tiles)
    return (num_tiles, num_items) if int(np.add.reduce(tiles_per_request + longer)) > num_items else None


def count_at_most(blocks: int, tiles_per_request: np.ndarray, hist: np.ndarray, seq_lens: np.ndarray,
                  tiles: TileConfig) -> np.ndarray:
    """Per request (int64 ``tiles_per_request``, ``hist``, ``seq_lens`` ``[B]``): how many of its query tiles visit
    at most ``blocks`` key tiles. Tile ``j`` visits ``ceil(min(seq - hist + min((j + 1) block_m, rows), seq) /
    block_n)``, nondecreasing in ``j``: all tiles when ``seq <= blocks * block_n``, else those with ``(j + 1) block_m
    <= blocks * block_n - seq + hist`` (:mod:`.hstu_triton_uncut`'s kernel counts the same way)."""
    limit = blocks * tiles.block_n
    within = np.minimum(np.maximum(limit - seq_lens + hist, 0) // tiles.block_m, tiles_per_request)
    return np.where(seq_lens <= limit, tiles_per_request, within)


def _cheapest_cut(blocks: np.ndarray, in_use: np.ndarray, num_items: int, block_n: int, num_heads: int,
                  num_sms: int, overhead_keys: int, min_tiles_per_split: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`plan_tile_map`'s choice of plan for int64 ``blocks [num_tiles]`` (key tiles each tile visits; 0 for
    spare tiles, ``in_use`` False): int64 parts per tile and key tiles per part (``[num_tiles]`` each).

    Plans s = 1..MAX_SPLITS: parts per tile, key tiles per part [MAX_SPLITS, num_tiles]. Those within the item
    budget (s = 1 always; of equal ones the first) are costed from their items' lengths by list-scheduling lower
    bounds (total work, waves of near-longest programs, two on one processor) plus overheads.
    """
    max_part = np.maximum(-(-blocks.max() // np.arange(1, MAX_SPLITS + 1)[:, None]), min_tiles_per_split)
    parts = np.where(in_use, np.maximum(-(-blocks // max_part), 1), 0)
    part_len = -(-blocks // np.maximum(parts, 1))  # so no part is empty
    items = parts.sum(1)
    within = items <= num_items
    within[1:] &= max_part[1:, 0] != max_part[:-1, 0]
    ok = np.flatnonzero(within)
    plan_len, columns = part_len[ok][..., None], np.arange(min(parts[ok].max() + 1, MAX_SPLITS))
    lengths = np.minimum(np.maximum(blocks[:, None] - columns * plan_len, 0), plan_len)
    lengths = lengths.reshape(len(ok), -1)
    longest_part = lengths.max(1)
    near_longest = np.count_nonzero(lengths >= (-(-3 * longest_part // 4))[:, None], axis=1)  # 4 l >= 3 longest
    waves = -(-near_longest * num_heads // num_sms)
    ranks = [min(r, lengths.shape[1] - 1) for r in ((num_sms - 1) // num_heads, num_sms // num_heads)]
    ranked = -np.partition(-lengths, sorted(set(ranks)), axis=1)  # ranked[:, r]: the r-th longest
    bound = np.maximum(waves * longest_part, ranked[:, ranks[0]] + ranked[:, ranks[1]]).astype(np.float32)
    bound = np.maximum(bound, np.float32(blocks.sum() * num_heads) / np.float32(num_sms))
    cost = bound + np.float32(overhead_keys / block_n * num_heads / num_sms) * items[ok].astype(np.float32)
    best = ok[np.argmin(cost)]
    return parts[best], part_len[best]


def padded_capacities(max_rows: int, max_requests: int, block_m: int, num_heads: int,
                      num_processors: int) -> tuple[int, int]:
    """``(num_tiles, num_items)`` a padded plan holds for any step of at most ``max_rows`` rows in ``max_requests``
    requests: :func:`plan_tile_map`'s bounds at those capacities."""
    num_tiles = (max_rows + max_requests * (block_m - 1)) // block_m
    return num_tiles, max(num_tiles, -(-MAX_PROGRAMS_PER_SM * num_processors // num_heads))


def padded_plan(tiles: np.ndarray, items: np.ndarray, num_tiles: int, num_items: int) -> np.ndarray:
    """:func:`plan_tile_map`'s ``tiles [5, n]``, ``items [2, m]`` as one int32 ``[5 * num_tiles + 2 * num_items]``
    padded to the capacities: spare tiles have request ``-1`` and zeros, spare items tile ``-1``, part 0."""
    plan = np.zeros(5 * num_tiles + 2 * num_items, dtype=np.int32)
    padded_tiles, padded_items = plan[: 5 * num_tiles].reshape(5, -1), plan[5 * num_tiles:].reshape(2, -1)
    padded_tiles[0], padded_items[0] = -1, -1
    padded_tiles[:, : tiles.shape[1]], padded_items[:, : items.shape[1]] = tiles, items
    return plan
