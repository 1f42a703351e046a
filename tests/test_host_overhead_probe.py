"""``benchmarks/host_overhead.py --graph-path``: the GPU engine's host work runs on the CPU, every step served, the
device work left out through the engine's public seams."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gr_engine.bench.runner import BenchSettings

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "host_overhead.py"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreted)")
@pytest.mark.parametrize("mode", ["unlimited", "hierarchical"])
def test_graph_path_probe_stages_steps_and_serves_every_request(mode):
    run = subprocess.run([sys.executable, str(PROBE), "--graph-path", "--batches", "3", "--mode", mode],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "failed" not in run.stdout + run.stderr  # no request errored (e.g. a stub of the wrong shape)
    staged = re.search(r"(\d+) steps staged for graphs", run.stdout)
    assert staged and int(staged.group(1)) >= 8, run.stdout  # the returning visits took the graph path


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreted)")
@pytest.mark.parametrize("mode", [None, "hierarchical"])
def test_cold_history_probe_stages_each_first_visit_as_one_step(mode):
    """``--cold-history``: every first visit (5 unmeasured, then ``--batches``) is served as one step staged for
    graphs, and the wall time and phases of the median visit are reported (recompute unless ``--mode`` is given)."""
    run = subprocess.run([sys.executable, str(PROBE), "--cold-history", "600", "--batches", "4"]
                         + (["--mode", mode] if mode else []), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"{mode or 'recompute'}, cold first visits of 600 events"), run.stdout
    found = re.search(r"\((\d+) measured, (\d+) steps staged for graphs\): wall per visit median ([\d.]+) ms",
                      run.stdout)
    assert found and (int(found.group(1)), int(found.group(2))) == (4, 9) and float(found.group(3)) > 0, run.stdout
    assert "'strip'" in run.stdout and "failed" not in run.stdout + run.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreted)")
def test_bench_trace_probe_serves_the_benchmarks_windows():
    """``--bench-trace``: the benchmark's trace and windows run through (every request served, the host tier's
    bookkeeping keeping the benchmark's hit ratio) and report the host time of steps 1-7 per batch."""
    run = subprocess.run([sys.executable, str(PROBE), "--bench-trace", "--mode", "hierarchical"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    found = re.search(r"\((\d+) batches; total hit ratio ([\d.]+)\): steps 1-7 per batch median ([\d.]+) ms",
                      run.stdout)
    assert found, run.stdout
    batches = BenchSettings().window_requests // 8  # the benchmark's windows at batch size 8
    assert int(found.group(1)) == batches and float(found.group(2)) > 0.99 and float(found.group(3)) > 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreted)")
def test_graph_path_uses_the_engines_public_seams_only(monkeypatch):
    """The probe leaves the device work out through the model, ``runner.graphs`` and the host tier's transfer engine;
    an engine with a real model is refused (its eager steps would run attention in Triton's interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as the probe runs (nothing is launched here)
    spec = importlib.util.spec_from_file_location("host_overhead", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    from gr_engine import CacheConfig, EngineConfig, GREngine, ModelConfig

    model = ModelConfig(num_items=100, num_actions=4, d_model=16, num_layers=2, num_heads=1, head_dim=16,
                        max_history_len=256, max_candidates=8, num_tasks=2, ranking_hidden=16, dtype="float32")
    cache = CacheConfig(mode="hierarchical", page_size=16, num_gpu_pages=64, chunk_tokens=64, host_budget_bytes=2**20)
    config = EngineConfig(model=model, device="cpu", attention_backend="hstu_triton", cache=cache)
    with pytest.raises(ValueError, match="host_only_model"):
        probe.use_graph_path(GREngine(config))
    engine = GREngine(config, model=probe.host_only_model(model))
    graphs = probe.use_graph_path(engine)
    assert engine.runner.graphs is graphs and isinstance(engine.kv.host.transfer, probe.NoCopyTransfer)
