"""Turns one scheduled step into tensors, runs the model over the paged cache, and scores (docs/design.md section 3).

:meth:`~ModelRunner.prepare` builds page tables and per-request layout on the host; :meth:`~ModelRunner.strip` the
model input (uncached history suffix plus candidates), an :class:`EagerStep` (its per-row layout expanded on the device
by :mod:`.eager_layout` where the engine has one) or, when it fits the step graphs, a
:class:`~.step_graphs.StagedStep`; :meth:`~ModelRunner.forward` runs the layers (each appends its new history K/V,
then attends) and the ranking head; :meth:`~ModelRunner.fetch` queues the copy of the scores to the host
(:class:`~.step_results.ScoreFetch`, whose ``wait`` returns them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from attention_backends import AttentionBackend, PagedBatchMetadata
from attention_backends.base import upload, upload_int32
from cache_engine import KVCacheManager
from scheduler import ScheduledChunk

from .models import GRModel
from .request import GenerateParams
from .step_graphs import SegmentsFn, StagedStep, StepGraphs, run_segments, synthetic_step
from .step_results import PinnedBuffers, ScoreFetch, to_host
from .validation import RequestArrays

if TYPE_CHECKING:
    from .eager_layout import DeviceLayout


@dataclass(eq=False)
class RequestPayload:
    """The engine's data for one request (``RequestState.payload``): the request, its validated ``arrays``, retrieval
    ``params`` (``None`` for ranking) and ``arrival_s`` (``time.perf_counter()`` at arrival)."""

    request: Any
    arrays: RequestArrays
    params: GenerateParams | None
    arrival_s: float


@dataclass
class StepMetadata:
    """One step's layout on the host, built by :meth:`ModelRunner.prepare`.

    Attributes:
        layout: int64 ``history_start``, ``num_history_rows``, ``num_candidate_rows`` (``[B]``) and int32
            ``kv_indptr`` (``[B + 1]``) and ``kv_indices`` (``[P]``, the page tables after this step's append): the
            arguments of :meth:`~attention_backends.PagedBatchMetadata.from_layout`.
        retrieval_chunks: indices of the step's chunks that finish a retrieval request.
        retrieval_rows: int64 ``[R]`` on the device, each one's last history row (``None`` when there is none).
        uncached: no request has keys before this step's rows (its keys are all among them).
        self_contained: uncached, and each request finishes here (its pages are read by no later step).
    """

    layout: dict[str, np.ndarray]
    retrieval_chunks: list[int]
    retrieval_rows: torch.Tensor | None
    uncached: bool = False
    self_contained: bool = False


@dataclass
class EagerStep:
    """A step whose forward is launched op by op: its tokens (int32 ``[T]`` tensors keyed by
    :data:`~.step_graphs.TOKEN_FIELDS`) and metadata on the model device."""

    tokens: dict[str, torch.Tensor]
    common: PagedBatchMetadata
    backend: Any  # the attention backend's metadata, built from ``common``
    own_rows: bool = False  # attention reads every key from the step's own rows (ModelRunner.own_rows)
    append: bool = True  # the step's new K/V rows are written to their pages


StepInput = EagerStep | StagedStep
"""What :meth:`ModelRunner.strip` returns and :meth:`ModelRunner.forward` runs."""


#: Most new history rows of :meth:`ModelRunner.warm_eager`'s steps (above it launch shapes no longer change) and the
#: cached history of its long steps (tokens; enough for any backend's split of a request's key range).
WARM_MAX_ROWS = 512
WARM_CACHED_TOKENS = 8192


class ModelRunner:
    """Executes scheduled steps of :class:`GRModel` over the :class:`KVCacheManager`'s pages. ``graphs``: the step
    graphs small steps are staged into; ``layout``: lays out eager steps on the device (else they are laid out on
    the host, :meth:`~attention_backends.PagedBatchMetadata.from_layout`); ``own_rows``: every uncached step
    (:attr:`StepMetadata.uncached`) attends through the backend's
    :meth:`~attention_backends.NewRowsReadable.attend_new_rows`, reading its keys from its own rows, not the pages;
    ``keeps_pages``: every step appends its K/V to the pages (the caching modes), else (``recompute``) a
    self-contained step read from its own rows appends nothing, since no later step reads those pages. The graphs
    hold the own-rows and the pages forward as separate variants; a ``recompute`` engine stages only its
    self-contained steps (the others, chunks of a history, run eagerly)."""

    def __init__(self, model: GRModel, backend: AttentionBackend, kv: KVCacheManager,
                 device: torch.device, graphs: StepGraphs | None = None, layout: DeviceLayout | None = None,
                 own_rows: bool = False, keeps_pages: bool = True) -> None:
        self.model = model
        self.own_rows, self.keeps_pages = own_rows, keeps_pages
        self.backend = backend
        self.kv = kv
        self.device = device
        self.graphs = graphs
        self.layout = layout
        self._candidate_actions = np.full(model.config.max_candidates, model.candidate_action, dtype=np.int64)
        self._score_buffers = PinnedBuffers(model.config.num_tasks) if device.type == "cuda" else None

    def prepare(self, chunks: list[ScheduledChunk]) -> StepMetadata:
        """Page tables (after this step's append) and row layout of the step."""
        start = np.array([c.start for c in chunks], dtype=np.int64)
        hist = np.array([c.num_history_rows for c in chunks], dtype=np.int64)
        cand = np.array([c.num_candidate_rows for c in chunks], dtype=np.int64)
        indptr, indices = self.kv.page_table([c.request.user_id for c in chunks], start + hist)
        retrieval = [i for i, c in enumerate(chunks) if c.final and c.request.payload.params is not None]
        retrieval_rows = None
        if retrieval:
            rows = np.cumsum(hist + cand)[retrieval] - cand[retrieval] - 1  # last history row of each
            retrieval_rows = upload(rows.astype(np.int64), self.device)
        layout = {"history_start": start, "num_history_rows": hist, "num_candidate_rows": cand,
                  "kv_indptr": indptr, "kv_indices": indices}
        uncached = not start.any()
        return StepMetadata(layout, retrieval, retrieval_rows, uncached, uncached and all(c.final for c in chunks))

    @staticmethod
    def _timestamps(chunks: list[ScheduledChunk]) -> tuple[np.ndarray, np.ndarray]:
        """Query times ``[T]`` (history rows: their own; candidates: the last history event's) and key
        times ``[sum of histories after the append]``, for the relative time bias."""
        queries, keys = [], []
        for chunk in chunks:
            times = chunk.request.payload.arrays.timestamps
            last = times[-1:] if len(times) else np.zeros(1, dtype=np.int64)
            queries += [times[chunk.start:chunk.end], np.repeat(last, chunk.num_candidate_rows)]
            keys.append(times[: chunk.end])
        return np.concatenate(queries), np.concatenate(keys)

    def strip(self, chunks: list[ScheduledChunk], meta: StepMetadata) -> StepInput:
        """Model input: each request's uncached history ``[start, end)``, then its candidates if final; staged into
        the step graphs' buffers if it fits, else uploaded for an eager forward."""
        items, actions = [], []
        for chunk in chunks:
            arrays: RequestArrays = chunk.request.payload.arrays
            s, e, c = chunk.start, chunk.end, chunk.num_candidate_rows
            items += [arrays.item_ids[s:e], arrays.candidate_item_ids[:c]]
            actions += [arrays.action_ids[s:e], self._candidate_actions[:c]]
        layout = meta.layout
        hist = layout["num_history_rows"]
        rows = int(np.add.reduce(hist + layout["num_candidate_rows"]))
        own_rows = self.own_rows and meta.uncached
        append = self.keeps_pages or not (own_rows and meta.self_contained)
        stageable = own_rows in self.graph_variants and append == self._graph_appends(own_rows)
        if stageable and self.graphs is not None and self.graphs.fits(rows, len(chunks), int(np.add.reduce(hist)),
                                                                      len(layout["kv_indices"])):
            return self.graphs.stage(layout, {"item_ids": np.concatenate(items), "action_ids": np.concatenate(actions)},
                                     own_rows)
        times = self._timestamps(chunks) if self.model.config.time_bias_buckets else (None, None)
        return self._eager_step(layout, items, actions, times, own_rows, append)

    @property
    def graph_variants(self) -> tuple[bool, ...]:
        """The forwards the graphs hold, by whether they read keys from the step's own rows: both in a caching engine
        whose backend can, the own-rows one alone in such a ``recompute`` engine, else the pages one."""
        return (True, False) if self.own_rows and self.keeps_pages else (self.own_rows,)

    def _graph_appends(self, own_rows: bool) -> bool:
        """Whether a graph's forward (of the ``own_rows`` variant) appends: all but a ``recompute`` engine's own-rows
        forward, whose steps are self-contained."""
        return self.keeps_pages or not own_rows

    def _eager_step(self, layout: dict[str, np.ndarray], items: list[np.ndarray], actions: list[np.ndarray],
                    times: tuple[np.ndarray | None, np.ndarray | None], own_rows: bool = False,
                    append: bool = True) -> EagerStep:
        """Upload a step for an eager forward: ``layout`` as :attr:`StepMetadata.layout`, its rows' int item and
        action ids (``[T]`` each, in parts) and the time-bias timestamps (as :meth:`_timestamps`, or ``None``s); its
        per-row layout expanded on the device (:attr:`layout`) or built on the host."""
        if self.layout is not None:
            tokens, common = self.layout.build(layout, items, actions, times)
            return EagerStep(tokens, common, self.backend.build_metadata(common), own_rows, append)
        item_ids, action_ids = np.concatenate(items), np.concatenate(actions)
        common = PagedBatchMetadata.from_layout(layout["history_start"], layout["num_history_rows"],
                                                layout["num_candidate_rows"], layout["kv_indptr"],
                                                layout["kv_indices"], self.kv.page_size, self.device, *times)
        # History rows sit at their event's position, candidates (final chunk only) at kv_seq_lens.
        host = common.host
        positions = np.empty(len(item_ids), dtype=np.int64)
        positions[host["history_rows"]] = host["append_positions"]
        positions[host["candidate_rows"]] = host["kv_seq_lens"][host["candidate_batch_indices"]]
        tokens = upload_int32({"item_ids": item_ids, "action_ids": action_ids, "positions": positions}, self.device)
        return EagerStep(tokens, common, self.backend.build_metadata(common), own_rows, append)

    @torch.no_grad()
    def capture_graphs(self, pages: np.ndarray, use_tqdm: bool = True) -> int:
        """Replay (so capture, on CUDA) a synthetic step of every bucket and launch shape before serving
        (:meth:`GREngine.warmup <gr_engine.GREngine.warmup>`), sparing the first such step seconds of capture and
        compilation. Each bucket is filled with uncached history rows in requests of at most 1, 2, 4, ... rows, and
        as one request (the launch shape depends on the longest); on CUDA each shape is replayed as one graph and as
        one per layer.

        Args:
            pages: int32 ``[P]`` free page ids of the pool, which are written (a bucket needing more is skipped).
            use_tqdm: show a progress bar over the buckets.

        Returns:
            How many distinct (bucket, launch shape, variant) keys were replayed.
        """
        graphs, num_layers = self.graphs, len(self.model.layers)
        cuda = graphs.device.type == "cuda"
        waits = [[None] * num_layers]
        if cuda:
            done = torch.cuda.Event()
            done.record()
            waits.append([done] * num_layers)
        keys = set()
        for bucket in tqdm(graphs.buckets, desc="Capturing step graphs", disable=not use_tqdm):
            # longest requests of 1, 2, 4, ... rows below the bucket, and one of the whole bucket (the only shape
            # of a bucket between powers of two that one request a step can take)
            for longest in [1 << shift for shift in range((bucket - 1).bit_length())] + [bucket]:
                step = synthetic_step(bucket, longest, pages, graphs.page_size)
                if step is None or not graphs.fits(bucket, len(step[0]["num_history_rows"]), bucket,
                                                   len(step[0]["kv_indices"])):
                    continue
                layout, tokens = step
                for own_rows in self.graph_variants:
                    staged = graphs.stage(layout, tokens, own_rows)
                    key = (bucket, staged.plan_key, own_rows)
                    if key in keys or not graphs.enabled:  # (after a failed capture steps run eagerly: none to capture)
                        continue
                    keys.add(key)
                    for i, layer_ready in enumerate(waits):
                        graphs.replay(staged if i == 0 else graphs.stage(layout, tokens, own_rows),
                                      self._graph_segments(own_rows), self._rank_head, layer_ready)
        if cuda:
            torch.cuda.synchronize(graphs.device)
        return len(keys)

    @torch.no_grad()
    def warm_eager(self, pages: np.ndarray) -> int:
        """Run, before serving (:meth:`GREngine.warmup <gr_engine.GREngine.warmup>`), one eager step of each shape
        whose launch configuration a backend may pick differently, so that no later step compiles a kernel: one
        request of 1, 2, 4, ..., :data:`WARM_MAX_ROWS` new history rows (and one of ``max_candidates`` candidates),
        over no cached history and over a long one, with both timestamp widths when the model has a time bias; and
        the backend's metadata (no forward) of the largest step, which a backend may plan its own way
        (``hstu_triton``: on the device, by a kernel of its own).

        Args:
            pages: int32 ``[P]`` free page ids of the pool, which are written (shapes needing more are skipped).

        Returns:
            How many steps ran (the largest step's metadata not counted).
        """
        page_size, config = self.kv.page_size, self.model.config
        shapes = [(1 << shift, 0) for shift in range(WARM_MAX_ROWS.bit_length())] + [(1, config.max_candidates)]
        spans = [0, 2**32] if config.time_bias_buckets else [None]  # int32 and int64 timestamps
        count = 0
        for (rows, candidates), long, span in itertools.product(shapes, (False, True), spans):
            room = min(WARM_CACHED_TOKENS, config.max_history_len - rows - 1, len(pages) * page_size - rows)
            cached = room if long else 0
            if rows >= config.max_history_len or cached < 0 or (long and room <= 0):
                continue
            num_pages = -(-(cached + rows) // page_size)
            if num_pages > len(pages):
                continue
            layout = {"history_start": np.array([cached]), "num_history_rows": np.array([rows]),
                      "num_candidate_rows": np.array([candidates]), "kv_indptr": np.array([0, num_pages]),
                      "kv_indices": pages[:num_pages]}
            times = (None, None) if span is None else (np.full(rows + candidates, span, dtype=np.int64),
                                                       np.zeros(cached + rows, dtype=np.int64))
            zeros = np.zeros(rows + candidates, dtype=np.int64)
            own_rows = self.own_rows and not cached
            step = self._eager_step(layout, [zeros], [zeros], times, own_rows, self._graph_appends(own_rows))
            self.forward(step, [None] * len(self.model.layers))
            count += 1
        self._eager_step(*_largest_step(self.layout.max_requests if self.layout is not None else 1,
                                        config.max_history_len, config.max_candidates, page_size), (None, None))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return count

    @torch.no_grad()
    def forward(self, step: StepInput, layer_ready: list[torch.cuda.Event | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue all layers (appending new history K/V to pages) and the ranking head on the device.

        Args:
            step: what :meth:`strip` returned.
            layer_ready: per layer, the onload event its attention waits for, or ``None``.

        Returns:
            ``states [T, d_model]`` and float32 ``logits [C, num_tasks]`` of the candidates, valid until the next step.
        """
        if isinstance(step, StagedStep):
            return self.graphs.replay(step, self._graph_segments(step.variant), self._rank_head, layer_ready)
        states = run_segments(self._segments(step.tokens, step.common, step.backend, None, step.own_rows, step.append),
                              layer_ready)
        return states, self._rank_head(states, step.common.candidate_rows)

    def _rank_head(self, states: torch.Tensor, candidate_rows: torch.Tensor) -> torch.Tensor:
        """Float32 ``[C, num_tasks]`` logits of the candidates at int32 ``candidate_rows [C]`` of ``states``."""
        return self.model.rank_logits(states.index_select(0, candidate_rows)).float()

    def _graph_segments(self, own_rows: bool) -> SegmentsFn:
        """:meth:`_segments` of the graphs' ``own_rows`` variant (:attr:`graph_variants`)."""
        append = self._graph_appends(own_rows)
        return lambda tokens, common, backend, before: self._segments(tokens, common, backend, before, own_rows, append)

    def _segments(self, tokens: dict[str, torch.Tensor], common: PagedBatchMetadata, backend: Any,
                  before_attention: Callable[[], None] | None, own_rows: bool = False,
                  append: bool = True) -> list[Callable[[torch.Tensor | None], torch.Tensor]]:
        """The forward as one callable per layer (see :data:`~.step_graphs.SegmentsFn`): the first embeds the
        tokens, each appends its layer's new K/V (if ``append``) and attends (after ``before_attention()``, if given;
        ``own_rows``: the keys read from the step's rows, :meth:`~attention_backends.NewRowsReadable.attend_new_rows`),
        the last applies the final norm."""
        model, last = self.model, len(self.model.layers) - 1

        def segment(index: int) -> Callable[[torch.Tensor | None], torch.Tensor]:
            layer, layer_cache = model.layers[index], self.kv.kv_cache[index]

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       time_bias: torch.Tensor | None) -> torch.Tensor:
                if append:
                    self.backend.append_kv(layer_cache, k, v, backend)  # appends the rows at common.history_rows
                if before_attention is not None:
                    before_attention()
                if own_rows:
                    return self.backend.attend_new_rows(q, k, v, backend, time_bias=time_bias)
                return self.backend.attend(q, k, v, layer_cache, backend, time_bias=time_bias)

            def run(x: torch.Tensor | None) -> torch.Tensor:
                if x is None:
                    x = model.embed(**tokens)
                x = layer(x, attend)
                return model.final_norm(x) if index == last else x
            return run

        return [segment(i) for i in range(last + 1)]

    def mark_forward(self) -> torch.cuda.Event | None:
        """On CUDA, an event recorded on the compute stream before a step's forward is queued (its device time is
        measured from it, :meth:`ScoreFetch.device_seconds`); ``None`` on CPU."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @torch.no_grad()
    def fetch(self, chunks: list[ScheduledChunk], meta: StepMetadata, out: tuple[torch.Tensor, torch.Tensor],
              started: torch.cuda.Event | None = None) -> ScoreFetch:
        """Queue the copies of a step's results to the host right after its :meth:`forward` (before a later step's
        forward overwrites the step graphs' outputs): the ranking logits (into a pinned buffer of the runner's pool),
        and the retrieval head's top items; nothing waits for the device (:meth:`.step_results.ScoreFetch.wait`
        does). ``started``: :meth:`mark_forward`'s event."""
        states, logits = out
        counts = [c.num_candidate_rows for c in chunks]
        fetch = ScoreFetch(counts=counts, started=started)
        if sum(counts):
            fetch.copy_logits(logits, self._score_buffers)
        if meta.retrieval_chunks:
            fetch.retrieval = self._retrieve(chunks, meta, states)
        if self.device.type == "cuda":
            fetch.copied = torch.cuda.Event(enable_timing=started is not None)
            fetch.copied.record()
        return fetch

    def _retrieve(self, chunks: list[ScheduledChunk], meta: StepMetadata,
                  states: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
        """Queue the retrieval head over the step's finishing retrieval requests and the copy of its top items:
        their chunk indices, ``top_k`` each, and float32 scores and int64 item ids ``[R, k]`` (host)."""
        scores = self.model.retrieval_scores(states[meta.retrieval_rows]).float()
        payloads = [chunks[i].request.payload for i in meta.retrieval_chunks]
        excluded = [(b, p.arrays.item_ids) for b, p in enumerate(payloads) if p.params.exclude_history]
        if excluded:
            rows = np.concatenate([np.full(len(ids), b) for b, ids in excluded])
            cols = np.concatenate([ids for _, ids in excluded])
            scores[upload(rows, scores.device), upload(cols, scores.device)] = float("-inf")
        top_ks = [p.params.top_k for p in payloads]
        top_scores, top_items = scores.topk(min(max(top_ks), scores.shape[1]), dim=1)
        return meta.retrieval_chunks, top_ks, to_host(top_scores), to_host(top_items)


def _largest_step(num_requests: int, history: int, candidates: int,
                  page_size: int) -> tuple[dict[str, np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """The layout and (zero) item and action ids of a step of ``num_requests`` requests of ``history`` new history
    rows and ``candidates`` candidates each, nothing cached, over page 0 only: for building metadata, never run."""
    pages = -(-history // page_size)
    hist, cand = np.full(num_requests, history, dtype=np.int64), np.full(num_requests, candidates, dtype=np.int64)
    layout = {"history_start": np.zeros(num_requests, dtype=np.int64), "num_history_rows": hist,
              "num_candidate_rows": cand, "kv_indptr": np.arange(num_requests + 1, dtype=np.int64) * pages,
              "kv_indices": np.zeros(num_requests * pages, dtype=np.int32)}
    zeros = np.zeros(num_requests * (history + candidates), dtype=np.int64)
    return layout, [zeros], [zeros]
