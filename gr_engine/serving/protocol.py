"""The messages between the engine-core process and its clients (msgpack, via msgspec).

Arrays cross as raw native-endian bytes (``np.frombuffer`` on arrival, no per-element work): histories and
candidates int64, ranking scores float32 ``[num_candidates, num_tasks]`` row-major. Requests carry the client's own
id (``core_id``, unique among the client's requests), so that callers may reuse their ``request_id``s.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ..outputs import GenerateOutput, RankOutput, StepTimings
from ..request import GenerateParams, GenerateRequest, RankRequest
from ..validation import RequestArrays


class CoreRequest(msgspec.Struct, array_like=True, tag="request"):
    """A request whose types, lengths and candidates the client checked (:mod:`gr_engine.validation`).

    Attributes:
        core_id: the client's id for it (the engine's ``request_id`` in the core).
        user_id: the caller's.
        item_ids, action_ids, timestamps: int64 ``[n]`` history events, as bytes.
        candidate_item_ids: int64 ``[c]`` candidates as bytes; ``None`` for retrieval.
        params: retrieval settings (``None`` for ranking).
        deadline: ``time.monotonic()`` after which the request must not start (``None``: no deadline).
    """

    core_id: int
    user_id: int | str
    item_ids: bytes
    action_ids: bytes
    timestamps: bytes
    candidate_item_ids: bytes | None
    params: GenerateParams | None
    deadline: float | None


class Abort(msgspec.Struct, array_like=True, tag="abort"):
    """Drop these requests if they have not started; ``reason`` becomes their error, ``kind`` (``"cancelled"`` or
    ``"timeout"``) its kind."""

    core_ids: list[int]
    reason: str
    kind: str


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    """Finish every accepted request, complete pending offloads, exit."""


class CoreOutput(msgspec.Struct, array_like=True):
    """One finished (or failed) request.

    Attributes:
        core_id: the client's id of the request.
        error: why it failed (``None`` on success); ``error_kind`` names the cause for metrics: ``"invalid"``,
            ``"unservable"``, ``"engine"``, ``"cancelled"`` or ``"timeout"``.
        scores: float32 ``[num_candidates, num_tasks]`` ranking logits as bytes (retrieval: float32 ``[top_k]``).
        item_ids: int64 ``[top_k]`` retrieved items as bytes (empty for ranking).
        num_tasks: the second dimension of ranking ``scores``.
        queue_s: seconds from arrival at the core to the end, less those of the steps that served it.
    """

    core_id: int
    error: str | None
    error_kind: str | None
    scores: bytes
    item_ids: bytes
    num_tasks: int
    num_gpu_cached_tokens: int
    num_host_cached_tokens: int
    num_computed_tokens: int
    timings: StepTimings
    latency_s: float
    queue_s: float


class CoreStats(msgspec.Struct, array_like=True):
    """The core's counters since start and its gauges now (sent with every batch of outputs and as a heartbeat).

    Attributes:
        running, waiting: requests in the engine (running: admitted to a step; waiting: queued).
        step_seconds: wall seconds of each engine step since the last report.
        computed_tokens, gpu_hit_tokens, host_hit_tokens: totals (tokens computed; history tokens reused).
        gpu_pages_used, gpu_pages_free: the GPU page pool now.
        host_bytes_used: bytes of host chunk slots holding history now.
        onloaded_bytes, offloaded_bytes: totals moved between host and GPU.
        kernel_compilations, kernel_cache_loads, graph_captures: the engine's stalls since it was built
            (:meth:`~gr_engine.GREngine.stalls`; unchanged after warm-up).
    """

    running: int
    waiting: int
    step_seconds: list[float]
    computed_tokens: int
    gpu_hit_tokens: int
    host_hit_tokens: int
    gpu_pages_used: int
    gpu_pages_free: int
    host_bytes_used: int
    onloaded_bytes: int
    offloaded_bytes: int
    kernel_compilations: int
    kernel_cache_loads: int
    graph_captures: int


class CoreReport(msgspec.Struct, array_like=True):
    """What the core sends: outputs finished since the last report, its counters, and its state
    (``"warming"``, ``"ready"``, ``"stopped"``)."""

    outputs: list[CoreOutput]
    stats: CoreStats | None
    state: str


CoreInput = CoreRequest | Abort | Shutdown


def to_core(core_id: int, request: RankRequest | GenerateRequest, arrays: RequestArrays,
            params: GenerateParams | None, deadline: float | None) -> CoreRequest:
    """The message of a request whose fields :func:`~gr_engine.validation.parse_fields` turned into ``arrays``."""
    return CoreRequest(
        core_id=core_id, user_id=request.user_id,
        item_ids=arrays.item_ids.tobytes(), action_ids=arrays.action_ids.tobytes(),
        timestamps=arrays.timestamps.tobytes(),
        candidate_item_ids=None if params is not None else arrays.candidate_item_ids.tobytes(),
        params=params, deadline=deadline,
    )


def from_core(message: CoreRequest) -> RankRequest | GenerateRequest:
    """The engine's request of a message: ``request_id`` is the ``core_id``, history fields are read-only int64
    arrays over the message's bytes."""
    fields = dict(request_id=str(message.core_id), user_id=message.user_id,
                  item_ids=np.frombuffer(message.item_ids, dtype=np.int64),
                  action_ids=np.frombuffer(message.action_ids, dtype=np.int64),
                  timestamps=np.frombuffer(message.timestamps, dtype=np.int64))
    if message.candidate_item_ids is None:
        return GenerateRequest(**fields)
    return RankRequest(candidate_item_ids=np.frombuffer(message.candidate_item_ids, dtype=np.int64), **fields)


def output_message(core_id: int, output: RankOutput | GenerateOutput, error_kind: str | None) -> CoreOutput:
    """The message of an engine output."""
    if isinstance(output, RankOutput):
        scores, items, num_tasks = np.ascontiguousarray(output.scores, dtype=np.float32), b"", output.scores.shape[1]
    else:
        scores = np.asarray(output.scores, dtype=np.float32)
        items, num_tasks = np.asarray(output.item_ids, dtype=np.int64).tobytes(), 0
    return CoreOutput(
        core_id=core_id, error=output.error, error_kind=error_kind if output.error is not None else None,
        scores=scores.tobytes(), item_ids=items, num_tasks=num_tasks,
        num_gpu_cached_tokens=output.num_gpu_cached_tokens, num_host_cached_tokens=output.num_host_cached_tokens,
        num_computed_tokens=output.num_computed_tokens, timings=output.timings, latency_s=output.latency_s,
        queue_s=max(output.latency_s - output.timings.total + output.timings.intake, 0.0),
    )


def engine_output(message: CoreOutput, request: RankRequest | GenerateRequest, ranking: bool,
                  latency_s: float) -> RankOutput | GenerateOutput:
    """The engine output of a message, with the caller's ``request_id`` and ``user_id`` and the client's
    end-to-end ``latency_s``."""
    fields = dict(request_id=request.request_id, user_id=request.user_id,
                  num_gpu_cached_tokens=message.num_gpu_cached_tokens,
                  num_host_cached_tokens=message.num_host_cached_tokens,
                  num_computed_tokens=message.num_computed_tokens, timings=message.timings,
                  latency_s=latency_s, error=message.error)
    scores = np.frombuffer(message.scores, dtype=np.float32).copy()
    if ranking:
        if message.error is None:
            fields["scores"] = scores.reshape(-1, message.num_tasks)
        return RankOutput(**fields)
    return GenerateOutput(item_ids=np.frombuffer(message.item_ids, dtype=np.int64).tolist(),
                          scores=scores.tolist(), **fields)
