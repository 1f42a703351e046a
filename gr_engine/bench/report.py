"""Writing a benchmark's results: JSON, Markdown tables (the paper's Tables 1, 2, 3, 6), PNG plots, summary.json."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np

from ..metrics import HOST_PHASES, PHASES

#: The host probes a run records at its end and as each mode's windows start: what each measures, how to read it.
HOST_PROBES = {
    "host_python_loop_us": ("This instance's host: a 1,000-step Python loop", "Hosts differ by up to ~2x, between "
                            "instances and within a run: compare host times within a run, or scaled by this."),
    "host_torch_op_us": ("Its device calls: a small torch operation on the run's device (on CUDA, a kernel launch)",
                         "The onload phase is mostly driver calls, which this tracks and the Python loop does not."),
}

#: The summary's latency maps (mode -> batch size -> ms) and the statistic of :func:`latency_stats` each holds.
LATENCY_KEYS = (("latency_ms", "median"), ("latency_mean_ms", "mean"), ("latency_p99_ms", "p99"),
                ("latency_max_ms", "max"))


def latency_stats(entry: dict) -> dict[str, float | None]:
    """A window report's ``median``, ``mean``, ``p99`` and ``max`` batch latency (ms): its ``*_ms`` field, else
    computed from ``batch_latency_ms`` (older results), else ``None``."""
    stats = {k: entry.get(f"{k}_ms") for k in ("median", "mean", "p99", "max")}
    if per_batch := entry.get("batch_latency_ms"):
        latency = np.asarray(per_batch, dtype=np.float64)
        computed = {"median": np.median(latency), "mean": latency.mean(), "p99": np.percentile(latency, 99),
                    "max": latency.max()}
        stats = {k: float(computed[k]) if v is None else v for k, v in stats.items()}
    return stats


def summarize(result: dict, bs: int = 8) -> dict:
    """The headline numbers (``summary.json``) at batch size ``bs``: latencies (:data:`LATENCY_KEYS`), speedups over
    recompute (by mean, then median), hit ratios, bound ratios, host probes, host time of steps 1-7 and intake."""
    modes = result["modes"]
    stats = {m: {b: latency_stats(e) for b, e in v["batch_sizes"].items()} for m, v in modes.items()}

    def latency(mode: str, statistic: str) -> float | None:
        return stats.get(mode, {}).get(bs, {}).get(statistic)

    summary = {"gpu": result.get("gpu"), "commit": result.get("commit"), "command": result.get("command")}
    if result.get("report_command"):  # the report was rebuilt from a saved bench.json by this command
        summary["report_command"] = result["report_command"]
    for key, statistic in LATENCY_KEYS:
        summary[key] = {m: {b: e[statistic] for b, e in v.items()} for m, v in stats.items()}
    for name, mode in (("speedup_bs8", "hierarchical"), ("unlimited_speedup_bs8", "unlimited")):
        for suffix, statistic in (("_mean", "mean"), ("", "median")):  # by mean first: batch latencies are heavy-tailed
            rec, other = latency("recompute", statistic), latency(mode, statistic)
            if rec and other:
                summary[name + suffix] = rec / other
    if latency("hierarchical", "p99") is not None:
        summary["hier_p99_ms_bs8"] = latency("hierarchical", "p99")
    hier, unl = latency("hierarchical", "median"), latency("unlimited", "median")
    if "hierarchical" in modes:
        entry = modes["hierarchical"]["batch_sizes"][bs]
        summary["total_hit_ratio_bs8"] = entry["total_hit_ratio"]
        peak = result.get("peak_pinned_h2d_GBps")
        if unl and peak:
            bound = max(unl, entry["onloaded_bytes_per_batch"] / (peak * 1e9) * 1e3)
            summary["hier_over_bound_bs8"] = hier / bound
            ratios = batch_bound_ratios(entry, modes["unlimited"]["batch_sizes"][bs], peak)
            if ratios:  # the same bound batch by batch: each batch's latency over its own bound
                summary["hier_over_batch_bound_bs8"] = float(np.median(ratios))
            pooled = pooled_windows(default_config_windows(result, bs), unl, peak)
            if pooled is not None:  # Table 1's window and the sweeps' at the same configuration, together
                summary["hier_all_windows_bs8"] = pooled
        if (fit := latency_fit(entry)) is not None:
            summary["hier_fit_bs8"] = {"intercept_ms": fit[0], "GBps": fit[1]}
        # Pure CPU time of steps 1-7 (docs/design.md section 3; HOST_PHASES): median over batches, and mean. Intake
        # comes before step 1: reported apart.
        host = entry.get("host_ms_per_batch", {})
        phases = entry["phase_ms_per_batch"]
        summary["overhead_ms_bs8"] = host.get("median")
        summary["overhead_mean_ms_bs8"] = sum(phases.get(k, 0.0) for k in HOST_PHASES)
        summary["intake_ms_bs8"] = phases.get("intake", 0.0)
    for probe in HOST_PROBES:  # at the end of the run, and as hierarchical's windows started
        summary[probe] = result.get(probe)
        if "hierarchical" in modes and probe in modes["hierarchical"]:
            summary[f"{probe}_hierarchical"] = modes["hierarchical"][probe]
    if "gpu_only" in modes:
        summary["gpu_only_hit_ratio_bs8"] = modes["gpu_only"]["batch_sizes"][bs]["gpu_hit_ratio"]
    if "score_drift" in result:
        summary["fp8_score_drift_max_rel"] = result["score_drift"].get("float8_e4m3fn", {}).get("max_rel")
    summary["simulated_total_hit_ratio"] = result["simulated"].get("hierarchical", {}).get("total_hit_ratio")
    if "recompute" in modes:  # host time of the two phases a cache-free pass should barely need (not synchronised)
        phases = modes["recompute"]["batch_sizes"].get(bs, {}).get("phase_ms_per_batch", {})
        if "strip" in phases:
            summary[f"recompute_prepare_strip_ms_bs{bs}"] = phases.get("prepare", 0.0) + phases["strip"]
    peak = result.get("gemm_peak_tflops")
    if peak and "recompute" in modes:  # recompute's model FLOP utilisation: over its batches, and its forward alone
        rec = modes["recompute"]
        summary["recompute_mfu_batch"] = {b: e["model_tflop_per_batch"] / (e["mean_ms"] / 1e3) / peak
                                          for b, e in rec["batch_sizes"].items() if "model_tflop_per_batch" in e}
        breakdown = rec.get("breakdown_bs8", {})
        forward_ms = breakdown.get("phase_ms_per_batch", {}).get("forward")
        if forward_ms and "model_tflop_per_batch" in breakdown:
            summary[f"recompute_mfu_bs{bs}"] = breakdown["model_tflop_per_batch"] / (forward_ms / 1e3) / peak
    if cold := result.get("cold_first_visit"):
        summary[f"cold_{cold['history']}_ms"] = cold["median_ms"]
    if cold := result.get("cold_first_visit_caching"):
        summary[f"cold_{cold['history']}_ms_{cold['mode']}"] = cold["median_ms"]
    stalls = [e["stalls"] for m in modes.values() for e in m["batch_sizes"].values() if "stalls" in e]
    if stalls:  # kernel compilations, cache loads and graph captures inside Table 1's measured batches
        summary["stalls_in_windows"] = int(sum(stalls))
    return summary


def batch_bound_ratios(hier: dict, unlimited: dict, peak_GBps: float) -> list[float]:
    """Each hierarchical batch's latency over its own bound, max(the same batch's unlimited latency, its onloaded
    bytes at ``peak_GBps``), from two window reports of the same batches; empty without per-batch data."""
    lat, onloaded = hier.get("batch_latency_ms"), hier.get("batch_onloaded_bytes")
    floor = unlimited.get("batch_latency_ms")
    if not lat or not onloaded or not floor or len(floor) != len(lat):
        return []
    return [t / max(u, b / (peak_GBps * 1e9) * 1e3) for t, u, b in zip(lat, floor, onloaded, strict=True)]


def default_config_windows(result: dict, bs: int) -> list[dict]:
    """Every hierarchical window report of ``result`` at batch size ``bs`` and the default configuration: Table 1's
    and the sweeps' at the settings' chunk size and GPU pages (other batches of the same trace)."""
    settings = result.get("settings", {})
    windows = [result["modes"]["hierarchical"]["batch_sizes"][bs]]
    for sweep, value in (("chunk_sweep", settings.get("chunk_tokens")), ("budget_sweep", settings.get("gpu_pages"))):
        values = result.get(sweep, {}).get("hierarchical", {})
        entry = values.get(value, values.get(str(value)))
        if entry is not None:
            windows.append(entry)
    return windows


def pooled_windows(windows: list[dict], unlimited_ms: float, peak_GBps: float) -> dict | None:
    """The batches of ``windows`` together: their count, median latency (ms) and that median over the bound
    ``max(unlimited_ms, mean onloaded bytes at peak_GBps)``; ``None`` without per-batch data."""
    if not all(w.get("batch_latency_ms") and w.get("batch_onloaded_bytes") for w in windows):
        return None
    latency = np.concatenate([w["batch_latency_ms"] for w in windows])
    onloaded = np.concatenate([w["batch_onloaded_bytes"] for w in windows]).astype(np.float64)
    median = float(np.median(latency))
    bound = max(unlimited_ms, float(onloaded.mean()) / (peak_GBps * 1e9) * 1e3)
    return {"windows": len(windows), "batches": len(latency), "median_ms": median, "over_bound": median / bound}


BYTE_BUCKETS_MB = (0, 1, 50, 150, 300, 500, float("inf"))


def by_onloaded_bytes(windows: list[dict], peak_GBps: float) -> list[dict]:
    """The batches of ``windows`` grouped by onloaded MB (:data:`BYTE_BUCKETS_MB`): per non-empty group its bounds,
    batch count, mean latency, mean time of its bytes at ``peak_GBps`` and mean excess of latency over it (ms)."""
    latency = np.concatenate([w["batch_latency_ms"] for w in windows])
    mb = np.concatenate([w["batch_onloaded_bytes"] for w in windows]).astype(np.float64) / 1e6
    at_peak = mb / peak_GBps  # MB / (GB/s) = ms
    rows = []
    for low, high in itertools.pairwise(BYTE_BUCKETS_MB):
        keep = (mb >= low) & (mb < high)
        if keep.any():
            rows.append({"mb": (low, high), "batches": int(keep.sum()), "latency_ms": float(latency[keep].mean()),
                         "bytes_at_peak_ms": float(at_peak[keep].mean()),
                         "excess_ms": float((latency[keep] - at_peak[keep]).mean())})
    return rows


def latency_fit(hier: dict, min_bytes: int = 20_000_000) -> tuple[float, float] | None:
    """Least squares ``latency = intercept + onloaded bytes / rate`` over the batches that onloaded at least
    ``min_bytes``: ``(intercept ms, rate GB/s)``, the rate being what onloads cost a batch per byte; ``None`` with
    fewer than three such batches or no growth."""
    lat, onloaded = hier.get("batch_latency_ms"), hier.get("batch_onloaded_bytes")
    if not lat or not onloaded:
        return None
    gb = np.asarray(onloaded, dtype=np.float64) / 1e9
    keep = gb >= min_bytes / 1e9
    if keep.sum() < 3:
        return None
    slope, intercept = np.polyfit(gb[keep], np.asarray(lat, dtype=np.float64)[keep], 1)  # ms per GB, ms
    return (float(intercept), float(1e3 / slope)) if slope > 0 else None


def markdown(result: dict) -> str:
    """The paper's tables for ``result`` (``bench.md``)."""
    modes = result["modes"]
    sizes = sorted({int(b) for m in modes.values() for b in m["batch_sizes"]})
    bs = max(sizes)
    summary = summarize(result, bs)
    lines = [f"# gr-engine benchmark ({result.get('gpu')}, commit {result.get('commit')})", "",
             f"Command: `{result.get('command')}`"]
    if result.get("report_command"):
        lines += ["", f"Report rebuilt from the run's bench.json by `{result['report_command']}`."]
    lines += _headline(summary, bs)
    lines += ["", "## Table 1: latency and hit ratios", "",
              "Batch latency in ms: median, mean, p99 and max over the measured batches (heavy-tailed: a few onload "
              "far more than the rest). Speedup over recompute by mean latency (what throughput sees), then median.",
              ""]
    rows = []
    for name, entry in modes.items():
        for b in sizes:
            e = entry["batch_sizes"][b]
            speedups = [_speedup(summary[key], name, b) for key in ("latency_mean_ms", "latency_ms")]
            rows.append([name, b, *(_ms(summary[key][name][b]) for key, _ in LATENCY_KEYS), *speedups,
                         f"{e['gpu_hit_ratio']:.1%}", f"{e['total_hit_ratio']:.1%}"])
    lines += _table(["mode", "BS", "median ms", "mean ms", "p99 ms", "max ms", "speedup (mean)", "speedup (median)",
                     "GPU hit", "total hit"], rows)
    if "stalls_in_windows" in summary:
        lines += ["", f"Kernel compilations, kernel cache loads and graph captures during these batches (after each "
                  f"engine's warm-up): {summary['stalls_in_windows']}."]
    if "hier_over_bound_bs8" in summary:
        per_batch = summary.get("hier_over_batch_bound_bs8")
        lines += ["", f"Hierarchical at BS={bs}: {summary['hier_over_bound_bs8']:.2f}x its bound (median "
                  "latency over the larger of unlimited's median and the mean onloaded bytes at the pinned copy peak, "
                  f"{result['peak_pinned_h2d_GBps']:.1f} GB/s)"
                  + (f"; batch by batch (each batch's latency over its own bound), median {per_batch:.2f}x."
                     if per_batch is not None else ".")]
    if "hier_all_windows_bs8" in summary:
        pooled = summary["hier_all_windows_bs8"]
        lines += ["", f"Over every window of hierarchical at BS={bs} and the default configuration (this "
                  f"table's, Table 3's and Table 6's: {pooled['batches']} batches of the trace): median "
                  f"{pooled['median_ms']:.2f} ms, {pooled['over_bound']:.2f}x its bound."]
        unlimited = modes["unlimited"]["batch_sizes"][bs]["median_ms"]
        lines += ["", f"The same batches by onloaded bytes (unlimited's median: {unlimited:.2f} ms; excess: latency "
                  "over the bytes' time at the copy peak, batch by batch):", ""]
        rows = by_onloaded_bytes(default_config_windows(result, bs), result["peak_pinned_h2d_GBps"])
        lines += _table(["onloaded MB", "batches", "latency ms", "bytes at peak ms", "excess ms"],
                        [[f"{r['mb'][0]:g}-{r['mb'][1]:g}", r["batches"], f"{r['latency_ms']:.2f}",
                          f"{r['bytes_at_peak_ms']:.2f}", f"{r['excess_ms']:.2f}"] for r in rows])
    if "hier_fit_bs8" in summary:
        fit = summary["hier_fit_bs8"]
        lines += ["", f"Hierarchical batches at BS={bs} that onloaded at least 20 MB: latency ~ "
                  f"{fit['intercept_ms']:.2f} ms + bytes / {fit['GBps']:.1f} GB/s (least squares)."]
    for probe, (what, note) in HOST_PROBES.items():
        if result.get(probe) is None:
            continue
        at_start = ", ".join(f"{name} {e[probe]:.1f}" for name, e in modes.items() if e.get(probe) is not None)
        lines += ["", f"{what} takes {result[probe]:.1f} us at the end of the run"
                  + (f" (us as each mode's windows start: {at_start})" if at_start else "") + f". {note}"]
    if result["simulated"]:
        lines += ["", "Whole-trace hit ratios (policy simulation, same cache code, no model):", ""]
        lines += [f"- {k}: GPU {v['gpu_hit_ratio']:.2%}, total {v['total_hit_ratio']:.2%}"
                  for k, v in result["simulated"].items()]
    lines += ["", "## Table 2: per-step breakdown at the largest batch (ms per step, device-synchronised)", ""]
    lines += _table(["mode", *PHASES], [[name, *_phase_cells(entry["breakdown_bs8"]["phase_ms_per_step"])]
                                        for name, entry in modes.items()])
    if "recompute_mfu_batch" in summary:
        per_batch = ", ".join(f"BS={b} {v:.1%}" for b, v in summary["recompute_mfu_batch"].items())
        forward = summary.get(f"recompute_mfu_bs{bs}")
        lines += ["", f"Recompute's model FLOP utilisation (layers' linear and causal attention FLOPs, "
                  f"gemm_peak_tflops {result['gemm_peak_tflops']:.0f} TFLOP/s measured in this run): over the mean "
                  f"batch latency {per_batch}"
                  + (f"; over the synchronised forward at BS={bs} {forward:.1%}." if forward is not None else ".")]
    if cold := result.get("cold_first_visit"):
        lines += ["", f"A cold first visit of a {cold['history']}-event user, alone (BS=1, nothing cached), from "
                  f"`rank` to its scores on the host, over {cold['visits']} users: median {cold['median_ms']:.2f} ms, "
                  f"mean {cold['mean_ms']:.2f}, p99 {cold['p99_ms']:.2f}, max {cold['max_ms']:.2f}."]
    if c := result.get("cold_first_visit_caching"):
        lines[-1] += (f" In `{c['mode']}` (the history also hashed and its KV kept): median {c['median_ms']:.2f} ms, "
                      f"mean {c['mean_ms']:.2f}, p99 {c['p99_ms']:.2f}, max {c['max_ms']:.2f}.")
    lines += ["", f"Host time per batch at BS={bs} (not synchronised: forward and score include waiting for the "
              "device; gc: the collector's pauses; steps 1-7: schedule to commit without forward and score):", ""]
    rows = []
    for name, entry in modes.items():
        e = entry["batch_sizes"][bs]
        host = e.get("host_ms_per_batch", {})
        spread = " / ".join("-" if host.get(k) is None else f"{host[k]:.3f}" for k in ("median", "mean"))
        rows.append([name, *_phase_cells(e["phase_ms_per_batch"]), f"{e.get('gc_ms_per_batch', 0):.3f}", spread])
    lines += _table(["mode", *PHASES, "gc", "steps 1-7: median / mean"], rows)
    for title, key in (("Table 3: chunk size", "chunk_sweep"), ("Table 6: GPU budget (pages)", "budget_sweep")):
        lines += ["", f"## {title}", ""]
        lines += _table(["mode", "value", "median ms", "mean ms", "p99 ms", "max ms", "total hit (window)",
                         "total hit (whole trace)"],
                        [[mode, value, *_latency_cells(e), f"{e['total_hit_ratio']:.1%}",
                          f"{e['simulated']['total_hit_ratio']:.2%}"]
                         for mode, values in result.get(key, {}).items() for value, e in values.items()])
    scan = result.get("lengths", {})
    lines += ["", "## Latency against history length (fixed new events per visit)", "",
              "Batch latency in ms: median / mean / p99 / max.", ""]
    lines += _table(["history", *scan], [[length, *(" / ".join(_latency_cells(scan[m][length])) for m in scan)]
                                         for length in next(iter(scan.values()), {})])
    if "score_drift" in result:
        lines += ["", "## Score drift of host chunks (requests served from host, against recompute)", ""]
        lines += _table(["host dtype", "max abs", "mean abs", "max / score std", "host hit", "requests"],
                        [[dtype, f"{d['max_abs']:.3g}", f"{d['mean_abs']:.3g}",
                          "-" if d["max_rel"] is None else f"{d['max_rel']:.2%}", f"{d['host_hit_ratio']:.1%}",
                          d["requests_from_host"]] for dtype, d in result["score_drift"].items()])
    return "\n".join(lines) + "\n"


