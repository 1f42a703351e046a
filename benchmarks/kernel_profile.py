"""Where one benchmark batch's device time goes: a per-kernel profile (``torch.profiler``) of the bench's engine.

    python benchmarks/kernel_profile.py --out DIR [--mode recompute] [--batch 8] [--batches 3] [--commit C]
    python benchmarks/kernel_profile.py --out DIR --quick          # the bench's CPU-sized run: operators, not kernels
    python benchmarks/kernel_profile.py --report-only DIR/kernel_profile.json  # regroup a saved run, rewrite its .md
    python benchmarks/kernel_profile.py --out DIR --cold-history 8192 [--batches 5] [--set cuda_graph_max_rows=16384]
    python benchmarks/kernel_profile.py --out DIR --quick --cold-history 100   # the same on CPU (seconds)

Builds ``gr-engine bench``'s engine for ``--mode`` (its model, trace, cache and GPU budget), serves the trace's first
visits (cached modes) and moves to the middle of the steady requests, serves two unprofiled batches, then profiles
``--batches`` closed-loop batches of ``--batch`` requests. Reports every kernel (on CPU: every operator) by its self
time on the device, with its calls and its share of the profiled time, grouped into GEMM, attention, norm,
elementwise, copy and other; the batches' wall time, model FLOPs (``gr_engine.bench.flops``) and the model FLOP
utilisation against the bf16 GEMM peak measured in the same process. Writes ``DIR/kernel_profile.json`` and
``DIR/kernel_profile.md``.

With ``--cold-history N`` it profiles cold first visits instead, as ``gr-engine bench``'s ``cold_*_ms``
(``experiments.cold_first_visits``): a recompute engine of BS=1, warmed up, over users of ``N``-event histories
(``fixed_length_trace``); two visits unmeasured, ``--batches`` visits timed unprofiled, then ``--batches`` visits
profiled, each ``engine.rank([request])`` alone.
``--set KEY=VALUE`` overrides that engine's config (``gr_engine.config.load_config``, as ``gr-engine --set``).
Besides the table, the JSON's ``cold`` section (the .md's "Cold first visits") has per visit: wall time, kernel time,
the device's busy time (union of kernel intervals) and its *host gaps* (the visit's span with no kernel running: before
the first kernel, between kernels, after the last), the time no profiled host op ran (Python), the largest gaps with
the innermost host op spanning each, the top host ops by CPU self time and every synchronising call. On CPU the
"kernels" are the operators, so the gaps are the Python time between them.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from gr_engine.bench.flops import gemm_peak_tflops, step_flops
from gr_engine.bench.runner import BenchRun, BenchSettings, cache_config, engine_config, quick_settings, unlimited_pages
from gr_engine.bench.trace import fixed_length_trace, generate_trace
from gr_engine.config import load_config
from gr_engine.engine import GREngine

#: Kernel (or operator) name patterns of each group, tried in order; a name matching none is "other".
GROUPS = (
    ("attention", r"hstu|attn|attention|flash|fmha"),
    ("gemm", r"gemm|cutlass|cublas|nvjet|sm\d+_xmma|matmul|addmm|::b?mm\b|linear"),
    ("norm", r"layer_?norm|LayerNorm"),
    ("copy", r"memcpy|memset|copy|cat|index|gather|scatter|embedding|append"),
    ("elementwise", r"elementwise|vectorized|silu|mul|add|where|fill|reduce|sum"),
)
#: Host calls that wait for the device: CUDA runtime syncs and blocking copies, and the aten ops that read a device
#: value on the host (``.item()``, ``nonzero``). One per cold visit is expected (its scores to the host).
SYNC = r"(?i:synchroni[sz]e)|^cudaMemcpy(2D)?$|^cuMemcpy(DtoH|HtoD)?(_v2)?$|^aten::_local_scalar_dense$|^aten::nonzero$"
#: The ``record_function`` range around each profiled cold visit.
MARKER = "kernel_profile.cold_visit"


def group_of(name: str) -> str:
    """The group of a kernel or operator name (:data:`GROUPS`)."""
    for group, pattern in GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def kernel_table(prof: profile, cuda: bool) -> list[dict]:
    """Each kernel (CUDA) or operator (CPU) with self time: name, group, calls, total and mean microseconds, share."""
    rows = []
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us <= 0 or event.key == MARKER or (cuda and event.device_type != torch.autograd.DeviceType.CUDA):
            continue
        rows.append({"name": event.key, "group": group_of(event.key), "calls": event.count, "total_us": us,
                     "mean_us": us / max(event.count, 1)})
    total = sum(r["total_us"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["total_us"] / total
    return sorted(rows, key=lambda r: -r["total_us"])


def run(mode: str, batch: int, batches: int, quick: bool) -> dict:
    settings = quick_settings() if quick else BenchSettings(modes=(mode,))
    trace = generate_trace(settings.trace)
    pages = unlimited_pages(settings, trace) if mode == "unlimited" else settings.gpu_pages
    bench = BenchRun(settings, trace, cache_config(settings, mode, num_gpu_pages=pages), batch)
    engine, cuda = bench.engine, settings.device.startswith("cuda")
    middle = len(bench.steady) // 2
    if mode == "recompute":
        bench.cursor = middle
    else:
        bench.warmup()
        bench.fast_forward(middle)
    indices = bench.steady[bench.cursor:bench.cursor + (2 + batches) * batch]
    requests = [trace.rank_request(i) for i in indices]
    if len(requests) < (2 + batches) * batch:
        raise ValueError("the trace has too few steady requests for these batches (use fewer --batches)")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for start in range(0, 2 * batch, batch):  # unprofiled: the first steps of these shapes
        engine.rank(requests[start:start + batch], use_tqdm=False)
    sync()
    profiled, outputs = requests[2 * batch:], []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for start in range(0, len(profiled), batch):
            outputs += engine.rank(profiled[start:start + batch], use_tqdm=False)
            sync()
        wall_s = time.perf_counter() - t0
    failed = [o.error for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"a profiled request failed: {failed[0]}")
    flops = step_flops(settings.model, [o.num_gpu_cached_tokens + o.num_host_cached_tokens for o in outputs],
                       [len(r.item_ids) for r in profiled], [len(r.candidate_item_ids) for r in profiled])
    table = kernel_table(prof, cuda)
    device_s = sum(r["total_us"] for r in table) / 1e6
    peak = gemm_peak_tflops(settings.device)
    bench.close()
    return {
        "mode": mode, "batch": batch, "batches": batches, "device": settings.device, "kernels": cuda,
        "wall_ms_per_batch": wall_s / batches * 1e3, "device_ms_per_batch": device_s / batches * 1e3,
        "model_tflop_per_batch": flops / batches / 1e12, "gemm_peak_tflops": peak,
        "mfu_over_wall": flops / wall_s / 1e12 / peak if peak else None,
        "mfu_over_device": flops / device_s / 1e12 / peak if peak and device_s else None,
        "groups": group_shares(table), "table": table,
    }


def cold_run(history: int, visits: int, quick: bool, overrides: list[str]) -> dict:
    """Profile ``visits`` cold first visits of ``history``-event users (as the bench's ``cold_{history}_ms``); the
    result has :func:`run`'s fields (per batch: per visit) and ``cold`` (:func:`visit_timelines` and the visits'
    perf-counter wall times in ms: ``wall_ms`` each, ``wall_ms_median``, ``unprofiled_wall_ms`` and its median)."""
    settings = quick_settings() if quick else BenchSettings(modes=("recompute",))
    trace = fixed_length_trace(settings.trace, history, 2 * visits + 2, settings.new_events)
    requests = [trace.rank_request(i) for i in range(2 * visits + 2)]  # the first visits, one per user
    config = load_config(None, overrides, base=engine_config(settings, cache_config(settings, "recompute"), 1))
    with GREngine(config) as engine:
        cuda = engine.device.type == "cuda"
        reserved = torch.cuda.memory_reserved(engine.device) if cuda else 0
        t0 = time.perf_counter()
        captured = engine.warmup(use_tqdm=False)
        warmup_s = time.perf_counter() - t0
        warmup_bytes = torch.cuda.memory_reserved(engine.device) - reserved if cuda else 0
        unprofiled, wall, outputs = [], [], []
        for i, request in enumerate(requests[:visits + 2]):  # two unmeasured, then ``visits`` timed
            t0 = time.perf_counter()
            outputs += engine.rank([request], use_tqdm=False)
            if i >= 2:
                unprofiled.append((time.perf_counter() - t0) * 1e3)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        steps_before = engine.stats.num_steps
        with profile(activities=activities) as prof:
            for request in requests[visits + 2:]:
                t0 = time.perf_counter()
                with record_function(MARKER):
                    outputs += engine.rank([request], use_tqdm=False)  # its scores are on the host: no sync needed
                wall.append((time.perf_counter() - t0) * 1e3)
        graphs, backend = engine.runner.graphs is not None, engine.backend.name
        # the profiled visits' steps as the engine ran them (a visit longer than a chunk takes several)
        ran = engine.stats.num_steps - steps_before
        step_rows = [step.num_tokens for step in list(engine.stats.recent_steps)[-ran:]]
    if failed := [o.error for o in outputs if o.error]:
        raise RuntimeError(f"a cold visit failed: {failed[0]}")
    profiled = requests[visits + 2:]
    rows = len(profiled[0].item_ids) + len(profiled[0].candidate_item_ids)
    flops = step_flops(config.model, [0] * visits, [len(r.item_ids) for r in profiled],
                       [len(r.candidate_item_ids) for r in profiled])
    table = kernel_table(prof, cuda)
    device_s, wall_s = sum(r["total_us"] for r in table) / 1e6, sum(wall) / 1e3
    peak = gemm_peak_tflops(str(engine.device))
    largest = max(step_rows)
    cold = {"history": history, "step_rows": rows, "largest_step_rows": largest,
            "steps_per_visit": len(step_rows) / visits, "visit_step_rows": step_rows[:len(step_rows) // visits],
            "overrides": list(overrides), "warmup_s": warmup_s, "warmup_graphs": captured,
            "warmup_reserved_bytes": warmup_bytes,
            "cuda_graph_max_rows": config.cuda_graph_max_rows, "step_graphs": graphs,
            "eager": not graphs or largest > config.cuda_graph_max_rows, "attention_backend": backend,
            "wall_ms": wall, "wall_ms_median": float(np.median(wall)), "unprofiled_wall_ms": unprofiled,
            "unprofiled_wall_ms_median": float(np.median(unprofiled)),
            **visit_timelines(prof, cuda)}
    return {
        "mode": f"recompute, cold first visit of {history} events", "batch": 1, "batches": visits,
        "device": str(engine.device), "kernels": cuda, "wall_ms_per_batch": wall_s / visits * 1e3,
        "device_ms_per_batch": device_s / visits * 1e3, "model_tflop_per_batch": flops / visits / 1e12,
        "gemm_peak_tflops": peak, "mfu_over_wall": flops / wall_s / 1e12 / peak if peak else None,
        "mfu_over_device": flops / device_s / 1e12 / peak if peak and device_s else None,
        "groups": group_shares(table), "table": table, "cold": cold,
    }


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as disjoint sorted intervals (any time unit)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def gaps_of(span: tuple[float, float], busy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``span`` outside the disjoint sorted intervals ``busy`` (clipped to ``span``)."""
    gaps, cursor = [], span[0]
    for start, end in busy:
        if start > cursor:
            gaps.append((cursor, min(start, span[1])))
        cursor = max(cursor, end)
    if cursor < span[1]:
        gaps.append((cursor, span[1]))
    return [(a, b) for a, b in gaps if b > a]


