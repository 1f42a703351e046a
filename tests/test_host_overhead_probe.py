"""``benchmarks/host_overhead.py --graph-path``: the GPU engine's host work runs on the CPU, every step served."""

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
