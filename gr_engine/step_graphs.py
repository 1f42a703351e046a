"""CUDA graphs for small steps: a step's forward replayed from captured graphs (docs/design.md section 3, step 5).

A step that fits a bucket (at most ``max_rows`` rows and ``max_requests`` requests, at least one new history row, no
relative time bias) is *staged*: written in compact form into a pinned host buffer (the backend's
:meth:`~attention_backends.GraphReplayable.graph_plan` uploaded unless the backend writes it on the device), then
expanded into the padded static buffers by one kernel launched just before the bucket's forward is replayed
(:mod:`.step_expand`): the next step may be staged as soon as that kernel has read the buffer.

Buckets are powers of two from 128 rows, finer above 4,096 (:func:`bucket_rows`), to ``max_rows``; graphs are
captured when a bucket and launch shape first occur (after an eager warm-up on a side stream) or all at start-up
(:meth:`.ModelRunner.capture_graphs`). A step waiting for onloads replays one graph per layer, each after its
layer's event, any other one graph; the last graph also runs the ranking head. All graphs share one memory pool. On
CPU the padded forward runs eagerly instead.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attention_backends import AttentionBackend, GraphReplayable, PagedBatchMetadata, PlanWriter
from cache_engine.streams import CurrentStream, indexed, on_stream

logger = logging.getLogger(__name__)

#: The real length of each field of a staged step (kinds as :attr:`StagedStep.lengths`).
LENGTHS = {
    "query_start_loc": "requests1", "kv_indptr": "requests1", "num_history_rows": "requests",
    "num_candidate_rows": "requests", "kv_last_page_len": "requests", "kv_seq_lens": "requests",
    "append_batch_indices": "history", "append_positions": "history", "append_pages": "history",
    "append_entries": "history", "history_rows": "history", "candidate_rows": "candidates",
    "candidate_batch_indices": "candidates", "item_ids": "rows", "action_ids": "rows", "positions": "rows",
}
TOKEN_FIELDS = ("item_ids", "action_ids", "positions")
_VIEW_CACHE_SIZE = 4096  # (bucket, field, length) views of the static buffer kept


#: Buckets up to this many rows are powers of two (a small step's time is mostly launches: padding costs little).
FINE_FROM_ROWS = 4096
#: Buckets a doubling above :data:`FINE_FROM_ROWS`, evenly spaced: a long step is padded by at most 1/16 of its rows.
#: A padded row costs its GEMMs, norms and append but no attention: an 8,292-row visit took 0.66 ms longer in a
#: 16,384-row graph than in an 8,448-row one (H100, ~0.08 us a padded row; benchmarks/results/README.md), so a
#: sixteenth of 8k rows costs ~0.04 ms.
FINE_STEPS = 16


def bucket_rows(max_rows: int) -> list[int]:
    """The capture buckets (rows) of steps up to ``max_rows`` rows: powers of two from 128 to
    :data:`FINE_FROM_ROWS`, then :data:`FINE_STEPS` evenly spaced buckets per doubling (4,352, 4,608, ..., 8,192,
    8,704, ...), then ``max_rows``."""
    buckets = [128]
    while buckets[-1] < max_rows:
        last = buckets[-1]
        buckets.append(2 * last if last < FINE_FROM_ROWS else last + (1 << (last.bit_length() - 1)) // FINE_STEPS)
    return buckets[:-1] + [max_rows]

Segment = Callable[[torch.Tensor | None], torch.Tensor]
SegmentsFn = Callable[[dict[str, torch.Tensor], PagedBatchMetadata, Any, Callable[[], None] | None], list[Segment]]
"""``segments(tokens, common, backend_metadata, before_attention)``: the forward as one callable per layer (no onload
waits); the first takes ``None`` and embeds ``tokens`` (:data:`TOKEN_FIELDS` -> int32 ``[T]``), each maps ``[T, d]``
to ``[T, d]``; ``before_attention`` (if given) is called just before each layer queues its attention."""
HeadFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``head(states, candidate_rows)``: the ranking head's logits ``[C, num_tasks]`` from the final states ``[T, d]``
and the int32 ``[C]`` rows of the candidates."""


