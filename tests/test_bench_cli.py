"""``gr-engine bench``'s command line: where it writes, what it refuses before running anything, the plot warning
and ``--report-only`` (a report rebuilt from a saved ``bench.json``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from gr_engine.bench.report import unwritable
from gr_engine.bench.runner import BENCH_CACHE_FIELDS, BenchSettings
from gr_engine.cli import build_parser, main

COMMITTED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "bench" / "bench.json"


@pytest.fixture
def no_run(monkeypatch):
    """Fail the test if the benchmark itself starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr("gr_engine.bench.experiments.run_benchmark", refuse)


def test_default_out_is_outside_the_committed_results(capsys):
    args = build_parser().parse_args(["bench", "--quick"])
    assert args.out is None and not args.overwrite  # the command writes into ./bench-out then
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "default ./bench-out" in capsys.readouterr().out


def test_committed_results_are_replaced_only_with_overwrite(tmp_path, capsys, no_run):
    committed = tmp_path / "benchmarks" / "results" / "bench"
    committed.mkdir(parents=True)
    assert unwritable(committed, overwrite=False) is None  # empty: nothing to overwrite
    (committed / "bench.json").write_text("{}")
    assert "--overwrite" in unwritable(committed, overwrite=False)
    assert unwritable(committed, overwrite=True) is None
    assert unwritable(tmp_path / "elsewhere", overwrite=False) is None
    assert main(["bench", "--quick", "--out", str(committed)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (committed / "bench.json").read_text() == "{}" and len(list(committed.iterdir())) == 1


@pytest.mark.parametrize("field", sorted(BENCH_CACHE_FIELDS))
def test_cache_fields_the_bench_sets_itself_are_refused(field, tmp_path, capsys, no_run):
    """``--cache mode=recompute`` would turn every engine into recompute while its results stay labelled by mode."""
    value = {"mode": "recompute", "host_dtype": "kv"}.get(field, "64")
    assert main(["bench", "--quick", "--out", str(tmp_path / "x"), "--cache", f"{field}={value}"]) == 2
    err = capsys.readouterr().err
    assert "invalid --cache" in err and field in err
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match=field):
        BenchSettings(cache=((field, value),))


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--users", "0", "--users"), ("--users", "-3", "--users"), ("--window", "0", "--window"),
    ("--window", "7", "--window"), ("--host-budget-gib", "0", "--host-budget-gib"),
    ("--host-budget-gib", "-1", "--host-budget-gib"),
    ("--host-budget-gib", "1e30", "is over this machine's memory"),  # failed after modes had run
    ("--users", "4", "too few for the measured windows"),  # the trace is generated, nothing is run
])
def test_nonsense_sizes_fail_with_a_clear_message(option, value, message, tmp_path, capsys):
    assert main(["bench", "--quick", "--out", str(tmp_path / "x"), option, value]) == 2
    err = capsys.readouterr().err
    assert message in err and "numpy" not in err and "dimension" not in err, err
    assert not (tmp_path / "x" / "bench.json").exists()


def test_report_only_rebuilds_the_report_and_warns_without_matplotlib(tmp_path, capsys, monkeypatch):
    """``--report-only`` on the committed H200 run: the summary gains the mean-based headline and the p99, computed
    from the per-batch latencies; bench.json is not rewritten; without matplotlib a warning says how to get the
    plot."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    assert main(["bench", "--report-only", str(COMMITTED), "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "no plot" in err and 'pip install ".[bench]"' in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.md", "summary.json"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    raw = json.loads(COMMITTED.read_text())["modes"]
    mean = {m: np.mean(raw[m]["batch_sizes"]["8"]["batch_latency_ms"]) for m in ("recompute", "hierarchical")}
    assert summary["speedup_bs8_mean"] == pytest.approx(mean["recompute"] / mean["hierarchical"])
    assert summary["latency_mean_ms"]["hierarchical"]["8"] == pytest.approx(mean["hierarchical"])
    hier = raw["hierarchical"]["batch_sizes"]["8"]["batch_latency_ms"]
    assert summary["hier_p99_ms_bs8"] == pytest.approx(np.percentile(hier, 99))
    assert summary["latency_p99_ms"]["hierarchical"]["8"] == summary["hier_p99_ms_bs8"]
    assert summary["speedup_bs8"] == pytest.approx(raw["recompute"]["batch_sizes"]["8"]["median_ms"]
                                                   / raw["hierarchical"]["batch_sizes"]["8"]["median_ms"])
    assert summary["report_command"].startswith("gr-engine bench --report-only")
    text = (tmp_path / "bench.md").read_text()
    assert "by mean batch latency" in text and "| mean ms | p99 ms |" in text


def test_report_only_refuses_what_is_not_a_bench_result(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpu": "x"}))
    assert main(["bench", "--report-only", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "not a gr-engine bench result" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ('{"modes": {"a": {}}, "simulated": 1}', "is not a complete gr-engine bench result (KeyError: 'batch_sizes')"),
    ('{"modes": {"a": {"batch_sizes": {"8": {}}}}, "simulated": 1}', "is not a complete bench result"),
    ("[" * 100_000, "values nested too deeply"),
])
def test_report_only_of_a_hand_made_or_cut_file_is_one_error(content, message, tmp_path, capsys):
    """Files that pass the first look (``modes`` and ``simulated``) but lack what the report reads, or are nested
    too deeply to parse: one line, exit 2, nothing written (they were tracebacks)."""
    bad = tmp_path / "bench.json"
    bad.write_text(content)
    assert main(["bench", "--report-only", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_modes_runs_only_those_modes_tables(tmp_path, capsys):
    """``--modes``: the chosen modes' Tables 1-2 and the run's peaks, without the sweeps, length scan, score drift and
    simulations; the report and summary are written from what ran."""
    out = tmp_path / "out"
    assert main(["bench", "--quick", "--modes", "recompute,unlimited", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert list(result["modes"]) == ["recompute", "unlimited"]
    assert not {"chunk_sweep", "budget_sweep", "lengths", "score_drift"} & set(result) and result["simulated"] == {}
    assert "peak_pinned_h2d_GBps" in result and "gemm_peak_tflops" in result
    summary = json.loads((out / "summary.json").read_text())
    assert summary["unlimited_speedup_bs8_mean"] > 0 and "speedup_bs8" not in summary
    cold = result["cold_first_visit"]  # recompute is among the modes: the cold first visits are measured
    assert cold["history"] == 100 and cold["visits"] == len(cold["latency_ms"]) == 4
    assert summary["cold_100_ms"] == cold["median_ms"] > 0
    caching = result["cold_first_visit_caching"]  # the same first visits in a caching mode
    assert caching["mode"] == "gpu_only" and caching["visits"] == 4
    assert summary["cold_100_ms_gpu_only"] == caching["median_ms"] > 0
    phases = result["modes"]["recompute"]["batch_sizes"]["8"]["phase_ms_per_batch"]
    assert summary["recompute_prepare_strip_ms_bs8"] == pytest.approx(phases["prepare"] + phases["strip"])
    report = (out / "bench.md").read_text()
    assert "## Table 1" in report and "A cold first visit of a 100-event user" in report and "In `gpu_only`" in report


def test_unknown_modes_are_refused(tmp_path, capsys, no_run):
    assert main(["bench", "--quick", "--modes", "recompute,cached", "--out", str(tmp_path / "out")]) == 2
    assert "modes must be some of" in capsys.readouterr().err
