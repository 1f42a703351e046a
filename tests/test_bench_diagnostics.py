"""The benchmark's diagnostics: per-batch device timelines (:mod:`gr_engine.bench.timeline`) from a hand-made
Chrome trace and from a real ``torch.profiler`` trace of CPU work (the annotation and event format the GPU runs
produce), and the scripts ``benchmarks/batch_timeline.py``, ``bound_probe.py``, ``host_breakdown.py`` and
``host_api_costs.py --host-only`` run on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gr_engine.bench.timeline import batch_timelines, intersection, union


def x(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_union_and_intersection():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]
    assert intersection([(0, 4), (5, 7)], [(3, 6), (6.5, 10)]) == pytest.approx(1 + 1 + 0.5)
    assert intersection([], [(0, 1)]) == 0


def test_events_go_to_the_batch_they_start_in():
    """Two batches (us): the first offloads, then onloads two layers while the forward runs partly alongside; the
    second only computes. A host event (cuda_runtime) is ignored."""
    trace = {"traceEvents": [
        x("batch", "user_annotation", 1000, 5000),
        x("triton_pack_chunks_kernel", "kernel", 1500, 400),  # the offload: 1500-1900
        x("_onload_pages_kernel", "kernel", 1800, 1000),  # 1800-2800 (after 100 us of the offload)
        x("_onload_pages_kernel", "kernel", 2800, 1000),  # 2800-3800
        x("hstu_attention", "kernel", 2900, 300),  # forward 2900-3200, inside the second onload
        x("gemm", "kernel", 3700, 500),  # 3700-4200: 100 us with the onload
        x("Memcpy DtoH", "gpu_memcpy", 4300, 100),
        x("cudaLaunchKernel", "cuda_runtime", 2000, 5),
        x("batch", "user_annotation", 7000, 1000),
        x("gemm", "kernel", 7100, 200),
    ]}
    first, second = batch_timelines(trace, onloaded_bytes=[2_000_000_000, 0])
    assert first["host_ms"] == pytest.approx(5.0)
    assert first["first_onload_ms"] == pytest.approx(0.8) and first["onload_end_ms"] == pytest.approx(2.8)
    assert first["offload_before_onload_ms"] == pytest.approx(0.3)  # 1500-1800
    assert first["onload_busy_ms"] == pytest.approx(2.0)
    assert first["forward_busy_ms"] == pytest.approx(0.8)
    assert first["forward_start_ms"] == pytest.approx(1.9) and first["forward_end_ms"] == pytest.approx(3.2)
    assert first["overlap_ms"] == pytest.approx(0.4)
    assert first["copy_busy_ms"] == pytest.approx(0.1)
    assert first["onload_GBps"] == pytest.approx(1000.0)  # 2 GB over 2 ms
    assert second["first_onload_ms"] is None and second["onload_GBps"] is None
    assert second["forward_busy_ms"] == pytest.approx(0.2) and second["overlap_ms"] == 0


def test_a_profiler_trace_of_annotated_batches(tmp_path):
    """``torch.profiler``'s own export: the batches' annotations are found (CPU only: no device events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(3):
            with torch.profiler.record_function("batch"):
                torch.ones(64).sum()
    path = tmp_path / "trace.json"
    profiler.export_chrome_trace(str(path))
    rows = batch_timelines(json.loads(path.read_text()))
    assert len(rows) == 3 and all(r["host_ms"] > 0 and r["first_onload_ms"] is None for r in rows)


def test_the_timeline_script_runs_the_benchmarks_engine_quickly(tmp_path):
    """``benchmarks/batch_timeline.py --quick``: the CPU-sized benchmark engine's batches under the profiler, one
    timeline row per batch with its onloaded bytes."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "batch_timeline.py"
    run = subprocess.run([sys.executable, str(script), "--quick", "--modes", "hierarchical", "--batches", "2",
                          "--prime", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "timeline_hierarchical.json").read_text())
    assert result["batches"] == 2 and len(result["rows"]) == 2
    assert all(row["host_ms"] > 0 and row["onloaded_bytes"] >= 0 for row in result["rows"])
    assert (tmp_path / "trace_hierarchical.json.gz").exists()


def test_the_bound_probe_runs_its_variants_quickly(tmp_path):
    """``benchmarks/bound_probe.py --quick --repeats 2``: the hierarchical engine and a variant with cache fields
    changed, twice each, and the unlimited engine over the same batches, on CPU (the GPU sessions' A/B command must
    not fail on a typo); each arm's runs are kept, and its combined latencies are the per-batch medians."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bound_probe.py"
    out = tmp_path / "probe.json"
    run = subprocess.run([sys.executable, str(script), "--quick", "--variant", "prefetch=false,max_pending_offloads=20",
                          "--repeats", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "prefetch=false,max_pending_offloads=20 against hierarchical" in run.stdout
    reports = json.loads(out.read_text())
    assert {"hierarchical", "prefetch=false,max_pending_offloads=20", "unlimited"} <= set(reports)
    assert len(reports["hierarchical"]["batch_latency_ms"]) == len(reports["unlimited"]["batch_latency_ms"]) > 0
    assert "over 2 run(s) each" in run.stdout and "hierarchical against itself (A/A" in run.stdout
    runs = reports["runs"]["hierarchical"]
    assert len(runs) == 2 and len(reports["runs"]["unlimited"]) == 1
    assert np.allclose(reports["hierarchical"]["batch_latency_ms"],
                       np.median([r["batch_latency_ms"] for r in runs], axis=0))


def test_host_api_costs_host_only_part_runs_anywhere(tmp_path):
    """``benchmarks/host_api_costs.py --host-only``: the host-only costs (no CUDA) are written, each positive."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "host_api_costs.py"
    out = tmp_path / "costs.json"
    run = subprocess.run([sys.executable, str(script), "--host-only", "--out", str(out)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    costs = json.loads(out.read_text())["us_per_call"]
    assert {"layout_arrays (8 requests)", "host_page_addresses (10 chunks)"} <= set(costs)
    assert all(us > 0 for us in costs.values())


def test_host_after_wait_host_only_part_runs_anywhere(tmp_path):
    """``benchmarks/host_after_wait.py --host-only``: each host work's time after each host-side wait is written,
    with the command."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "host_after_wait.py"
    out = tmp_path / "after_wait.json"
    run = subprocess.run([sys.executable, str(script), "--host-only", "--repeats", "3", "--wait-ms", "0.2", "--out",
                          str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    saved = json.loads(out.read_text())
    assert saved["command"].endswith(f"--out {out}")
    times = saved["layout_arrays (8 requests)"]
    assert set(times) == {"none", "time.sleep", "python busy loop"} and all(us > 0 for us in times.values())


def test_host_breakdown_runs_quickly_and_records_its_command(tmp_path):
    """``benchmarks/host_breakdown.py --quick``: the per-function host times of the hierarchical engine's steps,
    prefetch included, written with the command that produced them."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "host_breakdown.py"
    out = tmp_path / "breakdown.json"
    run = subprocess.run([sys.executable, str(script), "--quick", "--prime", "2", "--batches", "4", "--modes",
                          "hierarchical", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    saved = json.loads(out.read_text())
    assert saved["command"].endswith(f"--out {out}")
    functions = saved["result"]["hierarchical"]["functions_ms_per_batch"]
    assert functions["kv.prefetch"]["calls"] > 0 and functions["kv.acquire"]["mean_ms"] > 0


def test_host_sampling_counts_only_the_marked_samples_by_region_and_library():
    """``benchmarks/host_sampling.py``'s summary of a hand-made py-spy raw profile: samples outside
    ``sampled_window`` are ignored, each sample goes to its innermost listed region, and to the kind of code below
    the innermost frame of our packages."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from host_sampling import summarise
    finally:
        sys.path.pop(0)
    top = "main (b.py:1);sampled_window (benchmarks/host_sampling.py:90);GREngine._step (gr_engine/engine.py:299)"
    raw = [
        "main (b.py:1);warmup (gr_engine/bench/runner.py:3);GREngine._step (gr_engine/engine.py:299) 50",
        f"{top};ModelRunner.prepare (gr_engine/model_runner.py:121);plan (attention_backends/p.py:9);"
        "PyArray_Pack (numpy/_core/_multiarray_umath.so) 3",
        f"{top};ModelRunner.prepare (gr_engine/model_runner.py:121);plan (attention_backends/p.py:9) 2",
        f"{top};ModelRunner.forward (gr_engine/model_runner.py:200);at::empty (torch/lib/libtorch_cpu.so);"
        "cuLaunchKernel (libcuda.so.1) 4",
        f"{top};step (gr_engine/engine.py:10);memcpy (libc.so.6) 1",
    ]
    summary = summarise(raw)
    assert summary["samples"] == 10
    assert summary["regions"] == {"GREngine._step": 10, "ModelRunner.prepare": 5, "ModelRunner.forward": 4}
    assert summary["where"] == {"ModelRunner.prepare": {"numpy": 3, "python": 2}, "ModelRunner.forward": {"cuda": 4},
                                "GREngine._step": {"libc": 1}}
    assert summary["innermost"] == {"ModelRunner.forward -> cuda": 4, "plan -> numpy": 3, "plan -> python": 2,
                                    "step -> libc": 1}