def run_segments(parts: list[Segment], layer_ready: list[torch.cuda.Event | None]) -> torch.Tensor:
    """Run a forward's per-layer segments op by op, layer ``l`` after ``layer_ready[l]`` (``None``: no wait)."""
    x = None
    for part, ready in zip(parts, layer_ready, strict=True):
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
        x = part(x)
    return x


@dataclass(slots=True)
class StagedStep:
    """A step staged in compact form, expanded into the static buffers before its replay (:meth:`StepGraphs._expand`).

    Attributes:
        host: the per-request host arrays (see :attr:`PagedBatchMetadata.host`).
        lengths: each kind of field's real length (``"requests1"``, ``"requests"``, ``"history"``,
            ``"candidates"``, ``"rows"``) and the page count (``"pages"``).
        bucket: rows of the capture bucket (``>= T``).
        plan_key: the backend's launch-shape key for :meth:`GraphReplayable.graph_plan`.
        plan_writer: writes the plan inside the replay (nothing was uploaded for it), or ``None``.
        stream: the CUDA stream current when staged (plan copy queued there), where it is replayed (``None`` on CPU).
        variant: which of the caller's forwards it replays (part of the graph key; the caller's segments build it).
    """

    host: dict[str, np.ndarray]
    lengths: dict[str, int]
    bucket: int
    plan_key: Hashable
    plan_writer: PlanWriter | None
    stream: torch.cuda.Stream | None
    variant: Hashable = None

    @property
    def rows(self) -> int:
        """``T``, the step's rows."""
        return self.lengths["rows"]


@dataclass
class _Graph:
    graphs: list[torch.cuda.CUDAGraph]  # the whole forward and head, or one per layer (the last also runs the head)
    states: torch.Tensor  # [bucket, d_model], written by each replay
    logits: torch.Tensor  # [bucket, num_tasks], the head over the (padded) candidate rows


