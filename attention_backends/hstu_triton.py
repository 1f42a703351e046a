"""``hstu_triton``: HSTU (SiLU) attention over the paged KV cache in Triton (``docs/design.md`` section 6).

Work items are planned by :func:`.plan_tile_map` (host), :mod:`.hstu_triton_uncut` (large uncut eager steps, on the
device) or :mod:`.hstu_triton_device_plan` (graph replays) and run by :mod:`.hstu_triton_kernels`. This module
imports Triton; on CPU it needs ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import (
    AttentionBackend,
    AttentionSpec,
    BackendSupport,
    GraphReplayable,
    NewRowsReadable,
    PagedBatchMetadata,
    PlanWriter,
)
from .hstu_triton_kernels import INTERPRETED, append_rows, hstu_paged_attention_kernel, sum_partials_kernel, triton
from .hstu_triton_plan import (
    MIN_TILES_PER_SPLIT,
    SPLIT_OVERHEAD_KEYS,
    TileConfig,
    default_tile_config,
    own_rows_block_n,
    padded_capacities,
    padded_plan,
    plan_tile_map,
    uncut_sizes,
)
from .hstu_triton_uncut import UncutPlanWriter


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
        processors: programs that run at once (:meth:`HSTUTritonBackend.processors`), the persistent grid's size
            (host int).
        may_split: whether any tile can have several parts (host bool; else no partial buffer and no sum of
            partials: never for an uncut plan).
        config: the tiles' launch shape.
    """

    common: PagedBatchMetadata
    tiles: torch.Tensor
    items: torch.Tensor
    processors: int
    may_split: bool
    config: TileConfig


