"""The messages between the engine-core process and its clients (msgpack, via msgspec).

A client connects to the core's input socket, says :class:`Hello` with the address of its own output socket, then
sends requests; the core sends each client its own outputs, and every client the counters. Arrays cross as raw
little-endian bytes (:func:`array_bytes` on the way out, :func:`int64_array` / ``np.frombuffer`` on arrival: no
per-element work): histories and candidates int64, ranking scores float32 ``[num_candidates, num_tasks]``
row-major. Requests carry the client's own id (``core_id``, unique among that client's requests), so that callers
may reuse their ``request_id``s. The HTTP server's msgpack bodies (:mod:`.bodies`) use the same byte layouts.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ..outputs import GenerateOutput, RankOutput, StepTimings
from ..request import GenerateParams, GenerateRequest, RankRequest
from ..validation import RequestArrays, RequestError

INT64 = np.dtype("<i8")  # history fields and candidates as bytes
FLOAT32 = np.dtype("<f4")  # scores as bytes
#: Upper bounds (s) of the engine-step histogram the core keeps (:attr:`CoreStats.step_buckets`).
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)
#: The fields of :class:`CoreStats` that are the cache's own counters (:attr:`cache_engine.KVCacheManager.stats`),
#: by the same names.
CACHE_COUNTERS = ("evicted_users", "evicted_tokens", "truncated_tokens", "prefetched_tokens", "host_evicted_users",
                  "onloaded_tokens", "offloaded_tokens", "tail_persisted_tokens", "lost_tokens", "deferred_offloads",
                  "unfinished_copy_tokens")


def array_bytes(array: object, dtype: np.dtype) -> bytes:
    """The raw bytes of ``array`` (any array-like) as a C-ordered array of ``dtype`` (:data:`INT64` or
    :data:`FLOAT32`)."""
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def int64_array(name: str, buffer: bytes | memoryview) -> np.ndarray:
    """A read-only int64 ``[len(buffer) // 8]`` array over ``buffer`` (little-endian int64 raw bytes), no copy.

    Raises:
        RequestError: ``buffer``'s size is not a multiple of 8 bytes.
    """
    if len(buffer) % INT64.itemsize:
        raise RequestError(f"{name} holds {len(buffer)} bytes, not a whole number of little-endian int64 values "
                           f"({INT64.itemsize} bytes each)")
    return np.frombuffer(buffer, dtype=INT64)


class Hello(msgspec.Struct, array_like=True, tag="hello"):
    """A client's first message: ``address`` is its PULL socket's, where the core then connects to send it reports."""

    address: str


class CoreRequest(msgspec.Struct, array_like=True, tag="request"):
    """A request whose types, lengths and candidates the client checked (:mod:`gr_engine.validation`).

    Attributes:
        core_id: the client's id for it (the engine's ``request_id`` in the core).
        user_id: the caller's.
        item_ids, action_ids, timestamps: int64 ``[n]`` history events, as raw little-endian bytes (decoded as
            views of the received message, not copies).
        candidate_item_ids: int64 ``[c]`` candidates, the same way; ``None`` for retrieval.
        params: retrieval settings (``None`` for ranking).
        deadline: ``time.monotonic()`` after which the request must not start (``None``: no deadline).
    """

    core_id: int
    user_id: int | str
    item_ids: memoryview
    action_ids: memoryview
    timestamps: memoryview
    candidate_item_ids: memoryview | None
    params: GenerateParams | None
    deadline: float | None


class Abort(msgspec.Struct, array_like=True, tag="abort"):
    """Drop these requests if they have not started; ``reason`` becomes their error, ``kind`` (``"cancelled"`` or
    ``"timeout"``) its kind."""

    core_ids: list[int]
    reason: str
    kind: str


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    """The client leaves: the core answers its accepted requests, then reports ``"stopped"`` to it. Once every
    client the core was started for has left, the core completes pending offloads and exits (the last client's
    ``"stopped"`` comes after that)."""


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
        steps, step_seconds: engine steps, and their wall seconds, since start.
        step_buckets: steps since start that took at most each of :data:`STEP_BUCKETS` (cumulative counts).
        computed_tokens, gpu_hit_tokens, host_hit_tokens: totals (tokens computed; history tokens reused).
        gpu_pages_used, gpu_pages_free: the GPU page pool now.
        host_bytes_used: bytes of host chunk slots holding history now.
        onloaded_bytes, offloaded_bytes: totals moved between host and GPU.
        kernel_compilations, kernel_cache_loads, graph_captures: the engine's stalls since it was built
            (:meth:`~gr_engine.GREngine.stalls`; unchanged after warm-up).
        queue_wait_s: the core's estimate of how long a request arriving now waits before a step takes it (s):
            ``waiting`` times ``service_s``; 0 while nothing waits.
        service_s: the recent busy wall seconds per answered request (decayed over about the last
            :data:`~.core.SERVICE_STEPS` steps that answered requests; 0 before the first answer).
        finished_requests, history_tokens: requests the engine finished without error since start, and their
            history tokens (``history_tokens - gpu_hit_tokens - host_hit_tokens`` of them were computed).
        evicted_users, evicted_tokens, truncated_tokens, prefetched_tokens: the cache manager's counters
            (:class:`cache_engine.records.PoolStats`): users whose GPU pages were reclaimed and their cached tokens,
            cached tokens dropped for a history that no longer matched, tokens prefetched from host.
        host_evicted_users, onloaded_tokens, offloaded_tokens, tail_persisted_tokens, lost_tokens,
            deferred_offloads: the host tier's (:class:`cache_engine.records.HostStats`; 0 without one): users whose
            host copy was dropped for room (host LRU), tokens copied host to GPU and GPU to host, partial chunks
            persisted as their user left the GPU, tokens of users leaving the GPU that could not be kept on host,
            chunk-steps that full chunks waited for an offload slot.
        unfinished_copy_tokens: history tokens a returning request waited for because the user's copy to host,
            begun as the user left the GPU, had not finished (:class:`cache_engine.records.PoolStats`).

    Fields added after the first version carry defaults (0), so that a report of an older core still decodes (a
    message is an array: the missing trailing entries take their defaults).
    """

    running: int
    waiting: int
    steps: int
    step_seconds: float
    step_buckets: list[int]
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
    queue_wait_s: float
    service_s: float
    finished_requests: int = 0
    history_tokens: int = 0
    evicted_users: int = 0
    evicted_tokens: int = 0
    truncated_tokens: int = 0
    prefetched_tokens: int = 0
    host_evicted_users: int = 0
    onloaded_tokens: int = 0
    offloaded_tokens: int = 0
    tail_persisted_tokens: int = 0
    lost_tokens: int = 0
    deferred_offloads: int = 0
    unfinished_copy_tokens: int = 0