class StepGraphs:
    """Static buffers and captured forwards of one engine.

    Args:
        backend: the engine's attention backend, :class:`GraphReplayable` (see :meth:`supported`).
        device, page_size: the CUDA device; tokens per KV page.
        max_rows, max_requests, max_pages: the largest step replayed (rows, requests, page-table pages).
    """

    def __init__(self, backend: AttentionBackend, device: torch.device, page_size: int, max_rows: int,
                 max_requests: int, max_pages: int) -> None:
        self.backend, self.device, self.page_size = backend, indexed(device), page_size
        self.max_rows, self.max_requests, self.max_pages = max_rows, max_requests, max_pages
        self.buckets = bucket_rows(max_rows)
        from . import step_expand  # imports Triton: only engines with a graph-replayable backend get here

        self._step_expand = step_expand
        # Per bucket: each field's capacity and offset in the static buffer (page ids after the bucket's fields).
        layouts = {bucket: step_expand.field_offsets(max_requests, bucket) for bucket in self.buckets}
        self._caps = {bucket: caps for bucket, (caps, _) in layouts.items()}
        self._offsets = {bucket: offsets for bucket, (_, offsets) in layouts.items()}
        end = self._offsets[max_rows]["kv_indices"]
        self._cuda = device.type == "cuda"
        self._current_stream = CurrentStream(self.device) if self._cuda else None
        self._buffer = torch.zeros(end + max_pages, dtype=torch.int32, device=device)  # padded, what graphs read
        # A staged step in compact form (step_expand.write_compact), pinned: the expansion reads it from host memory.
        self._compact = torch.zeros(step_expand.compact_size(max_requests, max_rows, max_pages), dtype=torch.int32,
                                    pin_memory=self._cuda)
        self._compact_host = self._compact.numpy()  # kept: a tensor's numpy view costs microseconds to make
        self._compact_read = self._event()  # recorded after each reader of the compact step (CUDA)
        self._plans: dict[Hashable, tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event | None]] = {}
        # A device-written plan's side stream, the event recorded after it, and whether no attention waited for it yet.
        self._plan_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._plan_written, self._plan_pending = self._event(), False
        self._views: dict[tuple[int, str, int], torch.Tensor] = {}
        self._graphs: dict[tuple[int, Hashable, bool, Hashable], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self._cuda else None
        self.num_replays = 0  # steps served from graphs (on CPU: from the padded eager forward)
        self.enabled = True  # False after a capture failed: steps then run eagerly

    @staticmethod
    def supported(backend: AttentionBackend) -> bool:
        """Whether ``backend`` can be replayed from graphs (is :class:`GraphReplayable`)."""
        return isinstance(backend, GraphReplayable)

    @property
    def num_graphs(self) -> int:
        """Captured (bucket, launch shape) forwards."""
        return len(self._graphs)

    def fits(self, num_rows: int, num_requests: int, num_history_rows: int, num_pages: int) -> bool:
        """Whether a step of this size can be staged (never after a failed capture)."""
        return (self.enabled and num_history_rows > 0 and num_rows <= self.max_rows
                and num_requests <= self.max_requests and num_pages <= self.max_pages)

    def stage(self, layout: dict[str, np.ndarray], tokens: dict[str, np.ndarray],
              variant: Hashable = None) -> StagedStep:
        """Write a step that :meth:`fits` in compact form (:func:`.step_expand.write_compact`) into the pinned buffer
        (and upload the backend's plan if made on the host); waits only while the last staged step's expansion (the
        kernel before its replay) reads it.

        Args:
            layout: int arrays ``history_start``, ``num_history_rows``, ``num_candidate_rows`` (``[B]``),
                ``kv_indptr`` (``[B + 1]``) and ``kv_indices`` (``[P]``): the arguments of
                :meth:`~attention_backends.PagedBatchMetadata.from_layout`.
            tokens: int ``item_ids`` and ``action_ids`` ``[T]`` (each request's new history rows, then candidates).
            variant: the forward it is replayed with (:attr:`StagedStep.variant`).
        """
        start, hist, cand = layout["history_start"], layout["num_history_rows"], layout["num_candidate_rows"]
        indptr, pages = layout["kv_indptr"], layout["kv_indices"]
        # The ufuncs themselves, not np.cumsum / ndarray.sum: their Python wrappers cost a microsecond each.
        query_start_loc = np.zeros(len(hist) + 1, dtype=np.int64)
        np.add.accumulate(hist + cand, dtype=np.int64, out=query_start_loc[1:])
        seq_lens = start + hist
        host = {"query_start_loc": query_start_loc, "num_history_rows": hist, "num_candidate_rows": cand,
                "kv_indptr": indptr, "kv_seq_lens": seq_lens}
        rows, history = query_start_loc.item(-1), int(np.add.reduce(hist, dtype=np.int64))
        bucket = self.buckets[bisect.bisect_left(self.buckets, rows)]  # the smallest bucket >= rows (fits: exists)
        plan_key, plan = self.backend.graph_plan(host, bucket, self.max_requests)
        compact_read = self._compact_read
        if compact_read is not None and not compact_read.query():
            compact_read.synchronize()  # the last staged step's expansion may still read the buffer
        self._step_expand.write_compact(self._compact_host, start, hist, cand, indptr, pages, [tokens["item_ids"]],
                                        [tokens["action_ids"]])
        writer = plan if callable(plan) else None  # a writer: the backend writes the plan inside the replay
        device_plan, pinned_plan, plan_copied = self._plan_buffers(plan_key, uploaded=writer is None)
        stream = self._current_stream() if self._cuda else None
        if writer is None:
            if stream is not None:
                plan_copied.synchronize()
            pinned_plan.numpy()[:] = plan
            device_plan.copy_(pinned_plan, non_blocking=True)
            if stream is not None:
                plan_copied.record(stream)
        lengths = {"requests1": len(indptr), "requests": len(hist), "history": history, "candidates": rows - history,
                   "rows": rows, "pages": len(pages)}
        return StagedStep(host, lengths, bucket, plan_key, writer, stream, variant)

    def step_inputs(self, step: StagedStep) -> tuple[dict[str, torch.Tensor], PagedBatchMetadata]:
        """A staged step's tokens (:data:`TOKEN_FIELDS`) and metadata at real length over the expanded static buffer."""
        views = {name: self._view(step.bucket, name, step.lengths[kind]) for name, kind in LENGTHS.items()}
        tokens = {name: views.pop(name) for name in TOKEN_FIELDS}
        host = step.host
        indptr = host["kv_indptr"]
        common = PagedBatchMetadata(
            **views, kv_indices=self._view(step.bucket, "kv_indices", step.lengths["pages"]), page_size=self.page_size,
            max_query_len=int(np.diff(host["query_start_loc"]).max()), max_kv_len=int(host["kv_seq_lens"].max()),
            max_pages=int((indptr[1:] - indptr[:-1]).max()), host=host)
        return tokens, common

    def replay(self, step: StagedStep, segments: SegmentsFn, head: HeadFn,
               layer_ready: list[torch.cuda.Event | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward and head from the bucket's graphs (captured if new), layer ``l`` after ``layer_ready[l]``.
        Returns ``states [T, d_model]`` and ``logits [C, num_tasks]``, valid until the next replay."""
        if not self._cuda:
            self.num_replays += 1
            return self._run_eagerly(step, segments, head, layer_ready)
        whole = all(ready is None for ready in layer_ready)  # nothing to wait for: one graph
        key = (step.bucket, step.plan_key, whole, step.variant)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(step, segments, head, whole)
            except Exception:  # never fail a request over a capture: serve this step and later ones eagerly
                logger.warning("CUDA graph capture failed; steps run eagerly from now on", exc_info=True)
                self.enabled = False
                torch.cuda.synchronize(self.device)
                return self._run_unpadded(step, segments, head, layer_ready)
        self.num_replays += 1
        entry = self._graphs[key]
        self._expand(step.bucket)  # before the graphs, which read the expanded buffer: the compact one is free after it
        if whole:
            entry.graphs[0].replay()
        else:
            for graph, ready in zip(entry.graphs, layer_ready, strict=True):
                if ready is not None:
                    step.stream.wait_event(ready)
                graph.replay()
        return entry.states[: step.rows], entry.logits[: step.lengths["candidates"]]

    # ------------------------------------------------------------------ internals
    def _run_eagerly(self, step: StagedStep, segments: SegmentsFn, head: HeadFn,
                     layer_ready: list[torch.cuda.Event | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded forward and head a graph would replay, launched op by op (CPU, or after a failed capture)."""
        tokens, common, backend = self._static_inputs(step)
        self._expand(step.bucket)
        self._write_plan(step, common)
        states = run_segments(segments(tokens, common, backend, self._join_plan), layer_ready)
        self._join_plan()
        return states[: step.rows], head(states, common.candidate_rows)[: step.lengths["candidates"]]

    def _run_unpadded(self, step: StagedStep, segments: SegmentsFn, head: HeadFn,
                      layer_ready: list[torch.cuda.Event | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """The staged step at real size, host-planned metadata (after a failed capture: relies on nothing it made)."""
        self._expand(step.bucket)
        tokens, common = self.step_inputs(step)
        states = run_segments(segments(tokens, common, self.backend.build_metadata(common), None), layer_ready)
        return states, head(states, common.candidate_rows)

    def _expand(self, bucket: int) -> None:
        """Expand the staged step into ``bucket``'s static buffer (:func:`.step_expand.expand`, on the current stream)
        and mark the compact step read after it."""
        self._step_expand.expand(self._compact, self._buffer, self.max_requests, bucket, self.page_size)
        if self._compact_read is not None:
            self._compact_read.record(self._current_stream())

    def _view(self, bucket: int, name: str, length: int) -> torch.Tensor:
        """``length`` entries of field ``name`` in ``bucket``'s static buffer (views kept: slicing is slow)."""
        key = (bucket, name, length)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _VIEW_CACHE_SIZE:
                self._views.clear()
            at = self._offsets[bucket][name]
            view = self._views[key] = self._buffer[at:at + length]
        return view

    def _event(self) -> torch.cuda.Event | None:
        return torch.cuda.Event() if self._cuda else None

    def _write_plan(self, step: StagedStep, common: PagedBatchMetadata) -> None:
        """A device-planned step's plan, from the padded static inputs ``common``. On CUDA it is queued on a side
        stream, forked from the current one, so that it runs beside the first layer's embedding, norm and projection
        (one program: it leaves the other SMs free); :meth:`_join_plan` makes the first attention wait for it."""
        if step.plan_writer is None:
            return
        plan = self._plans[step.plan_key][0]
        if not self._cuda:
            step.plan_writer(common, plan)
            return
        current = self._current_stream()
        self._plan_stream.wait_stream(current)
        with on_stream(self._plan_stream, current):
            step.plan_writer(common, plan)
        self._plan_written.record(self._plan_stream)
        self._plan_pending = True

    def _join_plan(self) -> None:
        """Make the current stream wait for the plan queued by :meth:`_write_plan`, once (later calls do nothing until
        the next plan): called before each layer's attention, and at the end of a forward or first graph, so that a
        captured graph's side branch always joins it."""
        if self._plan_pending:
            self._current_stream().wait_event(self._plan_written)
            self._plan_pending = False

    def _plan_buffers(self, key: Hashable, uploaded: bool) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                   torch.cuda.Event | None]:
        """The plan's device buffer and, if ``uploaded`` (not device-written), its pinned staging buffer and the event
        of the last copy out of it."""
        buffers = self._plans.get(key)  # one lookup: hashing a launch-shape key costs about a microsecond
        if buffers is None:
            length = self.backend.graph_plan_size(key)
            pinned = torch.zeros(length, dtype=torch.int32, pin_memory=self._cuda) if uploaded else None
            buffers = self._plans[key] = (torch.zeros(length, dtype=torch.int32, device=self.device), pinned,
                                          self._event())
        return buffers

    def _static_inputs(self, step: StagedStep) -> tuple[dict[str, torch.Tensor], PagedBatchMetadata, Any]:
        """A bucket's graph inputs: tokens, page tables padded to the capacities, the backend's metadata."""
        caps = self._caps[step.bucket]
        views = {name: self._view(step.bucket, name, caps[name]) for name in caps if name not in TOKEN_FIELDS}
        tokens = {name: self._view(step.bucket, name, caps[name]) for name in TOKEN_FIELDS}
        views["kv_indices"] = self._view(step.bucket, "kv_indices", self.max_pages)
        common = PagedBatchMetadata(**views, page_size=self.page_size, max_query_len=step.bucket,
                                    max_kv_len=self.max_pages * self.page_size, max_pages=self.max_pages)
        return tokens, common, self.backend.graph_metadata(common, step.plan_key, self._plans[step.plan_key][0])

    def _capture(self, step: StagedStep, segments: SegmentsFn, head: HeadFn, whole: bool) -> _Graph:
        """The step's forward and head as one graph (``whole``), or as one graph per layer."""
        tokens, common, backend = self._static_inputs(step)
        parts = segments(tokens, common, backend, self._join_plan)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compiles and autotunes outside the capture; appends are idempotent
            self._expand(step.bucket)
            self._write_plan(step, common)
            x = None
            for part in parts:
                x = part(x)
            self._join_plan()
            head(x, common.candidate_rows)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # Each layer's output lives in the shared pool, read by the next graph; the first writes the plan (the inputs
        # are expanded before the replay, outside the graphs).
        groups = [parts] if whole else [[part] for part in parts]
        graphs, x = [], None
        for index, group in enumerate(groups):
            graph = torch.cuda.CUDAGraph()
            # thread_local: the host tier's worker threads may call CUDA (events, pinning) during the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                if index == 0:
                    self._write_plan(step, common)
                for part in group:
                    x = part(x)
                self._join_plan()  # the plan's branch joins the graph that forked it
                if index == len(groups) - 1:
                    logits = head(x, common.candidate_rows)
            graphs.append(graph)
        return _Graph(graphs, x, logits)


def synthetic_step(rows: int, longest: int, pages: np.ndarray,
                   page_size: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
    """A step of ``rows`` history rows in requests of at most ``longest`` rows each (the first ones exactly
    ``longest``), nothing cached, written into the first of ``pages`` (int32); ``None`` when ``pages`` are too few.
    Returns the layout and the token arrays :meth:`StepGraphs.stage` takes (tokens all zero: any valid ids)."""
    count = -(-rows // longest)
    hist = np.full(count, longest, dtype=np.int64)
    hist[-1] = rows - longest * (count - 1)
    per_request = -(-hist // page_size)
    if per_request.sum() > len(pages):
        return None
    indptr = np.concatenate([[0], np.cumsum(per_request)])
    zeros = np.zeros(count, dtype=np.int64)
    layout = {"history_start": zeros, "num_history_rows": hist, "num_candidate_rows": zeros, "kv_indptr": indptr,
              "kv_indices": pages[: indptr[-1]]}
    return layout, {name: np.zeros(rows, dtype=np.int64) for name in ("item_ids", "action_ids")}
