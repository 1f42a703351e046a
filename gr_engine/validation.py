"""Checking requests before they reach the engine; every problem gets a clear message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import EngineConfig
from .request import GenerateParams, GenerateRequest, RankRequest

_INT64 = np.dtype(np.int64)
_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)
_UINT64_MAX = int(np.iinfo(np.uint64).max)  # an int user_id may be a signed or an unsigned 64-bit id
_JOIN_LIMIT = 1024  # values_valid checks longer unchecked histories request by request, without copying them
_OUT_OF_INT64 = f"outside the 64-bit integer range [{_INT64_MIN}, {_INT64_MAX}]"
_SEPARATOR = np.array([np.iinfo(np.int64).max, np.iinfo(np.int64).min], dtype=np.int64)  # between requests' timestamps


class RequestError(ValueError):
    """A request that cannot be served; the message says why. Only that request fails."""


@dataclass
class RequestArrays:
    """A validated request's fields as int64 numpy arrays: history events ``item_ids``, ``action_ids``,
    ``timestamps`` ``[n]``; ``candidate_item_ids`` ``[c]`` (empty for retrieval)."""

    item_ids: np.ndarray
    action_ids: np.ndarray
    timestamps: np.ndarray
    candidate_item_ids: np.ndarray

    @property
    def num_history(self) -> int:
        """History events of the request."""
        return len(self.item_ids)


def _int_array(name: str, value: Any) -> np.ndarray:
    if type(value) is np.ndarray and value.dtype == _INT64 and value.ndim == 1:
        return value  # the common case, as a deserialiser makes them: nothing to convert
    if isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (list, tuple)):
        if len(value) == 0:
            return np.zeros(0, dtype=np.int64)
        try:
            array = np.asarray(value)
        except (ValueError, TypeError) as exc:
            raise RequestError(f"{name} must be a flat list of integers ({exc})") from None
    else:
        raise RequestError(f"{name} must be a list of integers, got {type(value).__name__}")
    if array.ndim == 1 and array.dtype.kind in "Of" and isinstance(value, (list, tuple)):
        for v in value:  # numpy holds ints beyond 64 bits as objects (or floats): say so
            if isinstance(v, int) and not isinstance(v, bool) and not _INT64_MIN <= v <= _INT64_MAX:
                raise RequestError(f"{name} contains {v}, {_OUT_OF_INT64}")
    if array.ndim != 1 or array.dtype.kind not in "iu":
        what = f"{array.ndim}-D array" if array.ndim != 1 else f"elements of type {array.dtype}"
        raise RequestError(f"{name} must be a flat list of integers, got {what}")
    if array.dtype.kind == "u" and len(array) and int(array.max()) > _INT64_MAX:  # would wrap around
        raise RequestError(f"{name} contains {int(array.max())}, {_OUT_OF_INT64}")
    return array.astype(_INT64, copy=False)


def _check_range(name: str, array: np.ndarray, upper: int, what: str) -> None:
    # One pass: viewed as unsigned, a negative int64 is >= 2**63, so the maximum alone decides.
    if len(array) and array.view(np.uint64).max() >= upper:
        bad = array[(array < 0) | (array >= upper)][0]
        raise RequestError(f"{name} contains {bad}, outside the {what} [0, {upper})")


def parse_fields(request: Any, config: EngineConfig, *, ranking: bool) -> RequestArrays:
    """Check one request's types and lengths against the model and cache limits; :func:`check_candidates` and
    :func:`check_events` (or :func:`values_valid`, for a whole batch) check its values.

    Args:
        request: a :class:`RankRequest` (``ranking=True``), or a :class:`GenerateRequest` or
            :class:`RankRequest` whose candidates are ignored (``ranking=False``).
        config: the engine's configuration.
        ranking: whether candidates are required and scored.

    Raises:
        RequestError: what is wrong with the request.
    """
    wanted = RankRequest if ranking else GenerateRequest
    if not isinstance(request, wanted):
        raise RequestError(f"expected a {wanted.__name__}, got {type(request).__name__}")
    if not isinstance(request.request_id, str):
        raise RequestError(f"request_id must be a string, got {type(request.request_id).__name__}")
    if isinstance(request.user_id, bool) or not isinstance(request.user_id, (int, str)):
        raise RequestError(f"user_id must be an int or a string, got {type(request.user_id).__name__}")
    if isinstance(request.user_id, int) and not _INT64_MIN <= request.user_id <= _UINT64_MAX:
        raise RequestError(f"user_id {request.user_id} does not fit in 64 bits (signed or unsigned): the range is "
                           f"[{_INT64_MIN}, {_UINT64_MAX}]")
    model = config.model
    items = _int_array("item_ids", request.item_ids)
    actions = _int_array("action_ids", request.action_ids)
    times = _int_array("timestamps", request.timestamps)
    if not len(items) == len(actions) == len(times):
        raise RequestError(f"history fields differ in length: item_ids {len(items)}, action_ids {len(actions)}, "
                           f"timestamps {len(times)}")
    n = len(items)
    if model.time_bias_buckets and n and int(times[-1]) - int(times[0]) > _INT64_MAX - 1:
        # the bias buckets |t_query - t_key| + 1 in int64 (torch_ref and the kernels alike): it must not wrap
        raise RequestError(f"timestamps span {int(times[-1]) - int(times[0])}: with a time bias (model."
                           f"time_bias_buckets) the first and last event may be at most {_INT64_MAX - 1} apart")
    if n > model.max_history_len:
        raise RequestError(f"history of {n} events exceeds model.max_history_len ({model.max_history_len})")
    if not ranking and n == 0:
        raise RequestError("retrieval needs at least one history event")
    pages = -(-n // config.cache.page_size)
    if pages > config.cache.num_gpu_pages:
        raise RequestError(f"history of {n} events needs {pages} KV pages but cache.num_gpu_pages is "
                           f"{config.cache.num_gpu_pages}")
    candidates = np.zeros(0, dtype=np.int64)
    if ranking:
        candidates = _int_array("candidate_item_ids", request.candidate_item_ids)
        if len(candidates) == 0:
            raise RequestError("candidate_item_ids is empty: nothing to rank")
        if len(candidates) > model.max_candidates:
            raise RequestError(f"{len(candidates)} candidates exceed model.max_candidates ({model.max_candidates})")
    return RequestArrays(items, actions, times, candidates)


def check_params(params: Any) -> None:
    """Raise :class:`RequestError` unless ``params`` is ``None`` (ranking) or :class:`GenerateParams` with an integer
    ``top_k`` in ``[1, 2**63 - 1]`` (numpy's too; not a bool) and a bool ``exclude_history``. A struct built in Python
    is not type-checked: ``top_k=1.5`` would fail its whole step, batch-mates too, and ``exclude_history="no"`` would
    exclude."""
    if params is None:
        return
    if not isinstance(params, GenerateParams):
        raise RequestError(f"params must be a GenerateParams, got {type(params).__name__}")
    top_k = params.top_k
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)):
        raise RequestError(f"top_k must be an integer, got {type(top_k).__name__}")
    if not 1 <= top_k <= _INT64_MAX:
        raise RequestError(f"top_k must be in [1, {_INT64_MAX}], got {top_k}")
    if not isinstance(params.exclude_history, (bool, np.bool_)):
        raise RequestError(f"exclude_history must be a bool, got {type(params.exclude_history).__name__}")


def check_candidates(arrays: RequestArrays, config: EngineConfig) -> None:
    """Raise :class:`RequestError` for the first candidate outside the item vocabulary."""
    _check_range("candidate_item_ids", arrays.candidate_item_ids, config.model.num_items, "item vocabulary")


def check_events(arrays: RequestArrays, config: EngineConfig, start: int = 0) -> None:
    """Check the events from ``start`` on (the first ``start`` are known valid: a history validated before): ids
    within the vocabularies, timestamps non-decreasing from event ``start - 1``. Raises :class:`RequestError`."""
    model = config.model
    _check_range("item_ids", arrays.item_ids[start:], model.num_items, "item vocabulary")
    _check_range("action_ids", arrays.action_ids[start:], model.num_actions, "action vocabulary")
    first = max(start - 1, 0)
    times = arrays.timestamps[first:]
    if len(times) > 1 and bool((times[1:] < times[:-1]).any()):
        at = int(np.argmax(times[1:] < times[:-1])) + 1
        raise RequestError(f"timestamps go backwards at event {first + at} ({times[at - 1]} -> {times[at]})")


def values_valid(batch: Sequence[tuple[RequestArrays, int]], config: EngineConfig) -> bool:
    """Whether every ``(arrays, start)`` of ``batch`` passes :func:`check_candidates` and :func:`check_events` from
    ``start``, in one vectorised pass (histories with over ``_JOIN_LIMIT`` unchecked events are checked in place).
    When ``False``, those checks request by request say which fails."""
    if not batch:
        return True
    items: list[np.ndarray] = []  # new item_ids and candidates, then new action_ids, then timestamps from start - 1
    actions: list[np.ndarray] = []
    times: list[np.ndarray] = []
    for arrays, start in batch:
        if len(arrays.item_ids) - start > _JOIN_LIMIT:  # checked where it is: copying it would cost more
            try:
                check_events(arrays, config, start)
            except RequestError:
                return False
            items.append(arrays.candidate_item_ids)
            continue
        items += (arrays.item_ids[start:], arrays.candidate_item_ids)
        actions.append(arrays.action_ids[start:])
        times += (arrays.timestamps[max(start - 1, 0):], _SEPARATOR)
    num_items, num_actions = sum(map(len, items)), sum(map(len, actions))
    joined = np.concatenate(items + actions + times)
    model, unsigned, split = config.model, joined.view(np.uint64), num_items + num_actions
    # As in _check_range: viewed as unsigned, a negative int64 is >= 2**63, so the maximum alone decides.
    if (num_items and np.maximum.reduce(unsigned[:num_items]) >= model.num_items) or (
            num_actions and np.maximum.reduce(unsigned[num_items:split]) >= model.num_actions):
        return False
    # Each request's timestamps are followed by a separator (int64 max, int64 min): the step into it never goes
    # backwards, the step out of it never does either, and the one within it always does.
    times_from = joined[split:]
    return int(np.count_nonzero(times_from[1:] < times_from[:-1])) == len(times) // 2
