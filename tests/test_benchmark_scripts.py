"""Every kept script of ``benchmarks/`` imports against the current code (the GPU-only ones cannot run here), and
``gpu_checks.sh`` parses."""

from __future__ import annotations

import importlib.util
import json
import os
import re
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


def test_cold_visits_runs_the_benchs_first_visits_per_mode(tmp_path):
    """cold_visits.py, quick (CPU, tiny model): each mode's first visits, each round, and their median."""
    out = tmp_path / "cold.json"
    load("cold_visits.py").main(["--out", str(out), "--quick", "--rounds", "2"])
    result = json.loads(out.read_text())
    assert set(result["median_ms"]) == {"recompute", "gpu_only"}
    for mode, runs in result["runs"].items():
        assert len(runs) == 2 and all(run["mode"] == mode and run["visits"] > 0 for run in runs)
        assert result["median_ms"][mode] > 0


def test_tile_sweep_imports_and_counts_causal_flops_once(monkeypatch):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports its sibling kernel_bench.py, as when run as a script
    module = load("tile_sweep.py")
    width = module.HEADS * module.DIM
    assert module.step_tflop([0], [8192], [0]) == pytest.approx(4 * width * 8192 * 8193 / 2 / 1e12)
    # a candidate attends the whole history and itself
    assert module.step_tflop([0], [10], [3]) == pytest.approx(4 * width * (55 + 3 * 11) / 1e12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's float16 check; the GPU runs the probe itself")
def test_dense_attention_probe_agrees_with_the_paged_kernel(monkeypatch):
    """The dense-prefill probe kernel (pointer loads and TMA, query tiles taller and shorter than key tiles) gives
    the engine's paged kernel's output on the same K and V, in float16 under Triton's interpreter."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    import dataclasses

    from attention_backends.hstu_triton import HSTUTritonBackend

    module = load("dense_attention_probe.py")
    proj = torch.randn(200, 4 * module.WIDTH, generator=torch.Generator().manual_seed(0)).half()
    q, k, v, cache, meta = module.paged_step(proj)
    backend = HSTUTritonBackend(dataclasses.replace(module.SPEC, dtype=torch.float16, device_type="cpu"))
    expected = backend.attend(q, k, v, cache, backend.build_metadata(meta))
    for shape in ((64, 64, 4, 2, True), (32, 64, 4, 2, True), (64, 32, 4, 2, False)):
        got = module.dense_prefill(proj, shape, False)
        torch.testing.assert_close(got, expected, rtol=2**-9, atol=1e-6)  # fp16 outputs of ~1e-3: a rounding


def test_kernel_ab_loads_a_copy_of_the_kernels_module(monkeypatch, tmp_path):
    """kernel_ab.py's baseline is a file outside the package: loaded on its own, it gives that file's kernel."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = load("kernel_ab.py")
    source = BENCHMARKS.parent / "attention_backends" / "hstu_triton_kernels.py"
    copy = tmp_path / "old_kernels.py"
    copy.write_text(source.read_text())
    from attention_backends import hstu_triton_kernels

    kernel = module.load_kernel(str(copy))
    assert kernel is not hstu_triton_kernels.hstu_paged_attention_kernel
    assert kernel.arg_names == hstu_triton_kernels.hstu_paged_attention_kernel.arg_names


def test_plan_ab_loads_a_copy_of_the_plan_module_and_pads_its_cases(monkeypatch, tmp_path):
    """plan_ab.py's baseline is a copy of the device-plan module loaded inside the package (its relative imports
    resolve); each case's step fits its bucket, spare requests without rows."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = load("plan_ab.py")
    from attention_backends import hstu_triton_device_plan

    copy = tmp_path / "old_plan.py"
    copy.write_text(Path(hstu_triton_device_plan.__file__).read_text())
    baseline = module.load_plan_module(str(copy))
    assert baseline.write_plan is not hstu_triton_device_plan.write_plan
    assert baseline.TileConfig is hstu_triton_device_plan.TileConfig  # the package's own plan module, imported once
    for rows, requests, real in module.CASES.values():
        num_tiles, num_items, step = module.padded_step(rows, requests, real, "cpu")
        qsl = step["query_start_loc"].tolist()
        assert len(qsl) == requests + 1 and qsl[0] == 0 and qsl[-1] == sum(h + c for h, c, _ in real) <= rows
        assert qsl[len(real):] == [qsl[-1]] * (requests + 1 - len(real))  # spare requests: no rows
        assert step["kv_seq_lens"].tolist()[:len(real)] == [h + cached for h, _, cached in real]
        assert num_items >= num_tiles >= -(-qsl[-1] // module.tile_config().block_m)
    with pytest.raises(ValueError, match="do not fit"):
        module.padded_step(128, 1, [(200, 0, 0)], "cpu")


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


def test_kernel_profile_cold_visits(tmp_path):
    """``--cold-history``: cold first visits of fixed-length users, each profiled alone, with their host gaps (the
    span no kernel ran: on CPU the Python between operators), host ops and synchronising calls; ``--set`` reaches
    the engine config."""
    module = load("kernel_profile.py")
    assert module.merge([(5, 7), (0, 2), (1, 3), (6, 6.5)]) == [(0, 3), (5, 7)]
    assert module.gaps_of((0, 10), [(-1, 2), (4, 5), (9, 12)]) == [(2, 4), (5, 9)]
    assert module.gaps_of((0, 10), []) == [(0, 10)]
    module.main(["--quick", "--cold-history", "100", "--batches", "3", "--set", "cuda_graph_max_rows=16384",
                 "--out", str(tmp_path)])
    result = json.loads((tmp_path / "kernel_profile.json").read_text())
    cold = result["cold"]
    assert cold["history"] == 100 and cold["step_rows"] == cold["largest_step_rows"] == 100 + 8  # 8 candidates
    assert cold["steps_per_visit"] == 1 and cold["visit_step_rows"] == [108]
    assert cold["cuda_graph_max_rows"] == 16384 and cold["overrides"] == ["cuda_graph_max_rows=16384"]
    assert cold["eager"] and not cold["step_graphs"] and cold["graph_launches"] == 0  # CPU: no step graphs
    assert cold["warmup_s"] > 0 and cold["warmup_graphs"] == 0 and cold["warmup_reserved_bytes"] == 0
    assert result["batch"] == 1 and result["batches"] == 3 and cold["visits"] == 3
    assert len(cold["per_visit"]) == len(cold["wall_ms"]) == 3 and len(cold["unprofiled_wall_ms"]) == 3
    # a visit longer than a chunk runs in steps, recorded as the engine ran them (the candidates with the last)
    chunked = tmp_path / "chunked"
    module.main(["--quick", "--cold-history", "100", "--batches", "1", "--set", "scheduler.max_chunk_tokens=40",
                 "--out", str(chunked)])
    cold_chunked = json.loads((chunked / "kernel_profile.json").read_text())["cold"]
    assert cold_chunked["visit_step_rows"] == [40, 40, 28] and cold_chunked["largest_step_rows"] == 40
    assert cold["kernels_outside_visits"] == 0 and result["model_tflop_per_batch"] > 0
    assert all(r["name"] != module.MARKER for r in result["table"]) and sum(r["share"] for r in result["table"]) == \
        pytest.approx(1.0)
    eps = 1e-6
    for visit, wall in zip(cold["per_visit"], cold["wall_ms"]):
        # the profiled range is within the perf counter's (another clock: 20 us slack)
        assert visit["kernels"] > 0 and 0 < visit["span_ms"] <= wall + 0.02
        assert 0 < visit["kernel_ms"] <= visit["busy_ms"] + eps  # CPU: nested operators' self times are disjoint
        assert visit["busy_ms"] <= visit["span_ms"] + eps and 0 <= visit["gap_fraction"] <= 1
        assert visit["gap_ms"] == pytest.approx(visit["span_ms"] - visit["busy_ms"], abs=1e-6)
        assert visit["gap_fraction"] == pytest.approx(visit["gap_ms"] / visit["span_ms"])
        assert min(visit["head_ms"], visit["tail_ms"]) >= 0
        assert visit["head_ms"] + visit["tail_ms"] <= visit["gap_ms"] + eps
        assert visit["python_ms"] == pytest.approx(visit["gap_ms"], abs=1e-6)  # CPU: the kernels are the host ops
    assert sum(v["kernel_ms"] for v in cold["per_visit"]) == pytest.approx(result["device_ms_per_batch"] * 3, rel=1e-6)
    assert cold["wall_ms_median"] == pytest.approx(sorted(cold["wall_ms"])[1])
    assert 0 < len(cold["largest_gaps"]) <= 10 and all(g["gap_ms"] > 0 for g in cold["largest_gaps"])
    assert [g["gap_ms"] for g in cold["largest_gaps"]] == sorted((g["gap_ms"] for g in cold["largest_gaps"]),
                                                                 reverse=True)
    ops = cold["host_ops"]
    assert ops and all(r["calls"] >= 1 and r["total_ms"] >= 0 for r in ops)
    assert ops == sorted(ops, key=lambda r: -r["total_ms"])
    assert all(re.search(module.SYNC, r["name"]) for r in cold["sync_calls"])
    assert module.group_of("x") == "other" and re.search(module.SYNC, "cudaStreamSynchronize")
    assert re.search(module.SYNC, "cudaMemcpy") and not re.search(module.SYNC, "cudaMemcpyAsync")
    md = (tmp_path / "kernel_profile.md").read_text()
    assert "## Cold first visits: 100 events" in md and "Synchronising calls" in md
    assert "cuda_graph_max_rows 16384" in md
    module.main(["--report-only", str(tmp_path / "kernel_profile.json")])  # keeps the cold section
    assert json.loads((tmp_path / "kernel_profile.json").read_text())["cold"] == cold
    assert "## Cold first visits" in (tmp_path / "kernel_profile.md").read_text()
    with pytest.raises(SystemExit):  # the closed-loop batches take no config overrides
        module.main(["--quick", "--set", "cuda_graph_max_rows=0", "--out", str(tmp_path)])


def test_warmup_cost_quick_runs_each_case(tmp_path):
    """warmup_cost.py on CPU: one record per case, in order; no step graphs there, so nothing is captured."""
    module = load("warmup_cost.py")
    assert module.parse_cases("hierarchical:8:4096,recompute:1:16384") == [("hierarchical", 8, 4096),
                                                                            ("recompute", 1, 16384)]
    out = tmp_path / "warmup_cost.json"
    module.main(["--quick", "--out", str(out), "--cases", "hierarchical:2:256,recompute:1:512"])
    result = json.loads(out.read_text())
    assert [(c["mode"], c["batch"], c["max_rows"]) for c in result["cases"]] == [("hierarchical", 2, 256),
                                                                                 ("recompute", 1, 512)]
    assert all(c["captured"] == 0 and c["warmup_s"] > 0 and c["reserved_mib"] == 0 for c in result["cases"])
    assert result["command"].endswith("--quick")