def _table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table's lines: ``header``, then each row's cells (formatted already, or ``str()``-ed)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def _phase_cells(phases: dict[str, float]) -> list[str]:
    return [f"{phases.get(p, 0):.3f}" for p in PHASES]


def _latency_cells(entry: dict) -> list[str]:
    stats = latency_stats(entry)
    return [_ms(stats[k]) for k in ("median", "mean", "p99", "max")]


def _speedup(latency: dict, mode: str, bs: int) -> str:
    """Recompute's latency over ``mode``'s at batch size ``bs`` (``latency``: one of the summary's latency maps)."""
    base, own = latency.get("recompute", {}).get(bs), latency[mode][bs]
    return f"{base / own:.2f}x" if base and own else "-"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _headline(summary: dict, bs: int) -> list[str]:
    """bench.md's opening lines: hierarchical's speedup over recompute at batch size ``bs``, by mean latency first."""
    mean, median = summary.get("speedup_bs8_mean"), summary.get("speedup_bs8")
    if mean is None or median is None:
        return []
    rec, hier = summary["latency_mean_ms"]["recompute"][bs], summary["latency_mean_ms"]["hierarchical"][bs]
    rec_med, hier_med = summary["latency_ms"]["recompute"][bs], summary["latency_ms"]["hierarchical"][bs]
    return ["", f"**Hierarchical at BS={bs}: {mean:.2f}x recompute by mean batch latency** ({hier:.2f} against "
            f"{rec:.2f} ms; what throughput sees), {median:.2f}x by median ({hier_med:.2f} against {rec_med:.2f} ms); "
            f"its p99 is {summary['hier_p99_ms_bs8']:.2f} ms."]


