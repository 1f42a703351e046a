"""`gr-engine bench --quick`: every experiment runs end to end on CPU and writes its reports."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest

from gr_engine.cli import main


def test_quick_bench_writes_reports(tmp_path, capsys):
    assert main(["bench", "--quick", "--out", str(tmp_path), "--commit", "test"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("gpu", "commit", "command", "speedup_bs8", "speedup_bs8_mean", "total_hit_ratio_bs8",
                "gpu_only_hit_ratio_bs8", "unlimited_speedup_bs8", "unlimited_speedup_bs8_mean", "hier_p99_ms_bs8",
                "overhead_ms_bs8", "latency_ms", "latency_mean_ms", "latency_p99_ms"):
        assert key in summary, key
    for key in ("latency_ms", "latency_mean_ms", "latency_p99_ms"):
        assert set(summary[key]) == {"recompute", "gpu_only", "hierarchical", "unlimited"}
    assert summary["commit"] == "test" and summary["total_hit_ratio_bs8"] > 0.5
    # Steps 1-7's CPU time leaves out intake (before step 1) and the phases that wait for the device.
    bs = max(int(b) for b in summary["latency_ms"]["hierarchical"])
    phases = json.loads((tmp_path / "bench.json").read_text())["modes"]["hierarchical"]["batch_sizes"][str(bs)]
    host, phases = phases["host_ms_per_batch"], phases["phase_ms_per_batch"]
    steps = ("schedule", "prepare", "onload", "strip", "commit")
    assert summary["overhead_mean_ms_bs8"] == pytest.approx(sum(phases[k] for k in steps))
    assert host["mean"] == pytest.approx(summary["overhead_mean_ms_bs8"])  # the per-batch sums add up to the same
    assert summary["overhead_ms_bs8"] == host["median"] and 0 < host["median"] <= host["p90"]
    assert summary["intake_ms_bs8"] == pytest.approx(phases["intake"])
    assert 0 < summary["host_python_loop_us"] < 1e4  # the host's speed, to compare instances
    result = json.loads((tmp_path / "bench.json").read_text())
    for mode in result["modes"].values():  # each batch's latency and onloaded bytes, in the order served
        for e in mode["batch_sizes"].values():
            assert len(e["batch_latency_ms"]) == len(e["batch_onloaded_bytes"]) == e["batches"]
            assert np.median(e["batch_latency_ms"]) == pytest.approx(e["median_ms"], abs=1e-3)
            assert np.mean(e["batch_latency_ms"]) == pytest.approx(e["mean_ms"], abs=1e-3)
            assert np.percentile(e["batch_latency_ms"], 99) == pytest.approx(e["p99_ms"], abs=1e-3)
            assert sum(e["batch_onloaded_bytes"]) / e["batches"] == pytest.approx(e["onloaded_bytes_per_batch"])
    assert sum(result["modes"]["hierarchical"]["batch_sizes"][str(bs)]["batch_onloaded_bytes"]) > 0
    # The headline by mean batch latency (what throughput sees), the median-based one beside it, and the p99.
    stats = {m: result["modes"][m]["batch_sizes"][str(bs)] for m in ("recompute", "hierarchical", "unlimited")}
    rec = stats["recompute"]
    assert summary["speedup_bs8_mean"] == pytest.approx(rec["mean_ms"] / stats["hierarchical"]["mean_ms"])
    assert summary["speedup_bs8"] == pytest.approx(rec["median_ms"] / stats["hierarchical"]["median_ms"])
    assert summary["unlimited_speedup_bs8_mean"] == pytest.approx(rec["mean_ms"] / stats["unlimited"]["mean_ms"])
    assert summary["hier_p99_ms_bs8"] == stats["hierarchical"]["p99_ms"] == summary["latency_p99_ms"]["hierarchical"][
        str(bs)]
    assert summary["latency_mean_ms"]["recompute"][str(bs)] == stats["recompute"]["mean_ms"]
    keys = list(summary)
    assert keys.index("speedup_bs8_mean") < keys.index("speedup_bs8")  # the mean-based speedup first
    breakdown = result["modes"]["hierarchical"]["breakdown_bs8"]
    assert breakdown["batches"] > 0 and breakdown["phase_ms_per_step"]["forward"] > 0
    assert all(e["gc_ms_per_batch"] >= 0 for m in result["modes"].values() for e in m["batch_sizes"].values())
    assert gc.get_freeze_count() == 0  # every run unfroze what its windows froze
    assert result["simulated"]["hierarchical"]["total_hit_ratio"] > result["simulated"]["gpu_only"]["total_hit_ratio"]
    assert set(result["chunk_sweep"]["hierarchical"]) and set(result["budget_sweep"]) == {"gpu_only", "hierarchical"}
    for sweep in ("chunk_sweep", "budget_sweep"):  # simulated after the measurements, each at its own setting
        for values in result[sweep].values():
            assert all(0 < e["simulated"]["total_hit_ratio"] <= 1 for e in values.values())
    budgets = result["budget_sweep"]["gpu_only"]
    smallest, largest = (budgets[f(budgets, key=int)]["simulated"] for f in (min, max))
    assert smallest["gpu_hit_ratio"] < largest["gpu_hit_ratio"]
    assert all(0 < m["host_python_loop_us"] < 1e4 for m in result["modes"].values())  # as each mode's windows start
    assert summary["host_python_loop_us_hierarchical"] == result["modes"]["hierarchical"]["host_python_loop_us"]
    assert all(0 < m["host_torch_op_us"] < 1e4 for m in result["modes"].values())  # the host's torch/CUDA calls
    assert summary["host_torch_op_us_hierarchical"] == result["modes"]["hierarchical"]["host_torch_op_us"]
    assert 0 < summary["host_torch_op_us"] < 1e4
    drift = result["score_drift"]  # float32 on CPU: host chunks in the KV dtype are exact, FP8 ones are not
    assert drift["kv"]["requests_from_host"] > 0 and drift["kv"]["max_abs"] < 1e-5
    assert drift["float8_e4m3fn"]["requests_from_host"] > 0 and drift["float8_e4m3fn"]["max_abs"] > 1e-4
    text = (tmp_path / "bench.md").read_text()
    assert "Score drift" in text and "Host time per batch" in text and "a small torch operation" in text
    assert "Table 1" in text and "Table 2" in text and "Table 3" in text and "Table 6" in text
    assert "x recompute by mean batch latency" in text and "| median ms | mean ms | p99 ms |" in text
    assert "Batch latency in ms: median / mean / p99 / max." in text  # the history length table
    assert "speedup_bs8" in capsys.readouterr().out
    # Model FLOPs count only computed tokens: the cached modes compute far less than recompute, every batch size.
    for b, e in result["modes"]["recompute"]["batch_sizes"].items():
        cached = result["modes"]["unlimited"]["batch_sizes"][b]["model_tflop_per_batch"]
        assert 0 < 2 * cached < e["model_tflop_per_batch"]
    assert "recompute_mfu_bs8" not in summary  # no GEMM peak on CPU


def test_bench_sets_cache_fields_for_every_engine(tmp_path, capsys, monkeypatch):
    """``--cache KEY=VALUE``: every engine of the run gets the field (the command records it); an unknown field
    or a bad value is refused before anything runs."""
    from gr_engine.bench import runner
    from gr_engine.cli import main

    seen = []
    build = runner.cache_config

    def recording(settings, mode, **changes):
        config = build(settings, mode, **changes)
        seen.append(config)
        return config

    monkeypatch.setattr(runner, "cache_config", recording)
    monkeypatch.setattr("gr_engine.bench.experiments.cache_config", recording)
    assert main(["bench", "--quick", "--out", str(tmp_path), "--cache", "prefetch=false",
                 "--cache", "max_pending_offloads=20"]) == 0
    assert seen and all(not c.prefetch and c.max_pending_offloads == 20 for c in seen)
    assert "--cache prefetch=false" in json.loads((tmp_path / "summary.json").read_text())["command"]
    capsys.readouterr()
    for bad in ("bogus=1", "prefetch=maybe", "max_pending_offloads=-3"):
        assert main(["bench", "--quick", "--out", str(tmp_path / "x"), "--cache", bad]) == 2
        assert "invalid --cache" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_simulations_in_worker_processes_equal_inline():
    from gr_engine.bench.runner import cache_config, quick_settings
    from gr_engine.bench.simulate import Simulations
    from gr_engine.bench.trace import generate_trace

    settings = quick_settings()
    trace = generate_trace(settings.trace)
    caches = [cache_config(settings, "gpu_only"), cache_config(settings, "hierarchical")]
    workers = Simulations(trace, caches, workers=1)
    inline = Simulations(trace, caches, workers=0)
    assert [workers.get(c) for c in caches] == [inline.get(c) for c in caches]
    workers.close()


def test_closed_run_frees_its_kv_pool():
    """Each benchmark engine's pool must be gone before the next one allocates (unlimited mode's is ~100 GB)."""
    import weakref

    from gr_engine.bench.runner import BenchRun, cache_config, quick_settings
    from gr_engine.bench.trace import generate_trace

    settings = quick_settings()
    run = BenchRun(settings, generate_trace(settings.trace), cache_config(settings, "hierarchical"), 8)
    run.warmup()
    pool = weakref.ref(run.engine.kv.pool.kv)
    run.close()
    assert pool() is None


def test_fast_forward_leaves_intake_knowing_each_users_history():
    """After the bookkeeping-only fast-forward, a user's next request reuses its hashes, as after serving."""
    from cache_engine import page_prefix_hashes
    from gr_engine.bench.runner import BenchRun, cache_config, quick_settings
    from gr_engine.bench.trace import generate_trace

    settings = quick_settings()
    trace = generate_trace(settings.trace)
    run = BenchRun(settings, trace, cache_config(settings, "hierarchical"), 8)
    run.warmup()
    users = {trace.requests[i].user for i in run.steady[:40]}
    run.engine.intake.hasher = type(run.engine.intake.hasher)(settings.page_size)  # forget what the warm-up served
    run.fast_forward(40)
    assert all(user in run.engine.intake.hasher for user in users)
    nxt = trace.requests[run.steady[40]]
    e = trace.users[nxt.user]
    got = run.engine.intake.hasher(nxt.user, *(a[: nxt.history_len] for a in (e.item_ids, e.action_ids, e.timestamps)))
    assert (got == page_prefix_hashes(e.item_ids[: nxt.history_len], e.action_ids[: nxt.history_len],
                                      e.timestamps[: nxt.history_len], settings.page_size)).all()
    run.close()