class HSTUTritonBackend(AttentionBackend, GraphReplayable, NewRowsReadable):
    """HSTU attention over the paged cache with a Triton kernel (CUDA; CPU through the interpreter). ``tiles``:
    the launch shape of every step; ``None``: :func:`default_tile_config` of each step's longest request."""

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
        self.plan_on_device = True  #: replays plan on the device where capacities allow
        self.uncut_plan = UncutPlanWriter()  #: writes the plans of large uncut eager steps on the device
        cuda = spec.device_type == "cuda"  # on CPU (the interpreter) a nominal 4 processors
        self.num_sms = torch.cuda.get_device_properties("cuda").multi_processor_count if cuda else 4
        # graph_plan's (key, writer) by (config, capacities, num_sms) and by (longest rows, capacities, num_sms)
        self._device_keys: dict[tuple, tuple[Hashable, PlanWriter]] = {}
        # graph_metadata's (buffer, tile map view, items view) by key
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
        """Plan the step: a large step that :func:`uncut_sizes` finds uncut (from ``common.host``'s ``[B]`` arrays,
        else a device read) on the device (:attr:`uncut_plan`, one kernel), any other on the host
        (:func:`plan_tile_map`) and uploaded in one non-blocking pinned copy (as :func:`.base.upload`). Same plan."""
        host = common.host or {k: getattr(common, k).cpu().numpy()
                               for k in ("query_start_loc", "num_history_rows", "kv_seq_lens")}
        config = self._config(common.max_query_len)
        processors = self.processors(config)
        uncut = uncut_sizes(host["query_start_loc"], host["num_history_rows"], host["kv_seq_lens"], config,
                            self.spec.num_heads, processors, self.min_tiles_per_split)
        if uncut is not None:
            num_tiles, num_items = uncut
            flat = self.uncut_plan.write(common, config, num_tiles, num_items)
            shapes = (5, num_tiles), (2, num_items)
        else:
            tiles, items = self._plan(host, config)
            flat = torch.empty(tiles.size + items.size, dtype=torch.int32, pin_memory=common.query_start_loc.is_cuda)
            np.concatenate([tiles.ravel(), items.ravel()], out=flat.numpy())
            flat = flat.to(common.query_start_loc.device, non_blocking=True)  # on CPU (the interpreter): no copy
            shapes = tiles.shape, items.shape
        size = shapes[0][0] * shapes[0][1]
        may_split = uncut is None and common.max_kv_len > self.min_tiles_per_split * config.block_n  # uncut: no parts
        return HSTUTritonMetadata(common, flat[:size].view(shapes[0]), flat[size:].view(shapes[1]), processors,
                                  may_split, config)

    def graph_plan(self, common_host: dict[str, np.ndarray], max_rows: int,
                   max_requests: int) -> tuple[Hashable, np.ndarray | PlanWriter]:
        """The tile map padded to the capacities' most tiles and items (spares are skipped by the kernels). Key:
        (launch shape, tiles, items, on device); on device (``plan_on_device`` and
        :func:`.hstu_triton_device_plan.fits`) the writer is :meth:`write_device_plan`."""
        longest = int(np.diff(common_host["query_start_loc"]).max(initial=0))
        by_rows = (longest, max_rows, max_requests, self.num_sms)
        if self.plan_on_device:  # by the longest request's rows: no tile config to build and hash per step
            planned = self._device_keys.get(by_rows)
            if planned is not None:
                return planned
        config = self._config(longest)
        num_tiles, num_items = padded_capacities(max_rows, max_requests, config.block_m, self.spec.num_heads,
                                                 self.processors(config))
        if self.plan_on_device:
            from .hstu_triton_device_plan import fits

            by_config = (config, max_rows, max_requests, self.num_sms)
            planned = self._device_keys.get(by_config)
            if planned is None and fits(num_tiles, num_items, max_requests):
                key = (config, num_tiles, num_items, True)
                planned = self._device_keys[by_config] = (key, functools.partial(self.write_device_plan, key))
            if planned is not None:
                self._device_keys[by_rows] = planned
                return planned
        plan = padded_plan(*self._plan(common_host, config), num_tiles, num_items)
        return (config, num_tiles, num_items, False), plan

    def graph_plan_size(self, key: Hashable) -> int:
        _, num_tiles, num_items, _ = key
        return 5 * num_tiles + 2 * num_items

    def write_device_plan(self, key: Hashable, common: PagedBatchMetadata, plan: torch.Tensor) -> None:
        """:func:`.hstu_triton_device_plan.write_plan` of the padded step in ``common`` (= the host plan)."""
        from .hstu_triton_device_plan import write_plan

        config, num_tiles, num_items, _ = key
        write_plan(plan, common.query_start_loc, common.num_history_rows, common.kv_seq_lens, config, num_tiles,
                   num_items, self.spec.num_heads, self.processors(config), self.overhead_keys,
                   self.min_tiles_per_split)

    def graph_metadata(self, common: PagedBatchMetadata, key: Hashable, plan: torch.Tensor) -> HSTUTritonMetadata:
        config, num_tiles, num_items, _ = key
        views = self._plan_views.get(key)
        if views is None or views[0] is not plan:  # the views of a static buffer, made once (a few us each a step)
            views = self._plan_views[key] = (plan, plan[: 5 * num_tiles].view(5, num_tiles),
                                             plan[5 * num_tiles: 5 * num_tiles + 2 * num_items].view(2, num_items))
        return HSTUTritonMetadata(common, views[1], views[2], self.processors(config), True, config)

    def processors(self, config: TileConfig) -> int:
        """Programs of ``config`` that run at once, the persistent grid's size: SMs x ``config.programs_per_sm``."""
        return self.num_sms * config.programs_per_sm

    def _config(self, max_query_len: int) -> TileConfig:
        return self.tiles if self.fixed_tiles else default_tile_config(self.spec, max_query_len)

    def _plan(self, host: dict[str, np.ndarray], config: TileConfig) -> tuple[np.ndarray, np.ndarray]:
        return plan_tile_map(host["query_start_loc"], host["num_history_rows"], host["kv_seq_lens"], config,
                             self.spec.num_heads, self.processors(config), self.overhead_keys, self.min_tiles_per_split)

    def append_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  metadata: HSTUTritonMetadata) -> None:
        """Row ``history_rows[i]`` of ``key`` and ``value`` to its page slot, read in place by the append kernel."""
        c = metadata.common
        append_rows(kv_cache, key, value, c.history_rows, c.append_pages, c.append_entries)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               metadata: HSTUTritonMetadata, time_bias: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`AttentionBackend.attend`: ``q``, ``k``, ``v``, ``kv_cache`` fp16/bf16/fp32 with any strides but
        the last dim's, ``time_bias`` any float dtype (added in fp32); the output is contiguous."""
        return self._attend(q, k, v, kv_cache, metadata, time_bias, dense=False)

    def reads_new_rows(self) -> bool:
        """:meth:`NewRowsReadable.reads_new_rows`: a TMA descriptor needs 16-byte aligned rows, so the model's
        ``[T, 4W]`` projection's K and V column blocks (``W = H x D`` values from the previous) must start 16 bytes
        apart."""
        return self.spec.num_heads * self.spec.head_dim * self.spec.dtype.itemsize % 16 == 0

    def attend_new_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: HSTUTritonMetadata,
                        time_bias: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`attend` of a step in which no request has keys before its new rows (``kv_seq_lens`` equal to
        ``num_history_rows``: recompute, a first visit): every key is one of the step's own rows, read from ``k``
        and ``v`` (TMA loads of ``[own_rows_block_n, D]`` blocks) instead of the pages, which need not hold them. ``k``,
        ``v``: ``[T, H, D]`` with unit stride in the last two dims flattened (heads ``D`` apart), rows 16-byte
        aligned; the same output as :meth:`attend` after :meth:`append_kv`. A request with keys before its new
        rows gives wrong results: the caller's contract, not checked (it would take a device read)."""
        return self._attend(q, k, v, k, metadata, time_bias, dense=True)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: HSTUTritonMetadata, time_bias: torch.Tensor | None, dense: bool) -> torch.Tensor:
        """One launch of the attention kernel (and the sum of split tiles' partials); ``dense``: keys from ``k`` and
        ``v`` (:meth:`attend_new_rows`; ``kv_cache`` is then only a placeholder), else from ``kv_cache``."""
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
        block_n = own_rows_block_n(config) if dense else config.block_n
        descriptors = (_row_blocks(k, block_n), _row_blocks(v, block_n)) if dense else (k, v)
        # Partials of split tiles, one [block_m, D] slab per (work item, head); unused without splits.
        shape = (num_items, num_heads, block_m, head_dim) if m.may_split else (1,)
        partial = torch.empty(shape, dtype=torch.float32, device=q.device)
        num_work = num_heads * num_items
        num_programs = min(num_work, m.processors)  # persistent grid
        t = c.timestamps
        times = (out, m.tiles, m.tiles, m.tiles, 0) if time_bias is None else (  # placeholders without a bias
            time_bias.contiguous(), t.query, t.keys, t.key_start, time_bias.shape[0] - 1)
        cache_strides = kv_cache.stride()[:4] if not dense else (0, 0, 0, 0)
        hstu_paged_attention_kernel[(num_programs,)](
            q, k, v, kv_cache, out, partial, m.tiles, m.items,
            c.query_start_loc, c.num_history_rows, c.kv_seq_lens, c.kv_indptr, c.kv_indices, *times, *descriptors,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *cache_strides, out.stride(0), out.stride(1),
            num_tiles, num_items, num_heads, num_work, -(-num_work // num_programs),
            self.spec.alpha, 1.0 / self.spec.scaling_seqlen,
            HEAD_DIM=head_dim, PAGE_SIZE=self.spec.page_size if dense else kv_cache.shape[2], BLOCK_M=block_m,
            BLOCK_N=block_n,
            FAST_SILU=q.dtype != torch.float32 and q.is_cuda and not INTERPRETED,  # inline PTX: CUDA only
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TIME_BIAS=time_bias is not None, DENSE=dense,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        if m.may_split:
            sum_partials_kernel[(num_heads * num_tiles, block_m // 16)](
                partial, out, m.tiles, c.query_start_loc, out.stride(0), out.stride(1), num_tiles, num_heads,
                HEAD_DIM=head_dim, BLOCK_M=block_m, ROWS=16, num_warps=4,
            )
        return out


def _row_blocks(x: torch.Tensor, block_rows: int):
    """A TMA descriptor over ``x`` ``[T, H, D]`` as ``[T, H * D]`` (heads ``D`` apart, rows ``x.stride(0)`` apart) in
    ``[block_rows, D]`` blocks: a head's rows of a key tile."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_rows, num_heads, head_dim = x.shape
    if x.stride(1) != head_dim:
        raise ValueError(f"heads must be {head_dim} values apart for a dense read: got strides {x.stride()}")
    return TensorDescriptor(x, [num_rows, num_heads * head_dim], [x.stride(0), 1], [block_rows, head_dim])