def visit_timelines(prof: profile, cuda: bool, top: int = 25) -> dict:
    """Each profiled visit's timeline (the :data:`MARKER` ranges; times in ms): ``per_visit`` (``span_ms``, the
    profiler's wall span; ``kernel_ms``, kernel durations (CPU: operator self times) summed; ``busy_ms``, their
    union; ``gap_ms`` = span - busy, split into ``head_ms`` (before the first kernel), ``tail_ms`` (after the last)
    and between; ``gap_fraction``; ``python_ms``, no profiled host op running; ``kernels``, their count), their
    medians, ``largest_gaps`` (with the innermost host op spanning half of each), ``host_ops`` (top ``top`` by CPU
    self time, per visit), ``sync_calls`` (:data:`SYNC`) and ``kernels_outside_visits`` (profiled kernels in no
    visit's span: 0 unless the device and host clocks disagree) and ``graph_launches`` (``cudaGraphLaunch`` calls)."""
    events = prof.events()
    cpu = torch.autograd.DeviceType.CPU
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == MARKER)
    host = [e for e in events if e.device_type == cpu and e.name != MARKER]
    kernels = [e for e in events if e.device_type != cpu] if cuda else host
    per_visit, gaps, ops, syncs = [], [], {}, {}
    for v, span in enumerate(spans):
        inside = [e for e in kernels if span[0] <= e.time_range.start < span[1]]
        busy = merge([(e.time_range.start, min(e.time_range.end, span[1])) for e in inside])
        free = gaps_of(span, busy)
        host_in = [e for e in host if span[0] <= e.time_range.start < span[1]]
        length, busy_us = span[1] - span[0], sum(b - a for a, b in busy)
        head = busy[0][0] - span[0] if busy else length
        per_visit.append({
            "span_ms": length / 1e3, "kernels": len(inside), "busy_ms": busy_us / 1e3,
            "kernel_ms": sum(e.time_range.end - e.time_range.start if cuda else e.self_cpu_time_total
                             for e in inside) / 1e3,
            "gap_ms": (length - busy_us) / 1e3, "head_ms": head / 1e3,
            "tail_ms": (span[1] - busy[-1][1] if busy else 0.0) / 1e3, "gap_fraction": 1 - busy_us / length,
            "python_ms": sum(b - a for a, b in gaps_of(span, merge(
                [(e.time_range.start, min(e.time_range.end, span[1])) for e in host_in]))) / 1e3})
        for a, b in free:
            covering = [e for e in host_in if min(e.time_range.end, b) - max(e.time_range.start, a) >= (b - a) / 2]
            inner = min(covering, key=lambda e: e.time_range.end - e.time_range.start, default=None)
            gaps.append({"visit": v, "at_ms": (a - span[0]) / 1e3, "gap_ms": (b - a) / 1e3,
                         "host_op": inner.name if inner else "(Python: no profiled host op)"})
        for e in host_in:
            for table in (ops, syncs) if re.search(SYNC, e.name) else (ops,):
                entry = table.setdefault(e.name, [0, 0.0])
                entry[0], entry[1] = entry[0] + 1, entry[1] + e.self_cpu_time_total
    n = max(len(spans), 1)

    def listed(table: dict[str, list]) -> list[dict]:
        rows = [{"name": k, "calls": c, "calls_per_visit": c / n, "total_ms": us / 1e3, "ms_per_visit": us / n / 1e3}
                for k, (c, us) in table.items()]
        return sorted(rows, key=lambda r: -r["total_ms"])

    medians = {f"{k}_median": float(np.median([p[k] for p in per_visit])) if per_visit else None
               for k in ("span_ms", "kernel_ms", "busy_ms", "gap_ms", "head_ms", "tail_ms", "gap_fraction",
                         "python_ms", "kernels")}
    graph_launches = sum("GraphLaunch" in e.name for e in host if any(a <= e.time_range.start < b for a, b in spans))
    outside = sum(not any(a <= e.time_range.start < b for a, b in spans) for e in kernels)
    return {"visits": len(spans), "per_visit": per_visit, **medians, "kernels_outside_visits": outside,
            "graph_launches": graph_launches,
            "largest_gaps": sorted(gaps, key=lambda g: -g["gap_ms"])[:10], "host_ops": listed(ops)[:top],
            "sync_calls": listed(syncs)}


