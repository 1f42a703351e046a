"""Every kept script of ``benchmarks/`` imports against the current code (the GPU-only ones cannot run here), and
``gpu_checks.sh`` parses."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the scripts import Triton: on CPU only its interpreter serves later tests
    os.environ["TRITON_INTERPRET"] = "1"

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", ["cache_bench.py", "kernel_bench.py", "bound_probe.py", "host_overhead.py"])
def test_script_imports(script):
    if script == "kernel_bench.py" and importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # runs nothing: each script's work is under ``if __name__ == "__main__"``
    assert callable(module.main)


def test_gpu_checks_script_parses():
    assert subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu_checks.sh")]).returncode == 0
