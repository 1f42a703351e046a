"""Every kept script of ``benchmarks/`` imports against the current code (the GPU-only ones cannot run here), and
``gpu_checks.sh`` parses."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the scripts import Triton: on CPU only its interpreter serves later tests
    os.environ["TRITON_INTERPRET"] = "1"

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(script: str):
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # runs nothing: each script's work is under ``if __name__ == "__main__"``
    return module


@pytest.mark.parametrize("script", ["cache_bench.py", "kernel_bench.py", "bound_probe.py", "host_overhead.py",
                                    "kernel_profile.py"])
def test_script_imports(script):
    if script == "kernel_bench.py" and importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    assert callable(load(script).main)


def test_tile_sweep_imports_and_counts_causal_flops_once(monkeypatch):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports its sibling kernel_bench.py, as when run as a script
    module = load("tile_sweep.py")
    width = module.HEADS * module.DIM
    assert module.step_tflop([0], [8192], [0]) == pytest.approx(4 * width * 8192 * 8193 / 2 / 1e12)
    # a candidate attends the whole history and itself
    assert module.step_tflop([0], [10], [3]) == pytest.approx(4 * width * (55 + 3 * 11) / 1e12)


def test_gpu_checks_script_parses():
    assert subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu_checks.sh")]).returncode == 0


def test_kernel_profile_quick_run(tmp_path):
    """The per-kernel profile's CPU-sized run: every operator's share of the profiled time, groups that add up, the
    batches' model FLOPs."""
    module = load("kernel_profile.py")
    module.main(["--quick", "--mode", "hierarchical", "--batches", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "kernel_profile.json").read_text())
    table = result["table"]
    assert table and not result["kernels"] and result["mfu_over_wall"] is None  # CPU: operators, no GEMM peak
    assert sum(r["share"] for r in table) == pytest.approx(1.0) and sum(result["groups"].values()) == pytest.approx(1.0)
    assert result["wall_ms_per_batch"] > 0 and result["model_tflop_per_batch"] > 0
    assert module.group_of("aten::addmm") == "gemm" and module.group_of("aten::bmm") == "gemm"
    assert module.group_of("nvjet_sm90_tst_256x144_64x4_1x2_h_bz_coopA_bias_TNT") == "gemm"
    assert module.group_of("_append_kernel") == "copy"
    assert module.group_of("_hstu_attn_fwd_kernel") == "attention" and module.group_of("x") == "other"
    assert "| `" in (tmp_path / "kernel_profile.md").read_text()
    saved = tmp_path / "kernel_profile.json"
    result["groups"], result["table"][0]["group"] = {"stale": 1.0}, "stale"
    saved.write_text(json.dumps(result))
    module.main(["--report-only", str(saved)])  # regroups a saved run
    regrouped = json.loads(saved.read_text())
    assert "stale" not in regrouped["groups"] and sum(regrouped["groups"].values()) == pytest.approx(1.0)
