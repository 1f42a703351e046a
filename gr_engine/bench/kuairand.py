"""A trace from the real KuaiRand-1K log files, for users who have them (nothing is downloaded). As in NVIDIA's
preprocessing, the eight binary signals become an action bitmask (:data:`SIGNALS`) and each user's time-sorted events
are cut into requests at 60-second intervals, each request's history being everything up to its interval's end.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from .trace import Trace, TraceConfig, TraceRequest, UserEvents

#: Action bits, lowest first (``is_click`` = 1 ... ``is_profile_enter`` = 128): KuaiRand's binary feedback columns.
SIGNALS = ("is_click", "is_like", "is_follow", "is_comment", "is_forward", "is_hate", "long_view",
           "is_profile_enter")


def _read_columns(path: Path, columns: list[str]) -> dict[str, np.ndarray]:
    """The named integer columns of one CSV file (pyarrow when installed, else the csv module)."""
    try:
        import pyarrow.csv as pacsv
    except ImportError:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        return {c: np.array([int(float(r[c] or 0)) for r in rows], dtype=np.int64) for c in columns}
    table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(include_columns=columns))
    return {c: table[c].to_numpy(zero_copy_only=False).astype(np.int64) for c in columns}


def load_kuairand(paths: list[str | Path], *, window_start_ms: int | None = None, num_items: int = 1_000_000,
                  num_candidates: int = 100, interval_s: int = 60, max_history_len: int = 20_000,
                  seed: int = 0) -> Trace:
    """Build a :class:`~.trace.Trace` from KuaiRand-1K log CSVs (``log_standard_4_08_to_4_21_1k.csv``,
    ``log_standard_4_22_to_5_08_1k.csv``: one interaction per row, with ``user_id``, ``video_id``, ``time_ms`` and
    the :data:`SIGNALS`).

    Args:
        paths: the log files (any subset; their rows are merged).
        window_start_ms: events before it are each user's first visit (the warm-up), later intervals the steady
            state; default: the time that leaves the last 20% of all events to the steady state.
        num_items: video ids are folded into ``[0, num_items)`` (``video_id % num_items``).
        num_candidates: random candidates per request.
        interval_s: request interval length.
        max_history_len: each history keeps its most recent this many events.
        seed: candidate sampling seed.
    """
    data: dict[str, list[np.ndarray]] = {}
    for path in paths:
        for name, column in _read_columns(Path(path), ["user_id", "video_id", "time_ms", *SIGNALS]).items():
            data.setdefault(name, []).append(column)
    cols = {name: np.concatenate(parts) for name, parts in data.items()}
    if not len(cols["user_id"]):
        raise ValueError("the KuaiRand files hold no interactions")
    actions = sum((cols[s] != 0).astype(np.int64) << bit for bit, s in enumerate(SIGNALS))
    if window_start_ms is None:
        window_start_ms = int(np.quantile(cols["time_ms"], 0.8))
    order = np.lexsort((cols["time_ms"], cols["user_id"]))
    users_sorted = cols["user_id"][order]
    bounds = np.flatnonzero(np.diff(users_sorted)) + 1
    users, requests = [], []
    for index, rows in enumerate(np.split(order, bounds)):
        rows = rows[-max_history_len:]
        seconds = cols["time_ms"][rows] // 1000
        users.append(UserEvents(cols["video_id"][rows] % num_items, actions[rows], seconds))
        first = int(np.searchsorted(cols["time_ms"][rows], window_start_ms))
        requests.append(TraceRequest(float(seconds[first - 1]) if first else 0.0, index, first, True))
        requests += [TraceRequest(float(seconds[end - 1]), index, int(end), False)
                     for end in _interval_ends(seconds[first:], interval_s) + first]
    warm = [r for r in requests if r.warmup]
    steady = sorted((r for r in requests if not r.warmup), key=lambda r: r.time)
    config = TraceConfig(num_users=len(users), max_history_len=max_history_len, num_candidates=num_candidates,
                         num_items=num_items, num_actions=256, seed=seed)
    return Trace(config, users, warm + steady)


def _interval_ends(seconds: np.ndarray, interval_s: int) -> np.ndarray:
    """Ends (exclusive indices) of the requests that cut ``seconds`` (sorted event times) into intervals:
    an interval starts at an event and takes every event less than ``interval_s`` after it."""
    ends, start = [], 0
    while start < len(seconds):
        end = int(np.searchsorted(seconds, seconds[start] + interval_s, side="left"))
        ends.append(end)
        start = end
    return np.asarray(ends, dtype=np.int64)
