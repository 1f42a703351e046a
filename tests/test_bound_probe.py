"""``benchmarks/bound_probe.py`` runs on CPU (the GPU sessions' A/B command must not fail on a typo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np


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
