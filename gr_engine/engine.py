"""``GREngine``, the public entry point (vLLM ``LLM.generate`` conventions): ``rank`` and ``generate`` return one
output per request, in input order (a bad request's ``error`` says why; its batch-mates are served);
``add_request`` + ``step`` expose the engine loop for streaming use.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from attention_backends import AttentionSpec, BackendRegistry, NewRowsReadable
from cache_engine import KVCacheManager
from scheduler import RequestState, ScheduledChunk, Scheduler, SchedulerOutput

from .compile_watch import CompileWatch, StallCounts
from .config import EngineConfig, check_config
from .intake import RequestIntake, request_labels
from .metrics import EngineStats, PhaseTimer, StepMetrics
from .model_runner import ModelRunner, RequestPayload
from .models import GRModel
from .outputs import GenerateOutput, RankOutput, StepTimings
from .request import GenerateParams, GenerateRequest, RankRequest
from .step_graphs import StepGraphs
from .step_results import ChunkResult, ScoreFetch
from .validation import RequestError, check_params

logger = logging.getLogger(__name__)

Output = RankOutput | GenerateOutput
_INTAKE_BATCH = 64  # requests validated and hashed together by rank/generate (bounds the hashing buffers)


@dataclass(eq=False)
class LaunchedStep:
    """A step :meth:`GREngine.launch_step` queued on the device, for :meth:`GREngine.finish_step`: the requests that
    failed before it ran (``done``), its chunks and plan, which of them finish (``id`` of their states), its phase
    timer, the bytes it moved (onloaded, offloaded), its queued scores and a scoring error."""

    done: list[tuple[RequestState, Output]]
    chunks: list[ScheduledChunk] = field(default_factory=list)
    plan: SchedulerOutput | None = None
    finished: set[int] = field(default_factory=set)
    timer: PhaseTimer | None = None
    transferred: tuple[int, int] = (0, 0)
    scores: ScoreFetch | None = None
    error: str | None = None


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; anything else as given (checked)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def build_engine(config: EngineConfig) -> GREngine:
    """``GREngine(config)`` for a command: a failure to build it on this machine (e.g. a pool too large to allocate,
    a size beyond 64 bits) is raised as a one-line ``ValueError`` (torch appends C++ frames to its messages)."""
    try:
        return GREngine(config)
    except (RuntimeError, TypeError, OverflowError, MemoryError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"cannot build the engine: {first_line}") from exc


class GREngine:
    """A serving engine for HSTU ranking with per-user KV caches that persist across visits.

    Args:
        config: the engine configuration.
        model: a built model (default: from ``config.model`` and ``config.weights_path``), moved to the device/dtype.
        backends: where attention backends are looked up (default: built-ins plus entry points).
        host_memory: optional preallocated flat uint8 host memory (pinned, for CUDA) for the host chunk
            pool, e.g. one arena reused by successive engines in a process; no other live engine may use it.

    Attributes (besides the config): ``model``, ``backend`` (attention), ``kv`` (the
    :class:`~cache_engine.KVCacheManager`), ``scheduler``, ``runner`` (the :class:`ModelRunner`), ``intake``
    (the :class:`~.intake.RequestIntake`, with the prefix ``hasher``), ``stats`` (:class:`EngineStats`).
    """

    def __init__(self, config: EngineConfig, *, model: GRModel | None = None,
                 backends: BackendRegistry | None = None, host_memory: torch.Tensor | None = None) -> None:
        check_config(config, backends)
        self.config = config
        mc = config.model
        self.device = resolve_device(config.device)
        self._compiles = CompileWatch(listen=self.device.type == "cuda")
        if model is None:
            model = GRModel(mc)
            if config.weights_path is not None:
                model.load(config.weights_path)
        self.model = model.to(device=self.device, dtype=mc.torch_dtype).eval()
        spec = AttentionSpec(
            kind=mc.attention_kind, num_heads=mc.num_heads, head_dim=mc.head_dim, page_size=config.cache.page_size,
            dtype=mc.torch_dtype, device_type=self.device.type, alpha=mc.alpha,
            scaling_seqlen=mc.normaliser, time_bias_buckets=mc.time_bias_buckets,
        )
        self.backend = (backends or BackendRegistry()).create(config.attention_backend, spec)
        self.kv = KVCacheManager(config.cache, mc.num_layers, mc.num_heads, mc.head_dim, mc.torch_dtype,
                                 self.device, host_memory=host_memory)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        graphs = None
        # (A time-biased step reads its timestamps, which the graphs' static buffers do not hold: such models run
        # every step eagerly.)
        if (self.device.type == "cuda" and config.cuda_graph_max_rows and StepGraphs.supported(self.backend)
                and not mc.time_bias_buckets):
            graphs = StepGraphs(self.backend, self.device, config.cache.page_size, config.cuda_graph_max_rows,
                                config.scheduler.max_num_seqs, config.cache.num_gpu_pages)
        layout = None
        if self.device.type == "cuda" and StepGraphs.supported(self.backend):  # eager steps laid out on the device
            from .eager_layout import DeviceLayout  # imports Triton

            layout = DeviceLayout(self.device, config.cache.page_size, config.scheduler.max_num_seqs)
        # an uncached step's keys are its own rows: read without the pages where the backend can (recompute then
        # writes none of them: no later step reads them)
        own_rows = isinstance(self.backend, NewRowsReadable) and self.backend.reads_new_rows()
        self.runner = ModelRunner(self.model, self.backend, self.kv, self.device, graphs, layout, own_rows,
                                  keeps_pages=config.cache.mode != "recompute")
        self.stats = EngineStats()
        self.intake = RequestIntake(config, self.kv, self.scheduler, self.stats)
        self._undelivered: list[Output] = []
        self._launched: deque[LaunchedStep] = deque()  # launched steps not yet finished, oldest first

    # ------------------------------------------------------------------ streaming API
    def add_request(self, request: RankRequest | GenerateRequest, params: GenerateParams | None = None) -> int:
        """Queue a request (ranking if ``params`` is ``None``, else retrieval); return its sequence number (arrival
        order). Raises :class:`RequestError` if it is invalid or its ``request_id`` is already in flight."""
        result = self._add([request], params)[0]
        if isinstance(result, RequestError):
            raise result
        return result

    def has_unfinished_requests(self) -> bool:
        """Whether requests added with :meth:`add_request` are still waiting or running (a launched step not yet
        finished counts) or have outputs not yet returned (a :meth:`rank` or :meth:`generate` call that served them
        keeps their outputs for the next :meth:`step`)."""
        return self.scheduler.num_unfinished > 0 or bool(self._launched) or bool(self._undelivered)

    @property
    def num_running(self) -> int:
        """Requests admitted to a step and not yet answered (in launched steps that have not finished too)."""
        return len(self.scheduler.running) + sum(len(step.finished) for step in self._launched)

    @property
    def num_waiting(self) -> int:
        """Requests added and not yet admitted to a step."""
        return self.scheduler.num_unfinished - len(self.scheduler.running)

    def step(self) -> list[Output]:
        """Run one engine step; return the outputs of requests that finished (or failed) in it. Refused while steps of
        :meth:`launch_step` are unfinished (its own step would be finished before them)."""
        if self._launched:
            raise RuntimeError(f"{len(self._launched)} step(s) of launch_step() not finished: finish_step() them "
                               "before step()")
        return self.finish_step(self.launch_step())

    def finish_step(self, step: LaunchedStep) -> list[Output]:
        """Wait for a step of :meth:`launch_step` (finish steps once each, in launch order); return the outputs of
        the requests that finished (or failed) in it."""
        outputs = self._undelivered + [out for _, out in self._collect(step)]
        self._undelivered = []
        return outputs

    def add_requests(self, requests: Sequence[RankRequest | GenerateRequest],
                     params: GenerateParams | None = None) -> list[int | RequestError]:
        """:meth:`add_request` for each, in one faster intake pass: sequence numbers or the refusing errors."""
        return self._add(requests, params)

    def _add(self, requests: Sequence[Any], params: GenerateParams | None) -> list[int | RequestError]:
        """Intake (:meth:`~.intake.RequestIntake.add`) of requests whose ``params`` pass :func:`check_params`; else
        each is refused with its error, and no step sees them."""
        try:
            check_params(params)
        except RequestError as exc:
            return [exc] * len(requests)
        return self.intake.add(requests, params)

    def abort_waiting(self, request_ids: Collection[str], error: str) -> list[Output]:
        """Drop the requests among ``request_ids`` (added with :meth:`add_request`) that no step has started;
        return their outputs, whose ``error`` is ``error``. Requests already running are left to finish. A string for
        ``request_ids`` raises ``TypeError`` (its characters would be taken for ids)."""
        if isinstance(request_ids, str):
            raise TypeError(f"request_ids must be a collection of request ids, not the string {request_ids!r}")
        ids = set(request_ids)
        dropped = self.scheduler.drop_waiting(lambda state: state.payload.request.request_id in ids)
        if dropped and not self.scheduler.num_unfinished:
            self.kv.hand_back_prefetched()
        return [self._output(state, None, error=error) for state in dropped]

    # ------------------------------------------------------------------ batch API
    def rank(self, requests: Sequence[RankRequest], use_tqdm: bool = True) -> list[RankOutput]:
        """Score every request's candidates; outputs in input order (failed ones carry ``error``)."""
        return self._run(requests, None, use_tqdm, "Ranking")

    def generate(self, requests: Sequence[GenerateRequest], params: GenerateParams | None = None,
                 use_tqdm: bool = True) -> list[GenerateOutput]:
        """Retrieve the ``params.top_k`` most likely next items for each request's user, in input order.
        Ranking requests are accepted too (their candidates are ignored)."""
        return self._run(requests, params or GenerateParams(), use_tqdm, "Retrieving")

    # ------------------------------------------------------------------ internals
    def _run(self, requests: Sequence[Any], params: GenerateParams | None, use_tqdm: bool, desc: str) -> list[Any]:
        if self._launched:  # its steps would be collected out of launch order: refuse before intake
            raise RuntimeError(f"{len(self._launched)} step(s) of launch_step() not finished: finish_step() them "
                               "before rank() or generate()")
        results: list[Any] = [None] * len(requests)
        index: dict[int, int] = {}
        failed_type = RankOutput if params is None else GenerateOutput
        for start in range(0, len(requests), _INTAKE_BATCH):
            part = requests[start:start + _INTAKE_BATCH]
            for i, (request, added) in enumerate(zip(part, self._add(part, params), strict=True), start):
                if isinstance(added, RequestError):
                    request_id, user_id = request_labels(request)
                    results[i] = failed_type(request_id=request_id, user_id=user_id, error=str(added))
                else:
                    index[added] = i
        # No bar object at all without tqdm: even a disabled one costs host time per call.
        bar = tqdm(total=len(requests), desc=desc, unit="req", initial=len(requests) - len(index)) if use_tqdm else None
        pending: LaunchedStep | None = None  # launched, not yet collected: the next launch overlaps its device work
        try:
            while index:
                launched = self.launch_step() if self.scheduler.num_unfinished else None
                if pending is None and launched is None:
                    raise RuntimeError("requests in flight but none queued or launched")
                if pending is not None:
                    collecting, pending = pending, None
                    for state, output in self._collect(collecting):
                        slot = index.pop(state.seq_id, None)
                        if slot is None:
                            self._undelivered.append(output)  # added earlier through add_request
                        else:
                            results[slot] = output
                            if bar is not None:
                                bar.update(1)
                pending = launched
        finally:
            if pending is not None:  # requests added through add_request (or, when something raised, these too)
                self._undelivered += [output for _, output in self._collect(pending)]
            if bar is not None:
                bar.close()
        return results

    def warmup(self, use_tqdm: bool = True) -> int:
        """Once at start-up, before serving, so that no later step compiles a kernel or captures a graph
        (:meth:`stalls`): run the host tier's transfer kernels (:meth:`~cache_engine.KVCacheManager.warm_transfers`),
        one eager step of each launch shape (:meth:`ModelRunner.warm_eager`) and capture every step graph
        (:meth:`ModelRunner.capture_graphs`), writing only free pages. Returns how many (bucket, launch shape)
        forwards were captured (0 without step graphs)."""
        if self.has_unfinished_requests():
            raise RuntimeError("warmup() runs between calls, not while requests are in flight")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # free pages may still be read by gathers in flight
        self.kv.warm_transfers()
        graphs = self.runner.graphs
        pages = np.empty(self.kv.pool.num_free, dtype=np.int32)
        self.kv.pool.allocate(pages)
        try:
            self.runner.warm_eager(pages)
            return 0 if graphs is None else self.runner.capture_graphs(pages[: graphs.max_pages], use_tqdm)
        finally:
            self.kv.pool.free(pages)

    def stalls(self) -> StallCounts:
        """Kernel compilations and graph captures since the engine was built (each stalls the step it happens in):
        after :meth:`warmup`, serving leaves them unchanged."""
        graphs = self.runner.graphs
        return StallCounts(self._compiles.compilations, self._compiles.cache_loads,
                           0 if graphs is None else graphs.num_graphs)

    def close(self) -> None:
        """Finish in-flight transfers and stop background work (the engine stays usable)."""
        self.kv.close()

    def __enter__(self) -> GREngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def launch_step(self) -> LaunchedStep:
        """Schedule one step and queue it on the device without waiting for it (async scheduling): while the device
        computes it, the host may add requests and launch the next step, whose requests (a user's next visit too)
        read what this one writes in device order; :meth:`finish_step` returns its outputs (docs/design.md section
        3). Onloads launch before the metadata is built (PCIe copies overlap host work); requests commit and the
        scores' copy to the host is queued before anything waits for the device."""
        timer = PhaseTimer(self.device if self.config.sync_phases and self.device.type == "cuda" else None)
        # Bytes this step moves: from here on (acquires plan onloads and persist evicted tails), plus its prefetches'.
        onloaded, offloaded = self.kv.transferred_bytes
        with timer("schedule"):  # 1 (and 2's cache side: admitted requests acquire their pages)
            self.kv.begin_step()
            plan = self.scheduler.schedule()
        step = LaunchedStep([(state, self._output(state, None, error=reason)) for state, reason in plan.failed])
        self._launched.append(step)
        if not plan.chunks:
            self.kv.hand_back_prefetched()  # their pages may be what the waiting requests need
            return step
        chunks = step.chunks = plan.chunks
        step.plan, step.timer = plan, timer
        prefetch_s, prefetch_bytes = self.intake.take_prefetch()  # counted in this step's metrics
        moved = (onloaded - prefetch_bytes[0], offloaded - prefetch_bytes[1])
        timer.add("onload", prefetch_s)
        try:
            with timer("onload"):  # 3
                layer_ready = self.kv.launch_onloads()
            with timer("prepare"):  # 2
                meta = self.runner.prepare(chunks)
            with timer("strip"):  # 4
                inputs = self.runner.strip(chunks, meta)
            with timer("forward"):  # 5
                started = self.runner.mark_forward()
                out = self.runner.forward(inputs, layer_ready)
        except Exception as exc:  # never crash the caller: retry batch-mates alone, fail the culprit
            logger.exception("engine step failed")
            step.chunks = []
            step.done += self._fail_step(chunks, exc)
            return step
        with timer("commit"):  # 7: bookkeeping while the device computes (offloads wait for the compute stream)
            self.intake.hash_deferred([chunk.request for chunk in chunks])  # first visits: hashed while it computes
            step.finished = {id(state) for state in self.scheduler.complete(chunks)}
            self.kv.end_step()
        try:
            with timer("score"):  # 6, its device side: the heads and the copies to the host
                step.scores = self.runner.fetch(chunks, meta, out, started)
        except Exception as exc:  # the requests are committed: fail the finishing ones, keep their cached K/V
            logger.exception("engine step failed while scoring")
            step.error = f"engine step failed: {exc!r}"
        onloaded, offloaded = self.kv.transferred_bytes
        step.transferred = (onloaded - moved[0], offloaded - moved[1])
        return step

    def _collect(self, step: LaunchedStep) -> list[tuple[RequestState, Output]]:
        """Wait for a launched step's scores (steps are collected in launch order); its outputs."""
        if not self._launched or self._launched[0] is not step:
            raise RuntimeError("launched steps must be finished once each, in launch order")
        self._launched.popleft()
        done, chunks, timer = step.done, step.chunks, step.timer
        if not chunks:
            return done
        results: list[ChunkResult | None] = [None] * len(chunks)
        device_s = None
        if step.scores is not None:
            try:
                with timer("score"):  # 6, waiting for the device
                    results = step.scores.wait()
                device_s = step.scores.device_seconds()
            except Exception as exc:
                logger.exception("engine step failed while scoring")
                step.error = f"engine step failed: {exc!r}"
        plan = step.plan
        self.stats.record_step(StepMetrics(
            num_requests=len(chunks), num_tokens=sum(c.num_tokens for c in chunks),
            gpu_hit_tokens=sum(r.num_gpu_hits for r in plan.admitted),
            host_hit_tokens=sum(r.num_host_hits for r in plan.admitted),
            history_tokens=sum(r.num_history for r in plan.admitted),
            onloaded_bytes=step.transferred[0], offloaded_bytes=step.transferred[1], phases=timer.seconds,
            device_s=device_s,
        ))
        for chunk, result in zip(chunks, results, strict=True):
            state = chunk.request
            for name, seconds in timer.seconds.items():
                state.timings[name] = state.timings.get(name, 0.0) + seconds
            if id(state) in step.finished:
                done.append((state, self._output(state, result, error=step.error)))
        return done

    def _fail_step(self, chunks: list[ScheduledChunk], exc: Exception) -> list[tuple[RequestState, Output]]:
        """A step failed before scoring: its requests are retried alone (a request alone fails with the error)."""
        failed = []
        for chunk in chunks:
            if len(chunks) > 1 and not chunk.request.solo:
                self.scheduler.retry_alone(chunk.request)
                continue
            self.scheduler.abort(chunk.request)
            failed.append((chunk.request, self._output(chunk.request, None, error=f"engine step failed: {exc!r}")))
        return failed

    def _output(self, state: RequestState, result: ChunkResult | None, error: str | None = None) -> Output:
        payload: RequestPayload = state.payload
        self.intake.finished(payload.request.request_id)
        if error is None and payload.params is None and not np.isfinite(result.logits).all():
            error = "the model produced non-finite scores (NaN or inf): check its weights and model settings"
        ok = error is None
        fields = dict(
            request_id=payload.request.request_id, user_id=state.user_id,
            num_gpu_cached_tokens=state.num_gpu_hits if ok else 0,
            num_host_cached_tokens=state.num_host_hits if ok else 0,
            num_computed_tokens=state.num_history - state.num_reused if ok else 0,
            timings=StepTimings(**state.timings), latency_s=time.perf_counter() - payload.arrival_s,
            error=error,
        )
        if ok:
            self.stats.record_request(state.num_history, state.num_gpu_hits, state.num_host_hits)
        if payload.params is None:
            return RankOutput(scores=result.logits, **fields) if ok else RankOutput(**fields)
        return GenerateOutput(item_ids=result.item_ids if ok else [], scores=result.scores if ok else [], **fields)

