"""``hstu_triton``: HSTU (SiLU) attention over the paged KV cache in Triton.

A program computes a ``BLOCK_M``-row query tile of one request and one head over a part of its paged
history, ``BLOCK_N`` keys (whole pages: key ``j`` of request ``b`` is entry ``j % page_size`` of page
``kv_indices[kv_indptr[b] + j // page_size]``, read through the cache's strides) at a time. Key tiles
seen by every row run unmasked; only those crossing the causal diagonal or the history's end are
masked, and none past the tile's last visible key is visited. Candidates add their own k/v last. With a
relative time bias, ``table[bucket(t_query - t_key), head]`` (:func:`_time_bias`) is added to ``alpha q.k``
before the SiLU; without one (a constexpr flag) the kernel loads nothing more.

:func:`~.hstu_triton_plan.plan_tile_map` (numpy on the host, uploaded in one copy; for steps replayed from CUDA
graphs, the same plan written on the device by :mod:`.hstu_triton_device_plan`) cuts the step into (query tile,
key-range part) items, longest first; a persistent grid (one program per processor) walks them in snake order.
Split tiles write fp32 partials that a second kernel sums in part order: HSTU has no softmax, so partials
simply add, deterministically.

``import attention_backends`` never imports Triton (this module does). On CPU the kernel runs in
Triton's interpreter, which needs ``TRITON_INTERPRET=1`` when this module is imported (tests).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import AttentionBackend, AttentionSpec, BackendSupport, GraphReplayable, PagedBatchMetadata, PlanWriter
from .hstu_triton_plan import (
    MAX_PROGRAMS_PER_SM,
    MIN_TILES_PER_SPLIT,
    SPLIT_OVERHEAD_KEYS,
    TileConfig,
    default_tile_config,
    padded_plan,
    plan_tile_map,
)

try:
    import triton
    import triton.language as tl

    from .hstu_triton_append import append_rows
except ImportError:  # the backend then reports itself unusable (reasons_unsupported)
    triton = tl = append_rows = None
_jit: Callable[[Callable], Callable] = (lambda fn: fn) if triton is None else triton.jit  # no Triton: never called
# Per-step values Triton must not specialise on (``== 1``, divisibility by 16, alignment): each new combination
# would recompile the kernel (seconds) mid-serving; they are read once per program, so that gains nothing.
_STEP_ARGS = ["Tiles", "Items", "QueryStartLoc", "NumHistory", "SeqLens", "KvIndptr", "KvIndices", "TimeBias",
              "QueryTimes", "KeyTimes", "KeyStart", "max_bucket", "num_tiles", "num_items", "num_work", "num_rounds"]


def _step_kernel(fn: Callable) -> Callable:
    """``triton.jit`` without specialisation on the per-step arguments of :data:`_STEP_ARGS` it has."""
    if triton is None:
        return fn
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return triton.jit(fn, do_not_specialize=[name for name in _STEP_ARGS if name in names])


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # what triton.jit sees when the kernels below are defined


@dataclass
class HSTUTritonMetadata:
    """The kernels' view of one step: query tiles, and the work items (tile, key-range part) to run.

    Attributes:
        common: the common metadata it was built from.
        tiles: int32 ``[5, num_tiles]``, per query tile: its request (``-1`` for spare slots), its first
            row counted within the request, the parts its key range is cut into (0 for spare slots),
            the partial-buffer slot of its first part, and the keys per part (a multiple of ``block_n``).
        items: int32 ``[2, num_items]``, per work item, longest first: its tile (``-1`` for spare
            slots) and which part of the tile's key range it covers.
        num_sms: programs that run at once: the persistent grid's size (host int).
        may_split: whether any tile can have several parts (host bool; else no partial buffer).
        config: the launch shape the tiles were cut for.
    """

    common: PagedBatchMetadata
    tiles: torch.Tensor
    items: torch.Tensor
    num_sms: int
    may_split: bool
    config: TileConfig


@_jit
def _silu(x, FAST: tl.constexpr):
    """``silu(x)`` of an fp32 tensor; ``FAST`` uses one ``tanh.approx`` instead of exp + divide (CUDA)."""
    if FAST:
        half = 0.5 * x
        tanh = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [half], dtype=tl.float32,
                                         is_pure=True, pack=1)
        return half + half * tanh
    return x * tl.sigmoid(x)


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
    acc, q, start_n, KvHead, Pages, seq_len, row_limit, stride_page, stride_kv, stride_token, alpha,
    BiasHead, query_times, KeyTimes, num_heads, max_bucket,
    MASKED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    FAST_SILU: tl.constexpr, PRECISION: tl.constexpr, TIME_BIAS: tl.constexpr,
):
    """``acc += silu(alpha q k^T + bias) v`` over keys ``start_n .. start_n + BLOCK_N`` of the request whose page
    ids start at ``Pages``, for the head whose K starts at ``KvHead`` (masked: keys at or past a row's
    ``row_limit`` count zero, keys past ``seq_len`` are not read). ``TIME_BIAS``: ``bias`` is :func:`_time_bias`
    of the rows' ``query_times`` and the keys' times (request's first at ``KeyTimes``); else none."""
    keys = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    in_seq = keys < seq_len
    if MASKED:
        page = tl.load(Pages + keys // PAGE_SIZE, mask=in_seq, other=0)
    else:
        page = tl.load(Pages + keys // PAGE_SIZE)
    k_ptrs = KvHead + (page.to(tl.int64) * stride_page + (keys % PAGE_SIZE) * stride_token)[:, None] + dims[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=in_seq[:, None], other=0.0)
        v = tl.load(k_ptrs + stride_kv, mask=in_seq[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(k_ptrs + stride_kv)
    logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * alpha
    if TIME_BIAS:
        if MASKED:
            key_times = tl.load(KeyTimes + keys, mask=in_seq, other=0)
        else:
            key_times = tl.load(KeyTimes + keys)
        logits += _time_bias(BiasHead, query_times, key_times, num_heads, max_bucket)
    p = _silu(logits, FAST_SILU)
    if MASKED:
        p = tl.where(keys[None, :] < row_limit[:, None], p, 0.0)
    return tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)


@_step_kernel
def _hstu_paged_attention_kernel(
    Q, K, V, KV, Out, Partial, Tiles, Items, QueryStartLoc, NumHistory, SeqLens, KvIndptr, KvIndices,
    TimeBias, QueryTimes, KeyTimes, KeyStart, max_bucket,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_page, stride_kv, stride_token, stride_head, stride_ot, stride_oh,
    num_tiles, num_items, num_heads, num_work, num_rounds, alpha, inv_scaling,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST_SILU: tl.constexpr, PRECISION: tl.constexpr, TIME_BIAS: tl.constexpr,
):
    """Persistent: program g of G takes (work item, head) pairs g, 2G-1-g, 2G+g, ... of the longest-first
    list (the snake order pairs long items with short ones) and computes, for each, its part of its query
    tile's key range for that head (``Tiles``, ``Items``: :class:`HSTUTritonMetadata`). ``TIME_BIAS``: add
    the bias of ``TimeBias [max_bucket + 1, H]`` (contiguous) from int64 ``QueryTimes [T]`` and ``KeyTimes``
    (request ``b``'s from ``KeyStart[b]``, :class:`~.base.StepTimestamps`); else those are never read."""
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
            bias_head = TimeBias + head
            query_times = rows  # without the time bias, these are placeholders that are never read
            key_times = KeyTimes
            if TIME_BIAS:
                query_times = tl.load(QueryTimes + rows, mask=valid, other=0)
                key_times += tl.load(KeyStart + req)
            for start_n in range(lo, unmasked_end, BLOCK_N):
                acc = _attend_key_tile(acc, q, start_n, kv_head, pages, seq_len, row_limit, stride_page, stride_kv,
                                       stride_token, alpha, bias_head, query_times, key_times, num_heads, max_bucket,
                                       False, PAGE_SIZE, BLOCK_N, HEAD_DIM, FAST_SILU, PRECISION, TIME_BIAS)
            for start_n in range(tl.maximum(lo, unmasked_end), hi, BLOCK_N):
                acc = _attend_key_tile(acc, q, start_n, kv_head, pages, seq_len, row_limit, stride_page, stride_kv,
                                       stride_token, alpha, bias_head, query_times, key_times, num_heads, max_bucket,
                                       True, PAGE_SIZE, BLOCK_N, HEAD_DIM, FAST_SILU, PRECISION, TIME_BIAS)
            out = acc * inv_scaling

            # Candidates also attend to their own k/v (added once, by part 0).
            # (scalars are broadcast to the row vector before combining masks: Triton >= 3.9's interpreter
            # rejects a mask built from a vector and a scalar comparison)
            own = valid & (slots >= num_hist) & (tl.zeros_like(slots) + split == 0)
            own_k_ptrs = K + rows[:, None] * stride_kt + head * stride_kh + dims[None, :]
            own_v_ptrs = V + rows[:, None] * stride_vt + head * stride_vh + dims[None, :]
            own_k = tl.load(own_k_ptrs, mask=own[:, None], other=0.0)
            own_v = tl.load(own_v_ptrs, mask=own[:, None], other=0.0)
            own_logit = tl.sum(q.to(tl.float32) * own_k.to(tl.float32), axis=1) * alpha
            if TIME_BIAS:  # a candidate's own key has its time: bucket 0
                own_logit += tl.load(bias_head).to(tl.float32)
            own_weight = tl.where(own, _silu(own_logit, False) * inv_scaling, 0.0)
            out += own_weight[:, None] * own_v.to(tl.float32)

            out_ptrs = Out + rows[:, None] * stride_ot + head * stride_oh + dims[None, :]
            whole = valid & (tl.zeros_like(slots) + num_splits == 1)
            tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=whole[:, None])
            part = (tl.load(Tiles + 3 * num_tiles + tile) + split) * num_heads + head
            part_ptrs = Partial + part.to(tl.int64) * (BLOCK_M * HEAD_DIM) + (slots - first)[:, None] * HEAD_DIM
            part_ptrs += dims[None, :]
            tl.store(part_ptrs, out, mask=(valid & (tl.zeros_like(slots) + num_splits > 1))[:, None])


@_step_kernel
def _sum_partials_kernel(
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


class HSTUTritonBackend(AttentionBackend, GraphReplayable):
    """HSTU attention over the paged cache with a Triton kernel (CUDA; CPU through the interpreter).

    Args:
        spec: what the model asks of attention.
        tiles: launch shape of every step; ``None``: :func:`default_tile_config` of each step's longest request.
    """

    name: ClassVar[str] = "hstu_triton"
    support: ClassVar[BackendSupport] = BackendSupport(
        devices=frozenset({"cuda", "cpu"}), dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        kinds=frozenset({"hstu"}), head_dims=frozenset({16, 32, 64, 128, 256}), page_sizes=frozenset({16, 32, 64}),
        time_bias=True)
    priority: ClassVar[int] = 10

    def __init__(self, spec: AttentionSpec, tiles: TileConfig | None = None) -> None:
        super().__init__(spec)
        self.tiles, self.fixed_tiles = (default_tile_config(spec), False) if tiles is None else (tiles, True)
        if self.tiles.block_n % spec.page_size:
            raise ValueError(f"block_n {self.tiles.block_n} is not a multiple of page_size {spec.page_size}")
        self.overhead_keys, self.min_tiles_per_split = SPLIT_OVERHEAD_KEYS, MIN_TILES_PER_SPLIT  # split-KV knobs
        #: Replayed steps plan on the device when the key's capacities allow (:mod:`.hstu_triton_device_plan`).
        self.plan_on_device = True
        cuda = spec.device_type == "cuda"  # processors planned for; on CPU (the interpreter, for tests) a nominal 4
        self.num_sms = torch.cuda.get_device_properties("cuda").multi_processor_count if cuda else 4
        self._device_keys: dict[Hashable, tuple[Hashable, PlanWriter]] = {}  # graph_plan's, by capacities
        # graph_metadata's views of each static plan buffer, by key: (the buffer, its tile map, its work items)
        self._plan_views: dict[Hashable, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def reasons_unsupported(cls, spec: AttentionSpec) -> list[str]:
        reasons = super().reasons_unsupported(spec)
        if triton is None:
            reasons.append("triton is not installed (pip install triton)")
        if spec.device_type == "cpu" and not INTERPRETED:
            reasons.append("needs CUDA (set TRITON_INTERPRET=1 before importing triton to interpret it, for tests)")
        return reasons

    def build_metadata(self, common: PagedBatchMetadata) -> HSTUTritonMetadata:
        """Plan the step on the host from ``common.host`` (:func:`plan_tile_map` with this backend's split-KV
        knobs ``num_sms``, ``overhead_keys``, ``min_tiles_per_split``; without ``host``, a read from the device)
        and upload the plan in one non-blocking copy; nothing else runs on the device."""
        host = common.host or {k: getattr(common, k).cpu().numpy()
                               for k in ("query_start_loc", "num_history_rows", "kv_seq_lens")}
        config = self._config(common.max_query_len)
        tiles, items = self._plan(host, config)
        # One copy from pinned memory, which torch's caching host allocator reuses once that copy is done (no wait).
        flat = torch.empty(tiles.size + items.size, dtype=torch.int32, pin_memory=common.query_start_loc.is_cuda)
        np.concatenate([tiles.ravel(), items.ravel()], out=flat.numpy())
        flat = flat.to(common.query_start_loc.device, non_blocking=True)  # on CPU (the interpreter): no copy
        return HSTUTritonMetadata(common, flat[: tiles.size].view(tiles.shape), flat[tiles.size:].view(items.shape),
                                  self.num_sms, common.max_kv_len > self.min_tiles_per_split * config.block_n, config)

    def graph_plan(self, common_host: dict[str, np.ndarray], max_rows: int,
                   max_requests: int) -> tuple[Hashable, np.ndarray | PlanWriter]:
        """The tile map padded to the most tiles and items a step within the capacities can have: spare tiles
        (request ``-1``, no parts) and spare items (tile ``-1``) are skipped by the kernels. Key: the launch
        shape, the two capacities and whether the plan is written on the device (with ``plan_on_device``, when
        :func:`.hstu_triton_device_plan.fits` the capacities; then :meth:`write_device_plan` is the writer)."""
        config = self._config(int(np.diff(common_host["query_start_loc"]).max(initial=0)))
        if self.plan_on_device and (config, max_rows, max_requests, self.num_sms) in self._device_keys:
            return self._device_keys[config, max_rows, max_requests, self.num_sms]
        num_tiles = (max_rows + max_requests * (config.block_m - 1)) // config.block_m  # plan_tile_map's bound
        num_items = max(num_tiles, -(-MAX_PROGRAMS_PER_SM * self.num_sms // self.spec.num_heads))
        if self.plan_on_device:
            from .hstu_triton_device_plan import fits

            if fits(num_tiles, num_items, max_requests):
                key = (config, num_tiles, num_items, True)
                planned = self._device_keys[config, max_rows, max_requests, self.num_sms] = (
                    key, functools.partial(self.write_device_plan, key))
                return planned
        plan = padded_plan(*self._plan(common_host, config), num_tiles, num_items)
        return (config, num_tiles, num_items, False), plan

    def graph_plan_size(self, key: Hashable) -> int:
        _, num_tiles, num_items, _ = key
        return 5 * num_tiles + 2 * num_items

    def write_device_plan(self, key: Hashable, common: PagedBatchMetadata, plan: torch.Tensor) -> None:
        """:func:`.hstu_triton_device_plan.write_plan` of the padded step in ``common``: what :meth:`graph_plan`
        would upload for it with ``plan_on_device`` off."""
        from .hstu_triton_device_plan import write_plan

        config, num_tiles, num_items, _ = key
        write_plan(plan, common.query_start_loc, common.num_history_rows, common.kv_seq_lens, config, num_tiles,
                   num_items, self.spec.num_heads, self.num_sms, self.overhead_keys, self.min_tiles_per_split)

    def graph_metadata(self, common: PagedBatchMetadata, key: Hashable, plan: torch.Tensor) -> HSTUTritonMetadata:
        config, num_tiles, num_items, _ = key
        views = self._plan_views.get(key)
        if views is None or views[0] is not plan:  # the views of a static buffer, made once (a few us each a step)
            views = self._plan_views[key] = (plan, plan[: 5 * num_tiles].view(5, num_tiles),
                                             plan[5 * num_tiles: 5 * num_tiles + 2 * num_items].view(2, num_items))
        return HSTUTritonMetadata(common, views[1], views[2], self.num_sms, True, config)

    def _config(self, max_query_len: int) -> TileConfig:
        return self.tiles if self.fixed_tiles else default_tile_config(self.spec, max_query_len)

    def _plan(self, host: dict[str, np.ndarray], config: TileConfig) -> tuple[np.ndarray, np.ndarray]:
        return plan_tile_map(host["query_start_loc"], host["num_history_rows"], host["kv_seq_lens"], config,
                             self.spec.num_heads, self.num_sms, self.overhead_keys, self.min_tiles_per_split)

    def append_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: HSTUTritonMetadata
    ) -> None:
        append_rows(kv_cache, key, value, metadata.common.append_pages, metadata.common.append_entries)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               metadata: HSTUTritonMetadata, time_bias: torch.Tensor | None = None) -> torch.Tensor:
        """HSTU attention of every row (after :meth:`append_kv` for this layer).

        Args:
            q, k, v: ``[T, H, D]`` projections of all rows, fp16/bf16/fp32 (any row and head strides).
            kv_cache: ``[num_pages, 2, page_size, H, D]`` (NHD, ``[:, 0]`` = K, ``[:, 1]`` = V) in ``q``'s
                dtype; any strides but the last dim's.
            metadata: what :meth:`build_metadata` returned for this step.
            time_bias: ``[num_buckets, H]`` relative time bias (any float dtype, added in fp32; the times are
                ``metadata.common.timestamps``), or ``None``.

        Returns:
            ``[T, H, D]`` in ``q``'s dtype, contiguous.
        """
        m, c = metadata, metadata.common
        if time_bias is not None and c.timestamps is None:
            raise ValueError("time_bias needs the step's timestamps (PagedBatchMetadata.timestamps is None)")
        num_rows, num_heads, head_dim = q.shape
        out = torch.empty((num_rows, num_heads, head_dim), dtype=q.dtype, device=q.device)
        num_tiles, num_items = m.tiles.shape[1], m.items.shape[1]
        if num_rows == 0 or num_items == 0:
            return out
        q, k, v, kv_cache = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, kv_cache))
        config, block_m = m.config, m.config.block_m
        # Partials of split tiles, one [block_m, D] slab per (work item, head); unused without splits.
        shape = (num_items, num_heads, block_m, head_dim) if m.may_split else (1,)
        partial = torch.empty(shape, dtype=torch.float32, device=q.device)
        num_work = num_heads * num_items
        num_programs = min(num_work, m.num_sms)  # persistent grid
        t = c.timestamps
        times = (out, m.tiles, m.tiles, m.tiles, 0) if time_bias is None else (  # placeholders without a bias
            time_bias.contiguous(), t.query, t.keys, t.key_start, time_bias.shape[0] - 1)
        _hstu_paged_attention_kernel[(num_programs,)](
            q, k, v, kv_cache, out, partial, m.tiles, m.items,
            c.query_start_loc, c.num_history_rows, c.kv_seq_lens, c.kv_indptr, c.kv_indices, *times,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *kv_cache.stride()[:4], out.stride(0), out.stride(1),
            num_tiles, num_items, num_heads, num_work, -(-num_work // num_programs),
            self.spec.alpha, 1.0 / self.spec.scaling_seqlen,
            HEAD_DIM=head_dim, PAGE_SIZE=kv_cache.shape[2], BLOCK_M=block_m, BLOCK_N=config.block_n,
            FAST_SILU=q.dtype != torch.float32 and q.is_cuda and not INTERPRETED,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TIME_BIAS=time_bias is not None,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        if m.may_split:
            _sum_partials_kernel[(num_heads * num_tiles, block_m // 16)](
                partial, out, m.tiles, c.query_start_loc, out.stride(0), out.stride(1), num_tiles, num_heads,
                HEAD_DIM=head_dim, BLOCK_M=block_m, ROWS=16, num_warps=4,
            )
        return out