def group_shares(table: list[dict]) -> dict[str, float]:
    """Each group's share of the profiled time, largest first (the table's groups set again by :func:`group_of`)."""
    groups: dict[str, float] = {}
    for r in table:
        r["group"] = group_of(r["name"])
        groups[r["group"]] = groups.get(r["group"], 0.0) + r["share"]
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(result: dict) -> str:
    what = "kernel" if result["kernels"] else "operator (CPU)"
    lines = [f"# Per-{what.split()[0]} profile: {result['mode']}, batches of {result['batch']}", "",
             f"`{result['command']}` at {result['commit']}", "",
             f"- per batch: wall {result['wall_ms_per_batch']:.2f} ms, profiled {what} self time "
             f"{result['device_ms_per_batch']:.2f} ms, {result['model_tflop_per_batch']:.4g} model TFLOP",
             f"- model FLOP utilisation against the GEMM peak ({_fmt(result['gemm_peak_tflops'], '.0f')} TFLOP/s): "
             f"{_fmt(result['mfu_over_wall'], '.1%')} over wall time, {_fmt(result['mfu_over_device'], '.1%')} over "
             "device time",
             "- by group: " + ", ".join(f"{g} {s:.1%}" for g, s in result["groups"].items()), "",
             f"| {what} | group | calls | total ms | mean us | share |", "|---|---|---|---|---|---|"]
    for r in result["table"][:40]:
        name = r["name"] if len(r["name"]) <= 90 else r["name"][:87] + "..."
        lines.append(f"| `{name}` | {r['group']} | {r['calls']} | {r['total_us'] / 1e3:.3f} | {r['mean_us']:.1f} | "
                     f"{r['share']:.1%} |")
    if "cold" in result:
        lines += cold_markdown(result["cold"], "kernel" if result["kernels"] else "operator")
    return "\n".join(lines) + "\n"


