"""The Triton kernels of :mod:`.hstu_triton`: paged HSTU attention, the sum of split tiles' partials, the K/V append.

A program computes a ``BLOCK_M``-row query tile of one request and head over part of its paged history, ``BLOCK_N``
keys (whole pages) at a time: unmasked where every row sees them, masked across the causal diagonal or the history's
end; then candidates' own k/v. Split tiles' fp32 partials are summed in part order (``docs/design.md`` section 6).
Without Triton the kernels are plain, never-called functions.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend then reports itself unusable (reasons_unsupported)
    triton = tl = None
_jit: Callable[[Callable], Callable] = (lambda fn: fn) if triton is None else triton.jit  # no Triton: never called
# Per-step values Triton must not specialise on (``== 1``, divisibility by 16): each new combination would
# recompile mid-serving, for no gain (they are read once per program).
_STEP_ARGS = ["Tiles", "Items", "QueryStartLoc", "NumHistory", "SeqLens", "KvIndptr", "KvIndices", "TimeBias",
              "QueryTimes", "KeyTimes", "KeyStart", "max_bucket", "num_tiles", "num_items", "num_work", "num_rounds",
              "Rows", "Pages", "Entries", "num_rows"]


def _step_kernel(fn: Callable) -> Callable:
    """``triton.jit`` without specialisation on the per-step arguments of :data:`_STEP_ARGS` it has."""
    if triton is None:
        return fn
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return triton.jit(fn, do_not_specialize=[name for name in _STEP_ARGS if name in names])


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # what triton.jit sees when the kernels below are defined
# The append's launch shape: rows a program and its warps. One row a one-warp program wrote a recompute batch's K/V
# (~65k rows, 4 x 128 bf16) at ~1.65 TB/s on the H200 (81 us a layer, benchmarks/results/profiles/
# kernel_profile_c9b5cb9/); 8 rows over 4 warps issue all 8 rows' loads before the first store (not yet measured).
APPEND_ROWS, APPEND_WARPS = 8, 4


@_jit
def _silu(x, scale, FAST: tl.constexpr):
    """``silu(y)`` of ``y = scale * x`` (``x`` an fp32 tensor, ``scale`` a scalar). ``FAST`` (CUDA): ``y/2 + y/2
    tanh(y/2)`` with one ``tanh.approx.f32`` a value instead of exp and divide, ``y/2`` one product (equal to ``(scale
    * x) / 2``); else ``y * sigmoid(y)``."""
    if FAST:
        half = x * (0.5 * scale)
        tanh = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [half], dtype=tl.float32,
                                         is_pure=True, pack=1)
        return half + half * tanh
    y = x * scale
    return y * tl.sigmoid(y)


@_jit
def _time_bias(BiasHead, query_times, key_times, num_heads, max_bucket):
    """fp32 ``[M, N]`` bias ``BiasHead[bucket * num_heads]`` (``BiasHead``: a head's column of the contiguous
    ``[num_buckets, num_heads]`` table) of int64 ``query_times [M]`` and ``key_times [N]``, with ``bucket =
    min(floor(log2(1 + |dt|)), max_bucket)`` exactly as :func:`~.base.time_bucket`: the float32 exponent of
    ``1 + |dt|`` is ``floor(log2)`` or, rounded up to a power of two, one more; an integer shift corrects it."""
    gap = tl.abs(query_times[:, None] - key_times[None, :]) + 1  # >= 1
    exponent = (gap.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127  # positive and normal
    bucket = tl.minimum(exponent, max_bucket)
    bucket -= ((gap >> bucket) == 0).to(tl.int32)  # 2**bucket > gap: rounded up
    return tl.load(BiasHead + bucket * num_heads).to(tl.float32)


@_jit
def _attend_key_tile(
    acc, q, start_n, KvHead, Pages, seq_len, row_limit, stride_page, stride_kv, in_page, alpha,
    BiasHead, query_times, KeyTimes, num_heads, max_bucket, KDesc, VDesc, key_row0, head_col,
    MASKED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    FAST_SILU: tl.constexpr, PRECISION: tl.constexpr, TIME_BIAS: tl.constexpr, DENSE: tl.constexpr,
):
    """``acc += silu(alpha q k^T + bias) v`` over keys ``start_n .. start_n + BLOCK_N`` of the request whose page
    ids start at ``Pages``, for the head whose K starts at ``KvHead`` (masked: keys at or past a row's
    ``row_limit`` count zero, keys past ``seq_len`` are not read). ``in_page`` (int32 ``[BLOCK_N, HEAD_DIM]``):
    each key's and dimension's element offset within its page, the same for every key tile (``start_n`` is a
    multiple of ``BLOCK_N``, itself of ``PAGE_SIZE``). ``TIME_BIAS``: ``bias`` is :func:`_time_bias` of the rows'
    ``query_times`` and the keys' times (request's first at ``KeyTimes``); else none. ``DENSE``: key ``j`` is the
    step's row ``key_row0 + j``, its K and V ``[BLOCK_N, HEAD_DIM]`` blocks loaded by TMA through ``KDesc`` /
    ``VDesc`` at column ``head_col`` (the pages are not read; masked: values past ``seq_len``, other requests'
    rows or zeros past the step's, are zeroed)."""
    keys = start_n + tl.arange(0, BLOCK_N)
    in_seq = keys < seq_len
    if DENSE:
        k = KDesc.load([key_row0 + start_n, head_col])
        v = VDesc.load([key_row0 + start_n, head_col])
        if MASKED:
            v = tl.where(in_seq[:, None], v, 0.0)  # p is zero there, but 0 x a non-finite padding value is not
    else:
        position = keys.to(tl.uint32)  # keys are >= 0: unsigned, the page is a shift
        if MASKED:
            page = tl.load(Pages + position // PAGE_SIZE, mask=in_seq, other=0)
        else:
            page = tl.load(Pages + position // PAGE_SIZE)
        # Page ids are >= 0: zero-extended, the 64-bit offset needs no sign arithmetic.
        k_ptrs = KvHead + page.to(tl.uint32).to(tl.int64)[:, None] * stride_page + in_page
        if MASKED:
            k = tl.load(k_ptrs, mask=in_seq[:, None], other=0.0)
            v = tl.load(k_ptrs + stride_kv, mask=in_seq[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(k_ptrs + stride_kv)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if TIME_BIAS:
        if MASKED:
            key_times = tl.load(KeyTimes + keys, mask=in_seq, other=0)
        else:
            key_times = tl.load(KeyTimes + keys)
        p = _silu(scores * alpha + _time_bias(BiasHead, query_times, key_times, num_heads, max_bucket), 1.0,
                  FAST_SILU)
    else:
        p = _silu(scores, alpha, FAST_SILU)  # alpha folded into the SiLU's first product
    if MASKED:
        p = tl.where(keys[None, :] < row_limit[:, None], p, 0.0)
    return tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)


@_step_kernel
def hstu_paged_attention_kernel(
    Q, K, V, KV, Out, Partial, Tiles, Items, QueryStartLoc, NumHistory, SeqLens, KvIndptr, KvIndices,
    TimeBias, QueryTimes, KeyTimes, KeyStart, max_bucket, KDesc, VDesc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_page, stride_kv, stride_token, stride_head, stride_ot, stride_oh,
    num_tiles, num_items, num_heads, num_work, num_rounds, alpha, inv_scaling,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST_SILU: tl.constexpr, PRECISION: tl.constexpr, TIME_BIAS: tl.constexpr, DENSE: tl.constexpr,
):
    """Persistent: program g of G takes (work item, head) pairs g, 2G-1-g, 2G+g, ... of the longest-first
    list (the snake order pairs long items with short ones) and computes, for each, its part of its query
    tile's key range for that head (``Tiles``, ``Items``: :class:`HSTUTritonMetadata`). ``TIME_BIAS``: add
    the bias of ``TimeBias [max_bucket + 1, H]`` (contiguous) from int64 ``QueryTimes [T]`` and ``KeyTimes``
    (request ``b``'s from ``KeyStart[b]``, :class:`~.base.StepTimestamps`); else those are never read. ``DENSE``
    (no request has keys before its new rows): keys are read from the step's K and V rows through the TMA
    descriptors ``KDesc``, ``VDesc`` (see :func:`_attend_key_tile`), not from the pages; else those are never
    read."""
    program = tl.program_id(0)
    num_programs = tl.num_programs(0)
    for r in range(num_rounds):
        work = r * num_programs + tl.where(r % 2 == 0, program, num_programs - 1 - program)
        slot = work // num_heads
        tile = tl.load(Items + slot, mask=work < num_work, other=-1)
        if tile >= 0:
            head = work % num_heads
            split = tl.load(Items + num_items + slot)
            req = tl.load(Tiles + tile)
            first = tl.load(Tiles + num_tiles + tile)
            num_splits = tl.load(Tiles + 2 * num_tiles + tile)
            row0 = tl.load(QueryStartLoc + req)
            num_rows = tl.load(QueryStartLoc + req + 1) - row0
            num_hist = tl.load(NumHistory + req)
            seq_len = tl.load(SeqLens + req)
            pages = KvIndices + tl.load(KvIndptr + req)
            slots = first + tl.arange(0, BLOCK_M)
            dims = tl.arange(0, HEAD_DIM)
            valid = slots < num_rows
            rows = (row0 + slots).to(tl.int64)
            # New history row s sits at position seq_len - num_hist + s and sees keys up to it; candidates see
            # the whole history. Limits grow with s, so the tile's first and last rows bound them.
            history_offset = seq_len - num_hist
            row_limit = tl.where(slots < num_hist, history_offset + slots + 1, seq_len)
            low_limit = tl.minimum(history_offset + first + 1, seq_len)
            high_limit = tl.minimum(history_offset + tl.minimum(first + BLOCK_M, num_rows), seq_len)
            part_len = tl.load(Tiles + 4 * num_tiles + tile)
            lo = split * part_len
            hi = tl.minimum(lo + part_len, high_limit)
            unmasked_end = tl.minimum(hi, low_limit // BLOCK_N * BLOCK_N)

            q_ptrs = Q + rows[:, None] * stride_qt + head * stride_qh + dims[None, :]
            q = tl.load(q_ptrs, mask=valid[:, None], other=0.0)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            kv_head = KV + head * stride_head
            # Each key's offset within its page is the same in every key tile: computed here, once per work
            # item, not in the key loops (benchmarks/results/README.md, "in-page offsets hoisted").
            in_page = (tl.arange(0, BLOCK_N) % PAGE_SIZE * stride_token)[:, None] + dims[None, :]
            bias_head = TimeBias + head
            query_times = rows  # without the time bias, these are placeholders that are never read
            key_times = KeyTimes
            if TIME_BIAS:
                query_times = tl.load(QueryTimes + rows, mask=valid, other=0)
                key_times += tl.load(KeyStart + req)
            for start_n in range(lo, unmasked_end, BLOCK_N):
                acc = _attend_key_tile(acc, q, start_n, kv_head, pages, seq_len, row_limit, stride_page, stride_kv,
                                       in_page, alpha, bias_head, query_times, key_times, num_heads, max_bucket,
                                       KDesc, VDesc, row0, head * HEAD_DIM, False, PAGE_SIZE, BLOCK_N, HEAD_DIM,
                                       FAST_SILU, PRECISION, TIME_BIAS, DENSE)
            for start_n in range(tl.maximum(lo, unmasked_end), hi, BLOCK_N):
                acc = _attend_key_tile(acc, q, start_n, kv_head, pages, seq_len, row_limit, stride_page, stride_kv,
                                       in_page, alpha, bias_head, query_times, key_times, num_heads, max_bucket,
                                       KDesc, VDesc, row0, head * HEAD_DIM, True, PAGE_SIZE, BLOCK_N, HEAD_DIM,
                                       FAST_SILU, PRECISION, TIME_BIAS, DENSE)
            out = acc * inv_scaling

            # Candidates also attend to their own k/v (added once, by part 0), in the tiles that hold any: a
            # scalar branch, so history-only tiles (all of a prefill's) skip it.
            # (scalars are broadcast to the row vector before combining masks: Triton >= 3.9's interpreter
            # rejects a mask built from a vector and a scalar comparison)
            if (split == 0) & (tl.minimum(first + BLOCK_M, num_rows) > num_hist):
                own = valid & (slots >= num_hist)
                own_k_ptrs = K + rows[:, None] * stride_kt + head * stride_kh + dims[None, :]
                own_v_ptrs = V + rows[:, None] * stride_vt + head * stride_vh + dims[None, :]
                own_k = tl.load(own_k_ptrs, mask=own[:, None], other=0.0)
                own_v = tl.load(own_v_ptrs, mask=own[:, None], other=0.0)
                own_logit = tl.sum(q.to(tl.float32) * own_k.to(tl.float32), axis=1) * alpha
                if TIME_BIAS:  # a candidate's own key has its time: bucket 0
                    own_logit += tl.load(bias_head).to(tl.float32)
                own_weight = tl.where(own, _silu(own_logit, 1.0, False) * inv_scaling, 0.0)
                out += own_weight[:, None] * own_v.to(tl.float32)

            out_ptrs = Out + rows[:, None] * stride_ot + head * stride_oh + dims[None, :]
            whole = valid & (tl.zeros_like(slots) + num_splits == 1)
            tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=whole[:, None])
            part = (tl.load(Tiles + 3 * num_tiles + tile) + split) * num_heads + head
            part_ptrs = Partial + part.to(tl.int64) * (BLOCK_M * HEAD_DIM) + (slots - first)[:, None] * HEAD_DIM
            part_ptrs += dims[None, :]
            tl.store(part_ptrs, out, mask=(valid & (tl.zeros_like(slots) + num_splits > 1))[:, None])


@_step_kernel
def sum_partials_kernel(
    Partial, Out, Tiles, QueryStartLoc, stride_ot, stride_oh, num_tiles, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
):
    """Sum, in part order, the parts of rows ``program_id(1) * ROWS ...`` of one split query tile, one head."""
    head = tl.program_id(0) % num_heads
    tile = tl.program_id(0) // num_heads
    num_splits = tl.load(Tiles + 2 * num_tiles + tile)
    if num_splits < 2:
        return
    req = tl.load(Tiles + tile)
    first = tl.load(Tiles + num_tiles + tile)
    row0 = tl.load(QueryStartLoc + req)
    local = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    valid = first + local < tl.load(QueryStartLoc + req + 1) - row0
    part0 = tl.load(Tiles + 3 * num_tiles + tile) * num_heads + head
    ptrs = Partial + part0.to(tl.int64) * (BLOCK_M * HEAD_DIM) + local[:, None] * HEAD_DIM + dims[None, :]
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for split in range(num_splits):
        acc += tl.load(ptrs + split * num_heads * BLOCK_M * HEAD_DIM, mask=valid[:, None], other=0.0)
    rows = (row0 + first + local).to(tl.int64)
    tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + dims[None, :], acc.to(Out.dtype.element_ty),
             mask=valid[:, None])


@_step_kernel
def _append_kernel(
    Cache, Key, Value, Rows, Pages, Entries, num_rows,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_page, stride_kv, stride_token, stride_head, stride_dim,
    NUM_HEADS: tl.constexpr, HEADS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
):
    """Program ``p`` appends rows ``p * ROWS ..`` (those below ``num_rows``) of ``Rows``, ``Pages``, ``Entries``:
    each row's ``[H, D]`` K and V, all its loads issued before any store (see :func:`append_rows`). An entry equal
    to the one before it in all three (a graph step's padding) would write the same values again: it is skipped."""
    slots = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = slots < num_rows
    page = tl.load(Pages + slots, mask=live, other=0)
    entry = tl.load(Entries + slots, mask=live, other=0)
    src = tl.load(Rows + slots, mask=live, other=0)
    has_previous = live & (slots > 0)
    repeat = has_previous & (tl.load(Pages + slots - 1, mask=has_previous, other=-1) == page)
    repeat &= tl.load(Entries + slots - 1, mask=has_previous, other=-1) == entry
    repeat &= tl.load(Rows + slots - 1, mask=has_previous, other=-1) == src
    heads = tl.arange(0, HEADS_POW2)[None, :, None]
    dims = tl.arange(0, HEAD_DIM)[None, None, :]
    valid = (live & ~repeat)[:, None, None] & (heads < NUM_HEADS) & (dims < HEAD_DIM)
    page = page.to(tl.int64)[:, None, None]
    entry = entry.to(tl.int64)[:, None, None]
    src = src.to(tl.int64)[:, None, None]
    key = tl.load(Key + src * stride_kt + heads * stride_kh + dims * stride_kd, mask=valid)
    value = tl.load(Value + src * stride_vt + heads * stride_vh + dims * stride_vd, mask=valid)
    dst = Cache + page * stride_page + entry * stride_token + heads * stride_head + dims * stride_dim
    tl.store(dst, key, mask=valid)
    tl.store(dst + stride_kv, value, mask=valid)


def append_rows(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor,
                pages: torch.Tensor, entries: torch.Tensor) -> None:
    """:func:`~.paged.write_appended` of ``key[rows]``, ``value[rows]`` in one small launch that gathers as it
    writes: row ``rows[i]`` of ``key``, ``value`` (``[T, H, D]``, the cache's dtype, any strides) to entry
    ``entries[i]`` of page ``pages[i]`` of ``kv_cache`` (NHD), in place; ``rows``, ``pages``, ``entries`` int ``[N]``.
    Duplicate targets must carry equal rows (a CUDA-graph step pads by repeating the last append: such repeats are
    not written again)."""
    num_rows = rows.shape[0]
    _, num_heads, head_dim = key.shape
    if num_rows == 0:
        return
    _append_kernel[(triton.cdiv(num_rows, APPEND_ROWS),)](
        kv_cache, key, value, rows, pages, entries, num_rows,
        *key.stride(), *value.stride(), *kv_cache.stride(),
        NUM_HEADS=num_heads, HEADS_POW2=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim, ROWS=APPEND_ROWS,
        num_warps=APPEND_WARPS,
    )
