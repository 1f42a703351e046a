"""Engine-wide counters: token hit ratios and time per phase of the step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Totals since the engine started.

    Attributes:
        num_steps: engine steps that ran the model.
        num_requests: requests that finished successfully.
        num_computed_step_tokens: tokens computed (history + candidates) over all steps.
        history_tokens: history tokens of finished requests.
        gpu_hit_tokens: of those, tokens served from GPU pages.
        host_hit_tokens: of those, tokens loaded from host memory.
        phase_seconds: seconds per step phase (schedule, prepare, onload, strip, forward, score, commit).
    """

    num_steps: int = 0
    num_requests: int = 0
    num_computed_step_tokens: int = 0
    history_tokens: int = 0
    gpu_hit_tokens: int = 0
    host_hit_tokens: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)

    def record_step(self, phases: dict[str, float], num_tokens: int) -> None:
        self.num_steps += 1
        self.num_computed_step_tokens += num_tokens
        for name, seconds in phases.items():
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds

    def record_request(self, history_tokens: int, gpu_hits: int, host_hits: int = 0) -> None:
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
