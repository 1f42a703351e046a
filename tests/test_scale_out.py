"""benchmarks/scale_out.py at a tiny size (CPU, seconds), and the simulator's per-request record it relies on."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

from gr_engine.bench.runner import BenchSettings, cache_config
from gr_engine.bench.simulate import simulate_policy
from gr_engine.bench.trace import TraceConfig, generate_trace

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scale_out.py"


def load_script():
    spec = importlib.util.spec_from_file_location("scale_out", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_per_request_record_sums_to_the_policy_result():
    trace = generate_trace(TraceConfig(num_users=4, seed=3))
    settings = BenchSettings(device="cpu")
    cache = cache_config(settings, "hierarchical", num_gpu_pages=1000, host_budget_bytes=2**28)
    rows = np.zeros((len(trace.requests), 3), dtype=np.int64)
    result = simulate_policy(trace, cache, rows)
    steady = rows[trace.steady]
    assert (rows[:, 0] == [r.history_len for r in trace.requests]).all()
    assert np.isclose(steady[:, 1:].sum() / steady[:, 0].sum(), result.total_hit_ratio)
    assert np.isclose(steady[:, 1].sum() / steady[:, 0].sum(), result.gpu_hit_ratio)


def test_merged_trace_has_disjoint_users_and_time_ordered_steady_requests():
    module = load_script()
    traces = [generate_trace(TraceConfig(num_users=3, seed=s)) for s in range(2)]
    merged = module.merged_trace(traces, 3)
    assert len(merged.users) == 6 and len(merged.requests) == sum(len(t.requests) for t in traces)
    steady = [r for r in merged.requests if not r.warmup]
    assert merged.requests[:6] == [r for r in merged.requests if r.warmup]
    assert [r.time for r in steady] == sorted(r.time for r in steady)
    assert merged.users[3] is traces[1].users[0]
    part = module.sub_trace(merged, np.array([0, 4, 7]))
    assert [part.users[r.user] for r in part.requests] == [merged.users[merged.requests[i].user] for i in (0, 4, 7)]


def test_tiny_run_writes_the_report(tmp_path):
    out = tmp_path / "scale_out.json"
    load_script().main(["--out", str(out), "--replicas", "1", "2", "4", "--users-per-replica", "4",
                        "--imbalance-users", "30", "--sweep", "10", "40", "--virtual-nodes", "40",
                        "--change-replicas", "2", "--workers", "0"])
    report = json.loads(out.read_text())
    assert set(report["imbalance"]) == set(report["hit_ratio"]) == {"1", "2", "4"}
    assert report["imbalance"]["1"] == 1.0 and all(v >= 1.0 for v in report["imbalance"].values())
    assert all(0.0 <= v <= 1.0 for v in report["hit_ratio"].values())
    removal, add = report["removal"], report["add"]
    assert report["hit_ratio_after_removal"] == removal["hit_ratio"]
    assert report["hit_ratio_after_add"] == add["hit_ratio"]
    for change in (removal, add):
        # Only moved users miss more: the others' misses are those of the run without the change.
        slack = 0.01 * change["window_tokens"]
        assert change["others_missed_tokens"] <= change["others_missed_tokens_no_change"] + slack
        assert change["moved_missed_tokens"] >= change["moved_cold_tokens"] * 0.99
    assert "scale_out.py" in report["command"] and report["settings"]["users_per_replica"] == 4