def plot(result: dict, path: Path) -> bool:
    """Latency per mode and batch size, and latency against history length; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, entry in result["modes"].items():
        sizes = sorted(int(b) for b in entry["batch_sizes"])
        left.plot(sizes, [entry["batch_sizes"][b]["median_ms"] for b in sizes], marker="o", label=mode)
    left.set(xlabel="batch size", ylabel="median batch latency (ms)", title="Latency by cache mode")
    left.legend()
    for mode, by_length in result.get("lengths", {}).items():
        lengths = sorted(int(k) for k in by_length)
        right.plot(lengths, [by_length[k]["median_ms"] for k in lengths], marker="o", label=mode)
    right.set(xlabel="history length (events)", ylabel="median batch latency (ms)", xscale="log",
              title="Latency against history length")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def unwritable(out: Path, overwrite: bool) -> str | None:
    """Why results may not go into ``out`` (non-empty, in ``benchmarks/results``, no ``overwrite``), or ``None``."""
    parts = Path(out).resolve().parts
    committed = any(parts[i:i + 2] == ("benchmarks", "results") for i in range(len(parts) - 1))
    if committed and Path(out).is_dir() and any(Path(out).iterdir()) and not overwrite:
        return (f"{out} holds committed results (benchmarks/results); pass --overwrite to replace them, or choose "
                "another --out")
    return None


def write_results(result: dict, out: Path, raw: bool = True) -> list[Path]:
    """Write bench.json (if ``raw``), bench.md, summary.json and (with matplotlib) bench.png into ``out``: the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.md", out / "summary.json"]
    if raw:
        paths.insert(0, out / "bench.json")
        paths[0].write_text(json.dumps(result, indent=2, default=str))
    paths[-2].write_text(markdown(result))
    paths[-1].write_text(json.dumps(summarize(result), indent=2))
    if plot(result, out / "bench.png"):
        paths.append(out / "bench.png")
    else:
        print('warning: matplotlib is not installed, so no plot (bench.png) was written; pip install ".[bench]" '
              "to get it", file=sys.stderr)
    return paths


def load_result(path: Path) -> dict:
    """A saved ``bench.json`` as :func:`~.experiments.run_benchmark` returned it (int keys restored); ``ValueError``
    for a file that is not a benchmark result."""
    try:
        result = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from exc
    except RecursionError as exc:
        raise ValueError(f"{path} is not a gr-engine bench result: values nested too deeply") from exc
    if not isinstance(result, dict) or not isinstance(result.get("modes"), dict) or "simulated" not in result:
        raise ValueError(f"{path} is not a gr-engine bench result (bench.json: no 'modes' and 'simulated')")
    try:
        for entry in result["modes"].values():
            entry["batch_sizes"] = _int_keys(entry["batch_sizes"])
        for key in ("chunk_sweep", "budget_sweep", "lengths"):
            if key in result:
                result[key] = {mode: _int_keys(values) for mode, values in result[key].items()}
    except (KeyError, TypeError, AttributeError, ValueError) as exc:  # a hand-made or cut file
        raise ValueError(f"{path} is not a complete gr-engine bench result ({type(exc).__name__}: {exc})") from exc
    return result


def _int_keys(mapping: dict) -> dict:
    return {int(k): v for k, v in mapping.items()}
