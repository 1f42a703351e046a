"""A KuaiRand-1K-like request trace (docs/design.md section 8, "Trace"): each user's first visit (the warm-up), then
sessions of requests 60 seconds apart with Pareto gaps between sessions (the steady state)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..request import RankRequest


@dataclass
class UserEvents:
    """One user's whole event stream, oldest first: int64 ``[L]`` arrays."""

    item_ids: np.ndarray
    action_ids: np.ndarray
    timestamps: np.ndarray


@dataclass(frozen=True)
class TraceRequest:
    """A request of the trace: ``user``'s first ``history_len`` events, at ``time`` seconds."""

    time: float
    user: int
    history_len: int
    warmup: bool


@dataclass(frozen=True)
class TraceConfig:
    """Parameters of :func:`generate_trace` (the defaults are the calibrated benchmark trace)."""

    num_users: int = 1000
    mean_log_len: float = 8.5  # final history lengths: log-normal (mean_log_len, sigma_log_len), clipped to
    sigma_log_len: float = 0.85  # [1, max_history_len]
    max_history_len: int = 20_000
    new_fraction: tuple[float, float] = (0.02, 0.08)  # range of the fraction of a user's events after the first visit
    events_per_request: float = 4.0  # mean events per 60-second request (at least one)
    requests_per_session: float = 4.0  # mean requests per session (geometric)
    gap_alpha: float = 1.2  # Pareto shape of the gaps between a user's sessions (smaller: heavier tail)
    horizon_s: float = 39_000.0  # seconds over which every user's sessions are spread
    num_candidates: int = 100  # per request
    num_items: int = 1_000_000
    num_actions: int = 256
    seed: int = 0


@dataclass
class Trace:
    """Users' event streams plus the time-ordered requests over them."""

    config: TraceConfig
    users: list[UserEvents]
    requests: list[TraceRequest]

    @property
    def warmup(self) -> list[int]:
        """Indices of the first-visit requests."""
        return [i for i, r in enumerate(self.requests) if r.warmup]

    @property
    def steady(self) -> list[int]:
        """Indices of the steady-state requests."""
        return [i for i, r in enumerate(self.requests) if not r.warmup]

    def rank_request(self, index: int) -> RankRequest:
        """Request ``index`` as a :class:`RankRequest` (history fields are zero-copy numpy views)."""
        r = self.requests[index]
        events = self.users[r.user]
        rng = np.random.default_rng((self.config.seed, index))
        return RankRequest(request_id=f"t{index}", user_id=r.user, item_ids=events.item_ids[: r.history_len],
                           action_ids=events.action_ids[: r.history_len], timestamps=events.timestamps[: r.history_len],
                           candidate_item_ids=rng.integers(0, self.config.num_items, self.config.num_candidates))

    def summary(self) -> dict[str, float]:
        """The trace's headline statistics (users, requests, history lengths), as ``bench.json`` records them."""
        lengths = np.array([len(u.item_ids) for u in self.users])
        steady = [self.requests[i] for i in self.steady]
        return {"users": len(self.users), "requests": len(self.requests), "steady_requests": len(steady),
                "mean_final_history": float(lengths.mean()), "max_final_history": int(lengths.max()),
                "min_final_history": int(lengths.min()), "total_events": int(lengths.sum()),
                "mean_steady_history": float(np.mean([r.history_len for r in steady])) if steady else 0.0}


def generate_trace(config: TraceConfig = TraceConfig()) -> Trace:
    """Build the trace of the module docstring, calibrated as docs/design.md section 8 says; deterministic."""
    rng = np.random.default_rng(config.seed)
    lengths = np.clip(np.round(rng.lognormal(config.mean_log_len, config.sigma_log_len, config.num_users)),
                      1, config.max_history_len).astype(np.int64)
    users, requests = [], []
    for user, length in enumerate(lengths):
        new = min(int(length) - 1, int(length * rng.uniform(*config.new_fraction) + 0.5))
        sizes = _request_sizes(rng, new, config.events_per_request)
        times = _request_times(rng, len(sizes), config)
        first = int(length) - new
        requests.append(TraceRequest(0.0, user, first, True))
        ends = first + np.cumsum(sizes)
        requests += [TraceRequest(float(t), user, int(e), False) for t, e in zip(times, ends)]
        event_times = _event_times(rng, first, times, sizes)
        users.append(UserEvents(rng.integers(0, config.num_items, length),
                                rng.integers(0, config.num_actions, length), event_times))
    warm = [r for r in requests if r.warmup]
    order = rng.permutation(len(warm))
    steady = sorted((r for r in requests if not r.warmup), key=lambda r: r.time)
    return Trace(config, users, [warm[i] for i in order] + steady)


def _request_sizes(rng: np.random.Generator, total: int, mean: float) -> np.ndarray:
    """Split ``total`` new events into requests of at least one event each (about ``mean`` per request)."""
    if total <= 0:
        return np.zeros(0, dtype=np.int64)
    sizes = 1 + rng.poisson(max(mean - 1, 0), size=max(1, int(total / mean) + 1))
    sizes = sizes[np.cumsum(sizes) <= total]
    if sizes.sum() < total:
        sizes = np.append(sizes, total - sizes.sum())
    return sizes.astype(np.int64)


def _request_times(rng: np.random.Generator, count: int, config: TraceConfig) -> np.ndarray:
    """Times of a user's ``count`` requests: sessions of ~``requests_per_session`` requests 60 s apart, separated by
    Pareto gaps, spread over ``horizon_s`` (longer for more than ``horizon_s / 60`` requests)."""
    if count == 0:
        return np.zeros(0)
    session_of = np.cumsum(rng.random(count) < 1.0 / config.requests_per_session)
    session_of[0] = 0
    sessions = int(session_of[-1]) + 1
    gaps = rng.pareto(config.gap_alpha, sessions) + 1e-3
    starts = np.cumsum(gaps) - gaps[0]
    span = starts[-1] if sessions > 1 else 1.0
    starts = starts / span * (config.horizon_s - 60.0 * count / sessions) + rng.uniform(0, 60)
    within = np.arange(count) - np.searchsorted(session_of, session_of, side="left")
    # In order, at least 60 s apart (else compressed gaps stack sessions): t[i] = max(wanted[i], t[i - 1] + 60).
    step = 60.0 * np.arange(count)
    return step + np.maximum.accumulate(starts[session_of] + 60.0 * within - step)


def _event_times(rng: np.random.Generator, first: int, times: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Non-decreasing event timestamps (seconds): history before the trace, then each request's in its 60 s."""
    before = np.sort(rng.uniform(-30 * 86_400, -60, first))
    during = [t - 60 + np.sort(rng.uniform(0, 60, s)) for t, s in zip(times, sizes)]
    stamps = np.concatenate([before, *during]) if during else before
    return np.maximum.accumulate(np.floor(stamps)).astype(np.int64) + 1_700_000_000


def fixed_length_trace(config: TraceConfig, length: int, users: int, new_events: int) -> Trace:
    """``users`` users with ``length``-event histories (their first visits), each then visiting 6 times with
    ``new_events`` more events; other fields as in ``config``."""
    config = replace(config, num_users=users, max_history_len=length + 8 * new_events)
    base = generate_trace(replace(config, mean_log_len=20.0, sigma_log_len=0.01, new_fraction=(0.0, 0.0)))
    requests = [replace(r, history_len=length, warmup=True) for r in base.requests[:users]]
    for visit in range(1, 7):
        requests += [replace(r, history_len=length + visit * new_events, warmup=False, time=float(visit))
                     for r in base.requests[:users]]
    return Trace(config, base.users, requests)
