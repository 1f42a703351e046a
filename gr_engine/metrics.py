"""Engine metrics: per-step records and totals since start (token hit ratios, transfers, phase times)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

PHASES = ("intake", "schedule", "prepare", "onload", "strip", "forward", "score", "commit")
"""Where time goes: ``intake`` (validating and hashing a request when it is added, per request), then the
seven phases of every step (DESIGN.md section 3)."""

HOST_PHASES = ("schedule", "prepare", "onload", "strip", "commit")
"""The step phases that are pure host work (the benchmark's overhead): forward and score also wait for the device,
and intake comes before the step."""


@dataclass
class StepMetrics:
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
    """

    num_requests: int
    num_tokens: int
    history_tokens: int
    gpu_hit_tokens: int
    host_hit_tokens: int
    onloaded_bytes: int
    offloaded_bytes: int
    phases: dict[str, float]

    @property
    def gpu_hit_ratio(self) -> float:
        """Fraction of this step's history tokens served from GPU pages."""
        return self.gpu_hit_tokens / self.history_tokens if self.history_tokens else 0.0

    @property
    def total_hit_ratio(self) -> float:
        """Fraction of this step's history tokens not recomputed (GPU or host hits)."""
        return (self.gpu_hit_tokens + self.host_hit_tokens) / self.history_tokens if self.history_tokens else 0.0


@dataclass
class EngineStats:
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

    @property
    def gpu_hit_ratio(self) -> float:
        """Fraction of history tokens served from GPU pages."""
        return self.gpu_hit_tokens / self.history_tokens if self.history_tokens else 0.0

    @property
    def total_hit_ratio(self) -> float:
        """Fraction of history tokens not recomputed (GPU or host hits)."""
        hits = self.gpu_hit_tokens + self.host_hit_tokens
        return hits / self.history_tokens if self.history_tokens else 0.0
