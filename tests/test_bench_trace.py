"""The benchmark's traces: the generated KuaiRand-like trace, the KuaiRand-1K loader, the policy simulator."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from cache_engine import CacheConfig
from gr_engine.bench.kuairand import SIGNALS, load_kuairand
from gr_engine.bench.simulate import simulate_policy
from gr_engine.bench.trace import TraceConfig, generate_trace

HEADER = ["user_id", "video_id", "date", "hourmin", "time_ms", "is_click", "is_like", "is_follow", "is_comment",
          "is_forward", "is_hate", "long_view", "play_time_ms", "duration_ms", "profile_stay_time",
          "comment_stay_time", "is_profile_enter", "is_rand", "tab"]


def test_generated_trace_shape():
    trace = generate_trace(TraceConfig(num_users=60, seed=3))
    summary = trace.summary()
    assert summary["users"] == 60 and 1 <= summary["min_final_history"] <= summary["max_final_history"] <= 20_000
    warm, steady = trace.warmup, trace.steady
    assert len(warm) == 60 and warm == list(range(60))  # first visits come first
    assert sorted(trace.requests[i].user for i in warm) == list(range(60))
    times = [trace.requests[i].time for i in steady]
    assert times == sorted(times)
    last = {trace.requests[i].user: trace.requests[i].history_len for i in warm}
    last_time: dict[int, float] = {}
    for i in steady:  # each user's histories only grow, a few events at a time, at least 60 s apart
        r = trace.requests[i]
        assert r.history_len > last[r.user]
        assert r.time >= last_time.get(r.user, -60.0) + 60.0 - 1e-6
        last[r.user], last_time[r.user] = r.history_len, r.time
    for u, events in enumerate(trace.users):
        assert np.all(np.diff(events.timestamps) >= 0) and last.get(u, len(events.item_ids)) == len(events.item_ids)
    request = trace.rank_request(steady[0])
    assert len(request.candidate_item_ids) == 100 and len(request.item_ids) == trace.requests[steady[0]].history_len
    assert generate_trace(TraceConfig(num_users=60, seed=3)).requests == trace.requests  # deterministic


def test_default_trace_statistics():
    summary = generate_trace(TraceConfig(num_users=400)).summary()
    assert 5_000 < summary["mean_final_history"] < 7_500


def test_policy_simulation_orders_modes():
    trace = generate_trace(TraceConfig(num_users=40, mean_log_len=7.0, horizon_s=2000, seed=1))
    pages = 300  # room for about a fifth of the users
    results = {mode: simulate_policy(trace, CacheConfig(mode=mode, num_gpu_pages=pages, host_budget_bytes=2**40))
               for mode in ("recompute", "gpu_only", "hierarchical")}
    assert results["recompute"].total_hit_ratio == 0
    assert 0 < results["gpu_only"].gpu_hit_ratio < results["hierarchical"].total_hit_ratio
    assert results["hierarchical"].total_hit_ratio > 0.99
    no_tails = simulate_policy(trace, CacheConfig(mode="hierarchical", num_gpu_pages=pages, host_budget_bytes=2**40,
                                                  persist_tails=False))
    assert no_tails.total_hit_ratio < results["hierarchical"].total_hit_ratio and no_tails.lost_tokens > 0


def write_kuairand(path, rows):
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HEADER)
        for user, video, time_ms, signals in rows:
            flags = dict.fromkeys(SIGNALS, 0) | signals
            writer.writerow([user, video, 20220408, 1200, time_ms, flags["is_click"], flags["is_like"],
                             flags["is_follow"], flags["is_comment"], flags["is_forward"], flags["is_hate"],
                             flags["long_view"], 1000, 5000, 0, 0, flags["is_profile_enter"], 0, 1])


def test_kuairand_loader_on_a_fixture(tmp_path):
    t0 = 1_649_376_000_000
    write_kuairand(tmp_path / "log_standard_4_08_to_4_21_1k.csv", [
        (7, 11, t0, {"is_click": 1}),
        (7, 12, t0 + 20_000, {"is_like": 1, "long_view": 1}),
        (3, 99, t0 + 5_000, {}),
    ])
    write_kuairand(tmp_path / "log_standard_4_22_to_5_08_1k.csv", [
        (7, 13, t0 + 100_000, {"is_profile_enter": 1}),
        (7, 14, t0 + 130_000, {}),  # same 60 s interval as the previous event
        (7, 15, t0 + 200_000, {"is_hate": 1}),
        (3, 98, t0 + 150_000, {"is_click": 1, "is_follow": 1}),
    ])
    trace = load_kuairand(sorted(tmp_path.glob("*.csv")), window_start_ms=t0 + 60_000, num_items=50)
    assert len(trace.users) == 2
    user3, user7 = trace.users  # users sorted by id
    assert user7.item_ids.tolist() == [11, 12, 13, 14, 15] and user3.item_ids.tolist() == [99 % 50, 98 % 50]
    assert user7.action_ids.tolist() == [1, 2 | 64, 128, 0, 32] and user3.action_ids.tolist() == [0, 1 | 4]
    assert user7.timestamps.tolist() == [(t0 + d) // 1000 for d in (0, 20_000, 100_000, 130_000, 200_000)]
    warm = [trace.requests[i] for i in trace.warmup]
    steady = [(r.user, r.history_len) for r in (trace.requests[i] for i in trace.steady)]
    assert sorted((r.user, r.history_len) for r in warm) == [(0, 1), (1, 2)]
    assert steady == [(1, 4), (0, 2), (1, 5)]  # user 7 (index 1): intervals [13, 14] and [15]
    assert trace.rank_request(trace.steady[0]).item_ids.tolist() == [11, 12, 13, 14]


def test_kuairand_loader_rejects_empty(tmp_path):
    write_kuairand(tmp_path / "empty.csv", [])
    with pytest.raises(ValueError, match="no interactions"):
        load_kuairand([tmp_path / "empty.csv"])
