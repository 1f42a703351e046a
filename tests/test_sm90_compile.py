"""The engine's Triton kernels compile for the H200 (sm_90) on a machine without a GPU.

``benchmarks/compile_check.py`` builds them with Triton's compiler and the ``ptxas`` of the triton wheel at the bench
model's shapes, in a process of its own (Triton must not be in interpreter mode there, as the CPU tests put it). A
kernel that cannot compile for the GPU fails here rather than in a device session; the row-wise kernels, the append and
the attention's decode tiles must not spill registers, and the shapes run or timed two programs an SM must fit two.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ptxas_available() -> bool:
    spec = importlib.util.find_spec("triton")
    return spec is not None and spec.origin is not None and \
        (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not ptxas_available(), reason="needs triton with its CUDA backend (ptxas)")
def test_kernels_compile_for_sm90(tmp_path):
    out = tmp_path / "compile_check.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_check.py"), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kernels = {k["label"]: k for k in json.loads(out.read_text())["kernels"]}
    assert len(kernels) == 14 and all(k["ok"] for k in kernels.values())
    for label, kernel in kernels.items():
        assert 0 < kernel["registers"] <= 255 and kernel["shared_bytes"] <= 227 * 1024, label  # an H200 SM's limits
        # (the device plan is one program a step holding [items, tiles] one-hot arrays: it may spill)
        if not label.startswith(("attention", "device plan")) or label == "attention decode tiles":
            assert kernel["spill_store_bytes"] == kernel["spill_load_bytes"] == 0, label
    # tile_sweep.py's shape of two programs an SM must fit two (else its grid's second half waits)
    assert kernels["attention 64 x 64, 4 warps, 3 stages (tile_sweep.py's two an SM)"]["programs_per_sm"] >= 2
    assert kernels["attention decode tiles"]["programs_per_sm"] >= 2  # default_tile_config runs them two an SM