def test_windows_measure_every_stretch_of_the_trace(monkeypatch):
    """The trace's load is not stationary: the measured requests must come from each of the strata, not one place."""
    from gr_engine.bench.runner import BenchRun, cache_config, quick_settings
    from gr_engine.bench.trace import generate_trace

    settings = quick_settings()
    trace = generate_trace(settings.trace)
    run = BenchRun(settings, trace, cache_config(settings, "gpu_only"), 8)
    run.warmup()
    served: list[int] = []
    rank_request = trace.rank_request
    monkeypatch.setattr(trace, "rank_request", lambda i: served.append(i) or rank_request(i))
    report, = run.windows([(8, False)])
    run.close()
    assert report["batches"] == settings.window_requests // 8
    position = {index: p for p, index in enumerate(run.steady)}
    strata = settings.window_strata
    per = settings.window_requests // strata
    measured = [position[i] for i in served[settings.prime_batches * 8:]]  # the priming batches come first
    starts = [k * len(run.steady) // strata for k in range(strata)]
    counts = np.bincount(np.searchsorted(starts, measured, side="right") - 1, minlength=strata)
    assert counts.tolist() == [per] * strata


def test_batch_bound_ratios_take_each_batchs_own_bound():
    """Batch i's latency over max(unlimited's batch i, its onloaded bytes at the peak): 10 GB/s is 1 ms per 10 MB."""
    from gr_engine.bench.report import batch_bound_ratios

    hier = {"batch_latency_ms": [3.0, 2.4, 5.0], "batch_onloaded_bytes": [20_000_000, 0, 40_000_000]}
    unlimited = {"batch_latency_ms": [1.0, 2.0, 5.0]}
    assert batch_bound_ratios(hier, unlimited, 10.0) == pytest.approx([1.5, 1.2, 1.0])
    assert batch_bound_ratios(hier, {"batch_latency_ms": [1.0]}, 10.0) == []  # not the same batches
    assert batch_bound_ratios({"median_ms": 3.0}, unlimited, 10.0) == []  # results from before per-batch data


def test_latency_fit_recovers_intercept_and_rate():
    """Batches on ``2 ms + bytes / 40 GB/s`` (40 MB: 1 ms) give back 2 ms and 40 GB/s; batches below 20 MB and
    windows without enough onloading batches are left out."""
    from gr_engine.bench.report import latency_fit

    onloaded = [0, 10_000_000, 40_000_000, 80_000_000, 200_000_000]
    hier = {"batch_latency_ms": [9.0, 9.0, 3.0, 4.0, 7.0], "batch_onloaded_bytes": onloaded}
    intercept, rate = latency_fit(hier)
    assert intercept == pytest.approx(2.0) and rate == pytest.approx(40.0)
    assert latency_fit({"batch_latency_ms": [3.0, 4.0], "batch_onloaded_bytes": [40_000_000, 80_000_000]}) is None
    assert latency_fit({"median_ms": 3.0}) is None


def test_pooled_windows_take_every_window_at_the_default_configuration():
    """Table 1's hierarchical window and the sweeps' windows at the settings' chunk size and GPU pages (and no other
    sweep value) are pooled batch by batch; the bound uses the pooled mean bytes (10 GB/s: 1 ms per 10 MB)."""
    from gr_engine.bench.report import default_config_windows, pooled_windows

    def window(latency, onloaded):
        return {"batch_latency_ms": latency, "batch_onloaded_bytes": onloaded}

    table1, chunk, budget = window([4.0, 6.0], [40_000_000, 60_000_000]), window([8.0], [90_000_000]), window(
        [2.0, 3.0], [0, 10_000_000])
    result = {"settings": {"chunk_tokens": 1024, "gpu_pages": 4096},
              "modes": {"hierarchical": {"batch_sizes": {8: table1}}},
              "chunk_sweep": {"hierarchical": {512: window([99.0], [1]), 1024: chunk}},
              "budget_sweep": {"gpu_only": {4096: window([77.0], [1])}, "hierarchical": {"4096": budget}}}
    windows = default_config_windows(result, 8)
    assert windows == [table1, chunk, budget]
    pooled = pooled_windows(windows, unlimited_ms=2.5, peak_GBps=10.0)
    # latencies 2, 3, 4, 6, 8: median 4; mean bytes 40 MB: a 4 ms bound (above unlimited's 2.5)
    assert pooled == {"windows": 3, "batches": 5, "median_ms": 4.0, "over_bound": pytest.approx(1.0)}
    assert pooled_windows(windows, unlimited_ms=8.0, peak_GBps=10.0)["over_bound"] == pytest.approx(0.5)
    assert pooled_windows([{"median_ms": 3.0}], 1.0, 10.0) is None  # results from before per-batch data


def test_batches_grouped_by_onloaded_bytes():
    """Batches fall in their byte group (MB, lower bound included); each group's means and the latency's excess over
    the bytes' time at the peak (10 GB/s: 1 ms per 10 MB)."""
    from gr_engine.bench.report import by_onloaded_bytes

    windows = [{"batch_latency_ms": [3.0, 5.0], "batch_onloaded_bytes": [0, 100_000_000]},
               {"batch_latency_ms": [9.0, 4.0], "batch_onloaded_bytes": [60_000_000, 50_000_000]}]
    rows = by_onloaded_bytes(windows, peak_GBps=10.0)
    assert [(r["mb"], r["batches"]) for r in rows] == [((0, 1), 1), ((50, 150), 3)]
    assert rows[0]["excess_ms"] == pytest.approx(3.0)
    assert rows[1]["latency_ms"] == pytest.approx(6.0) and rows[1]["bytes_at_peak_ms"] == pytest.approx(7.0)
    assert rows[1]["excess_ms"] == pytest.approx(-1.0)


def test_bound_sections_with_a_copy_peak(tmp_path, capsys, monkeypatch):
    """With a pinned copy peak (a stand-in on CPU), the summary has the bound ratios, the pooled default-configuration
    windows (Table 1's and the two sweeps': three windows) and bench.md their lines and the table by onloaded bytes."""
    monkeypatch.setattr("gr_engine.bench.experiments.peak_h2d_GBps", lambda device: 0.5)
    monkeypatch.setattr("gr_engine.bench.experiments.gemm_peak_tflops", lambda device: 0.01)
    assert main(["bench", "--quick", "--out", str(tmp_path), "--commit", "test"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["recompute_mfu_bs8"] > 0 and set(summary["recompute_mfu_batch"]) == set(summary["latency_ms"][
        "recompute"])
    assert "Recompute's model FLOP utilisation" in (tmp_path / "bench.md").read_text()
    pooled = summary["hier_all_windows_bs8"]
    assert summary["hier_over_bound_bs8"] > 0 and pooled["windows"] == 3 and pooled["over_bound"] > 0
    result = json.loads((tmp_path / "bench.json").read_text())
    bs = str(max(int(b) for b in result["modes"]["hierarchical"]["batch_sizes"]))
    assert pooled["batches"] == 3 * result["modes"]["hierarchical"]["batch_sizes"][bs]["batches"]
    text = (tmp_path / "bench.md").read_text()
    assert "Over every window of hierarchical" in text and "| onloaded MB | batches |" in text
    capsys.readouterr()
