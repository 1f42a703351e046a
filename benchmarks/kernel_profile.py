"""Where one benchmark batch's device time goes: a per-kernel profile (``torch.profiler``) of the bench's engine.

    python benchmarks/kernel_profile.py --out DIR [--mode recompute] [--batch 8] [--batches 3] [--commit C]
    python benchmarks/kernel_profile.py --out DIR --quick          # the bench's CPU-sized run: operators, not kernels
    python benchmarks/kernel_profile.py --report-only DIR/kernel_profile.json  # regroup a saved run, rewrite its .md

Builds ``gr-engine bench``'s engine for ``--mode`` (its model, trace, cache and GPU budget), serves the trace's first
visits (cached modes) and moves to the middle of the steady requests, serves two unprofiled batches, then profiles
``--batches`` closed-loop batches of ``--batch`` requests. Reports every kernel (on CPU: every operator) by its self
time on the device, with its calls and its share of the profiled time, grouped into GEMM, attention, norm,
elementwise, copy and other; the batches' wall time, model FLOPs (``gr_engine.bench.flops``) and the model FLOP
utilisation against the bf16 GEMM peak measured in the same process. Writes ``DIR/kernel_profile.json`` and
``DIR/kernel_profile.md``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gr_engine.bench.flops import gemm_peak_tflops, step_flops
from gr_engine.bench.runner import BenchRun, BenchSettings, cache_config, quick_settings, unlimited_pages
from gr_engine.bench.trace import generate_trace

#: Kernel (or operator) name patterns of each group, tried in order; a name matching none is "other".
GROUPS = (
    ("attention", r"hstu|attn|attention|flash|fmha"),
    ("gemm", r"gemm|cutlass|cublas|nvjet|sm\d+_xmma|matmul|addmm|::b?mm\b|linear"),
    ("norm", r"layer_?norm|LayerNorm"),
    ("copy", r"memcpy|memset|copy|cat|index|gather|scatter|embedding|append"),
    ("elementwise", r"elementwise|vectorized|silu|mul|add|where|fill|reduce|sum"),
)


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
        if us <= 0 or (cuda and event.device_type != torch.autograd.DeviceType.CUDA):
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
    return "\n".join(lines) + "\n"


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
    args = parser.parse_args(argv)
    if args.report_only:
        path = Path(args.report_only)
        result = json.loads(path.read_text())
        result["groups"] = group_shares(result["table"])
        path.write_text(json.dumps(result, indent=2))
        path.with_suffix(".md").write_text(markdown(result))
        return
    if not args.out:
        parser.error("--out is required")
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
