"""Engine metrics: per-step records and totals since start (token hit ratios, transfers, phase times)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

PHASES = ("intake", "schedule", "prepare", "onload", "strip", "forward", "score", "commit")
"""Where time goes (docs/design.md section 3): ``intake`` (validating and hashing a request when it is added, per
request), then the phases of every step: ``schedule`` (applying finished transfers, choosing the step's requests and
admitting each with its cache lookup: prefix validation, page allocation, evictions), ``onload`` (launching the copies
from host, and the prefetches since the last step), ``prepare`` (the page tables and row layout), ``strip`` (the model
input), ``forward``, ``commit`` (advancing the cached lengths, starting offloads) and ``score`` (the heads, and
waiting for the device)."""

HOST_PHASES = ("schedule", "prepare", "onload", "strip", "commit")
"""The step phases that are pure host work (the benchmark's overhead; forward and score also wait for the device)."""


class PhaseTimer:
    """Seconds per phase of one step: ``with timer("forward"): ...`` adds the block's time to ``seconds["forward"]``.

    Args:
        sync_device: a CUDA device to synchronise at the end of each block, so that a phase's time includes the
            device work it queued (for breakdowns; it serialises the pipeline), or ``None``.
    """

    __slots__ = ("_name", "_start", "_sync_device", "seconds")

    def __init__(self, sync_device: torch.device | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self._sync_device = sync_device
        self._name, self._start = "", 0.0

    def __call__(self, name: str) -> PhaseTimer:
        self._name = name
        return self

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self._sync_device is not None:
            torch.cuda.synchronize(self._sync_device)
        self.add(self._name, time.perf_counter() - self._start)

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` more in phase ``name``."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


class _HitRatios:
    """The hit ratios of a record's ``history_tokens``, ``gpu_hit_tokens`` and ``host_hit_tokens``."""

    history_tokens: int
    gpu_hit_tokens: int
    host_hit_tokens: int

    @property
    def gpu_hit_ratio(self) -> float:
        """Fraction of the history tokens served from GPU pages."""
        return self.gpu_hit_tokens / self.history_tokens if self.history_tokens else 0.0

    @property
    def total_hit_ratio(self) -> float:
        """Fraction of the history tokens not recomputed (GPU or host hits)."""
        return (self.gpu_hit_tokens + self.host_hit_tokens) / self.history_tokens if self.history_tokens else 0.0


@dataclass
class StepMetrics(_HitRatios):
    """One engine step.

    Attributes:
        num_requests: requests in the step.
        num_tokens: tokens computed (uncached history + candidates).
        history_tokens: history tokens of the requests admitted in this step.
        gpu_hit_tokens: of those, tokens served from GPU pages.
        host_hit_tokens: of those, tokens loaded from host chunks.
        onloaded_bytes: bytes copied host -> GPU for this step.
        offloaded_bytes: bytes whose GPU -> host copy started in this step.
        phases: seconds per phase (:data:`PHASES`) on the host's clock.
        device_s: the compute stream's seconds from the step's forward to its results on the host (CUDA; ``None``
            on CPU): its device time, onload waits included.
    """

    num_requests: int
    num_tokens: int
    history_tokens: int
    gpu_hit_tokens: int
    host_hit_tokens: int
    onloaded_bytes: int
    offloaded_bytes: int
    phases: dict[str, float]
    device_s: float | None = None


@dataclass
class EngineStats(_HitRatios):
    """Totals since the engine started, and the most recent steps.

    Attributes:
        num_steps: engine steps that ran the model.
        num_requests: requests that finished successfully.
        num_computed_step_tokens: tokens computed (history + candidates) over all steps.
        history_tokens: history tokens of finished requests.
        gpu_hit_tokens: of those, tokens served from GPU pages.
        host_hit_tokens: of those, tokens loaded from host memory.
        onloaded_bytes, offloaded_bytes: host <-> GPU KV traffic.
        phase_seconds: seconds per step phase (:data:`PHASES`).
        recent_steps: the last ``maxlen`` :class:`StepMetrics`.
    """

    num_steps: int = 0
    num_requests: int = 0
    num_computed_step_tokens: int = 0
    history_tokens: int = 0
    gpu_hit_tokens: int = 0
    host_hit_tokens: int = 0
    onloaded_bytes: int = 0
    offloaded_bytes: int = 0
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    recent_steps: deque[StepMetrics] = field(default_factory=lambda: deque(maxlen=4096))

    def record_step(self, step: StepMetrics) -> None:
        """Add one step's counters and phase times."""
        self.num_steps += 1
        self.num_computed_step_tokens += step.num_tokens
        self.onloaded_bytes += step.onloaded_bytes
        self.offloaded_bytes += step.offloaded_bytes
        for name, seconds in step.phases.items():
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds
        self.recent_steps.append(step)

    def record_intake(self, seconds: float) -> None:
        """A request was validated and hashed in ``seconds``."""
        self.phase_seconds["intake"] = self.phase_seconds.get("intake", 0.0) + seconds

    def record_request(self, history_tokens: int, gpu_hits: int, host_hits: int = 0) -> None:
        """A request finished: its history tokens and how many were GPU and host cache hits."""
        self.num_requests += 1
        self.history_tokens += history_tokens
        self.gpu_hit_tokens += gpu_hits
        self.host_hit_tokens += host_hits
