"""What the engine returns, one output per request, in the order the requests were given."""

from __future__ import annotations

import msgspec
import numpy as np


class StepTimings(msgspec.Struct, kw_only=True):
    """Seconds spent in each phase of the engine steps that served a request (docs/design.md section 3),
    summed over those steps. Each step's phases are shared by all requests in it; ``intake`` (validating
    and hashing the request when it was added) is the request's own."""

    intake: float = 0.0
    schedule: float = 0.0
    prepare: float = 0.0
    onload: float = 0.0
    strip: float = 0.0
    forward: float = 0.0
    score: float = 0.0
    commit: float = 0.0

    @property
    def total(self) -> float:
        """The sum of every phase's seconds."""
        return sum(msgspec.structs.astuple(self))


class _OutputBase(msgspec.Struct, kw_only=True):
    """Fields common to every output.

    Attributes:
        request_id, user_id: copied from the request.
        num_gpu_cached_tokens: history tokens whose KV was served from GPU pages.
        num_host_cached_tokens: history tokens whose KV was loaded from host memory.
        num_computed_tokens: history tokens encoded by this request.
        timings: per-phase seconds of the steps that served the request.
        latency_s: seconds from arrival to completion.
        error: why the request failed (then the result fields are empty); ``None`` on success.
    """

    request_id: str
    user_id: int | str | None = None
    num_gpu_cached_tokens: int = 0
    num_host_cached_tokens: int = 0
    num_computed_tokens: int = 0
    timings: StepTimings = msgspec.field(default_factory=StepTimings)
    latency_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the request was served (no ``error``)."""
        return self.error is None


def output_user_id(value: object) -> int | str | None:
    """``value`` if it can be an output's ``user_id`` (a string, or an int that is not a bool), else ``None``: what
    a failed request's output reports of a user id that may be malformed."""
    return value if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)) else None


class RankOutput(_OutputBase, kw_only=True):
    """Scores of a ranking request.

    Attributes:
        scores: float32 numpy ``[num_candidates, num_tasks]`` logits (sigmoid: probabilities), in candidate order;
            ``[0, 0]`` on error. An array, as lists cost host time (files and HTTP answers write it as nested
            lists: :func:`~gr_engine.output_writer.array_as_lists`).
    """

    scores: np.ndarray = msgspec.field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))


class GenerateOutput(_OutputBase, kw_only=True):
    """Retrieval result.

    Attributes:
        item_ids: the ``top_k`` retrieved items, best first; empty on error.
        scores: their retrieval scores (dot products with the user's last history state).
    """

    item_ids: list[int] = msgspec.field(default_factory=list)
    scores: list[float] = msgspec.field(default_factory=list)