def cold_markdown(cold: dict, what: str) -> list[str]:
    """The .md's "Cold first visits" section (:func:`cold_run`'s ``cold``)."""
    def short(name: str) -> str:
        return name if len(name) <= 90 else name[:87] + "..."

    lines = ["", f"## Cold first visits: {cold['history']} events, BS=1, {cold['visits']} profiled", "",
             f"- {cold['step_rows']} rows a visit, in steps of {cold['visit_step_rows']} rows, "
             f"{'eager' if cold['eager'] else 'from CUDA graphs'} "
             f"(cuda_graph_max_rows {cold['cuda_graph_max_rows']}, step graphs {cold['step_graphs']}, "
             f"{cold['graph_launches']} graph launches profiled), attention "
             f"`{cold['attention_backend']}`, overrides: {', '.join(cold['overrides']) or 'none'}",
             f"- wall per visit (median, perf counter): {cold['wall_ms_median']:.3f} ms profiled, "
             f"{cold['unprofiled_wall_ms_median']:.3f} ms unprofiled ("
             + ", ".join(f"{v:.3f}" for v in cold["unprofiled_wall_ms"]) + ")",
             f"- warm-up: {cold['warmup_s']:.1f} s, {cold['warmup_graphs']} (bucket, launch shape) forwards "
             f"captured, {cold['warmup_reserved_bytes'] / 2**20:.0f} MiB more reserved by torch's allocator",
             f"- medians per visit: span {cold['span_ms_median']:.3f} ms, {cold['kernels_median']:.0f} {what}s, "
             f"{what} time {cold['kernel_ms_median']:.3f} ms, busy {cold['busy_ms_median']:.3f} ms, host gaps "
             f"{cold['gap_ms_median']:.3f} ms ({cold['gap_fraction_median']:.1%}: before the first "
             f"{cold['head_ms_median']:.3f}, after the last {cold['tail_ms_median']:.3f}), no host op running "
             f"(Python) {cold['python_ms_median']:.3f} ms; {cold['kernels_outside_visits']} {what}s outside the "
             "visits", "",
             "| visit | span ms | kernels | kernel ms | busy ms | gap ms | gap share | head ms | tail ms | Python ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {i} | {v['span_ms']:.3f} | {v['kernels']} | {v['kernel_ms']:.3f} | {v['busy_ms']:.3f} | "
              f"{v['gap_ms']:.3f} | {v['gap_fraction']:.1%} | {v['head_ms']:.3f} | {v['tail_ms']:.3f} | "
              f"{v['python_ms']:.3f} |" for i, v in enumerate(cold["per_visit"])]
    lines += ["", "Largest host gaps (no kernel running), with the innermost host op spanning half of each:", "",
              "| visit | at ms | gap ms | host op |", "|---|---|---|---|"]
    lines += [f"| {g['visit']} | {g['at_ms']:.3f} | {g['gap_ms']:.3f} | `{short(g['host_op'])}` |"
              for g in cold["largest_gaps"]]
    for title, rows in (("Synchronising calls (a sync on the hot path is a bug; one per visit reads the scores)",
                         cold["sync_calls"]), ("Top host ops by CPU self time", cold["host_ops"])):
        lines += ["", f"{title}:", "", "| host op | calls per visit | ms per visit | total ms |", "|---|---|---|---|"]
        lines += [f"| `{short(r['name'])}` | {r['calls_per_visit']:.1f} | {r['ms_per_visit']:.3f} | "
                  f"{r['total_ms']:.3f} |" for r in rows] or ["| none | | | |"]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--report-only", metavar="JSON", help="run nothing: regroup a saved kernel_profile.json "
                        "(the groups as defined now) and rewrite it and its .md")
    parser.add_argument("--mode", default="recompute", choices=["recompute", "gpu_only", "hierarchical", "unlimited"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the bench's CPU-sized run (seconds)")
    parser.add_argument("--commit", default=None, help="commit id to record (the device copy has no .git)")
    parser.add_argument("--cold-history", type=int, metavar="N", help="profile --batches cold first visits of "
                        "N-event users instead (BS=1, recompute; as the bench's cold_N_ms)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="with --cold-history: override an engine config value, e.g. cuda_graph_max_rows=16384 "
                        "(repeatable)")
    args = parser.parse_args(argv)
    if args.cold_history is not None and (args.cold_history < 1 or args.batches < 1):
        parser.error("--cold-history and --batches must be positive")
    if args.overrides and not args.cold_history:
        parser.error("--set needs --cold-history (the closed-loop batches use the bench's own engine config)")
    if args.report_only:
        path = Path(args.report_only)
        result = json.loads(path.read_text())
        result["groups"] = group_shares(result["table"])
        path.write_text(json.dumps(result, indent=2))
        path.with_suffix(".md").write_text(markdown(result))
        return
    if not args.out:
        parser.error("--out is required")
    if args.cold_history:
        result = cold_run(args.cold_history, args.batches, args.quick, args.overrides)
    else:
        result = run(args.mode, args.batch, args.batches, args.quick)
    result["commit"] = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                     text=True).stdout.strip() or "unknown"
    result["command"] = "python benchmarks/kernel_profile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result["gpu"] = torch.cuda.get_device_name() if result["kernels"] else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_profile.json").write_text(json.dumps(result, indent=2))
    (out / "kernel_profile.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