class CoreReport(msgspec.Struct, array_like=True):
    """What the core sends: outputs finished since the last report, its counters, and its state
    (``"warming"``, ``"ready"``, ``"stopped"``)."""

    outputs: list[CoreOutput]
    stats: CoreStats | None
    state: str


CoreInput = Hello | CoreRequest | Abort | Shutdown


def to_core(core_id: int, request: RankRequest | GenerateRequest, arrays: RequestArrays,
            params: GenerateParams | None, deadline: float | None) -> CoreRequest:
    """The message of a request whose fields :func:`~gr_engine.validation.parse_fields` turned into ``arrays``."""
    return CoreRequest(
        core_id=core_id, user_id=request.user_id,
        item_ids=_array_view(arrays.item_ids), action_ids=_array_view(arrays.action_ids),
        timestamps=_array_view(arrays.timestamps),
        candidate_item_ids=None if params is not None else _array_view(arrays.candidate_item_ids),
        params=params, deadline=deadline,
    )


def _array_view(array: np.ndarray) -> memoryview:
    """The bytes of an int64 array for encoding, without a copy when it is C-contiguous and little-endian."""
    return memoryview(np.ascontiguousarray(array, dtype=INT64))


def from_core(message: CoreRequest, request_id: str) -> RankRequest | GenerateRequest:
    """The engine's request of a message, named ``request_id``; history fields are read-only int64 arrays over the
    message's buffer (which they keep alive)."""
    fields = dict(request_id=request_id, user_id=message.user_id,
                  item_ids=int64_array("item_ids", message.item_ids),
                  action_ids=int64_array("action_ids", message.action_ids),
                  timestamps=int64_array("timestamps", message.timestamps))
    if message.candidate_item_ids is None:
        return GenerateRequest(**fields)
    return RankRequest(candidate_item_ids=int64_array("candidate_item_ids", message.candidate_item_ids), **fields)


def output_message(core_id: int, output: RankOutput | GenerateOutput, error_kind: str | None) -> CoreOutput:
    """The message of an engine output."""
    if isinstance(output, RankOutput):
        items, num_tasks = b"", output.scores.shape[1]
    else:
        items, num_tasks = array_bytes(output.item_ids, INT64), 0
    return CoreOutput(
        core_id=core_id, error=output.error, error_kind=error_kind if output.error is not None else None,
        scores=array_bytes(output.scores, FLOAT32), item_ids=items, num_tasks=num_tasks,
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
    scores = np.frombuffer(message.scores, dtype=FLOAT32).astype(np.float32)
    if ranking:
        if message.error is None:
            fields["scores"] = scores.reshape(-1, message.num_tasks)
        return RankOutput(**fields)
    return GenerateOutput(item_ids=int64_array("item_ids", message.item_ids).tolist(),
                          scores=scores.tolist(), **fields)
