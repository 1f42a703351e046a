"""The report of ``gr-engine bench-serve`` (:mod:`.load`): per-rate statistics, the cache per phase (the change of
the engine core's counters: :func:`cache_stats`), the summary, ``bench_serve.json``, ``bench_serve.md`` and
``bench_serve.png``.

Units: latencies and lags in ms, rates and throughputs in requests/s, CPU and spans in s, copy rates in GB/s.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

P99_TARGET_MS = 25.0


def percentiles(values: Sequence[float], suffix: str = "_ms") -> dict[str, float | None]:
    """p50, p90, p99, mean and max of ``values`` (keys suffixed by ``suffix``); ``None`` each for no values."""
    v = np.asarray(values, dtype=np.float64)
    if not len(v):
        return {f"{k}{suffix}": None for k in ("p50", "p90", "p99", "mean", "max")}
    return {f"p50{suffix}": float(np.percentile(v, 50)), f"p90{suffix}": float(np.percentile(v, 90)),
            f"p99{suffix}": float(np.percentile(v, 99)), f"mean{suffix}": float(v.mean()),
            f"max{suffix}": float(v.max())}


def phase_stats(parts: list[dict]) -> dict:
    """One phase over its generator processes' ``parts`` (:meth:`~.load.Recorder.result`): requests sent and
    answered (without error), achieved throughput (answered / the span from the first scheduled send to the last
    answer, requests/s), latency percentiles of answered requests (ms; from when each could be sent, and p50, p99 and
    max ``*_from_schedule_ms`` from its scheduled time), errors by kind, and each generator's CPU seconds and lag
    (ms)."""
    latency = [lat for p in parts for lat, o in zip(p["latency_ms"], p["outcomes"], strict=True) if o is None]
    scheduled = [lat for p in parts for lat, o in zip(p["schedule_latency_ms"], p["outcomes"], strict=True)
                 if o is None]
    from_schedule = {f"{k}_from_schedule_ms": v for k, v in percentiles(scheduled, "").items()
                     if k in ("p50", "p99", "max")}
    errors = Counter(o for p in parts for o in p["outcomes"] if o is not None)
    sent = sum(len(p["outcomes"]) for p in parts)
    busy = [p for p in parts if p["outcomes"]]
    span = max(p["last_s"] for p in busy) - min(p["first_s"] for p in busy) if busy else 0.0
    return {"sent": sent, "answered": len(latency), "span_s": span,
            "user_waits": sum(p.get("user_waits", 0) for p in parts),
            "achieved_rps": len(latency) / span if span > 0 else None, **percentiles(latency), **from_schedule,
            "errors": dict(sorted(errors.items())),
            "generators": [{"sent": len(p["outcomes"]), "cpu_s": p["cpu_s"],
                            **{k.replace("_ms", "_lag_ms"): v for k, v in percentiles(p["lag_ms"]).items()
                               if k.startswith(("p99", "max"))}} for p in parts]}


def cache_stats(change: dict[str, int] | None) -> dict | None:
    """The cache's side of one phase from the change of the core's counters over it (:data:`~.load.PHASE_COUNTERS`;
    ``None`` without them): the counters themselves, plus history tokens, computed history tokens (history less its
    GPU and host hits: what was recomputed) a request the engine finished, and the shares of history reused from
    GPU pages and loaded from host. Runs in process and over HTTP reached the same cache state when these agree."""
    if not change:
        return None
    done, history = change["finished_requests"], change["history_tokens"]
    computed = history - change["gpu_hit_tokens"] - change["host_hit_tokens"]
    return {**change, "computed_history_tokens": computed,
            "history_tokens_per_request": history / done if done else None,
            "computed_history_tokens_per_request": computed / done if done else None,
            "gpu_hit_share": change["gpu_hit_tokens"] / history if history else None,
            "host_hit_share": change["host_hit_tokens"] / history if history else None}


def _phase(entry: dict) -> dict:
    """:func:`phase_stats` of a phase's entry, with its ``cache`` (:func:`cache_stats`) and core profile, if any."""
    return {**phase_stats(entry["parts"]), "cache": cache_stats(entry.get("counters")),
            **({"core": entry["core"]} if "core" in entry else {})}


def build_result(phases: dict, peak_GBps: float | None) -> dict:
    """Per-phase statistics and the summary of a run's ``phases`` (:func:`~.load.run_http` or
    :func:`~.load.run_in_process`)."""
    warmup, closed = _phase(phases["warmup"]), _phase(phases["closed"])
    rates = []
    for entry in phases["rates"]:
        stats = _phase(entry)
        per_request = entry["onloaded_bytes"] / stats["answered"] if stats["answered"] else None
        rates.append({"offered_rps": entry["rate"], **stats, "onloaded_bytes": entry["onloaded_bytes"],
                      "onloaded_bytes_per_request": per_request})
    def best(key: str) -> float | None:
        within = [r["achieved_rps"] for r in rates
                  if r[key] is not None and r[key] <= P99_TARGET_MS and r["achieved_rps"] is not None]
        return max(within) if within else None

    answered = sum(r["answered"] for r in rates)
    per_request = sum(r["onloaded_bytes"] for r in rates) / answered if answered else None
    pcie = peak_GBps * 1e9 / per_request if peak_GBps and per_request else None
    device_s = sum(r.get("core", {}).get("device_s", 0.0) for r in rates)
    summary = {"rps_at_p99_25ms": best("p99_ms"), "rps_at_p99_25ms_from_schedule": best("p99_from_schedule_ms"),
               "closed_loop_rps": closed["achieved_rps"],
               "pcie_bound_rps": pcie, "peak_h2d_GBps": peak_GBps, "onloaded_bytes_per_request": per_request,
               # requests answered per second of the steps' device time (CUDA, with a step log): what the device
               # alone would allow at the rates' step sizes
               "device_bound_rps": answered / device_s if device_s > 0 else None,
               "trace_exhausted": phases["exhausted"],
               # the core's compilations and captures in closed loop and rates; its heap after warm-up (step log)
               "stalls_after_warmup": phases.get("stalls"), "core_heap": phases.get("heap"),
               # the core's counters (load.COUNTERS) at the run's start and end: each phase's cache counters are
               # the change over it, so they add up to end - start
               "core_counters": phases.get("core_counters")}
    return {"warmup": warmup, "closed_loop": closed, "rates": rates, "summary": summary}


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(result: dict) -> str:
    """``bench_serve.md``: the summary and one table row per offered rate."""
    s, how = result["summary"], "in process (AsyncGREngine)" if result["settings"]["in_process"] else "over HTTP"
    lines = [f"# gr-engine bench-serve ({how})", "", f"`{result['command']}`", "",
             f"- highest throughput with p99 <= {P99_TARGET_MS:g} ms: {_num(s['rps_at_p99_25ms'], 1)} requests/s",
             f"- closed loop (batches of 8 / 8 clients): {_num(s['closed_loop_rps'], 1)} requests/s",
             f"- PCIe bound: {_num(s['pcie_bound_rps'], 1)} requests/s ({_num(s['onloaded_bytes_per_request'], 0)} "
             f"onloaded bytes per request at {_num(s['peak_h2d_GBps'])} GB/s)",
             f"- device bound: {_num(s.get('device_bound_rps'), 1)} requests/s (requests answered per second of the "
             "steps' device time over all rates)",
             f"- kernel compilations and graph captures in the engine core after warm-up (closed loop and rates): "
             f"{'-' if s.get('stalls_after_warmup') is None else s['stalls_after_warmup']}",
             f"- warm-up: {result['warmup']['answered']} visits (first visits, then the cold start) at "
             f"{_num(result['warmup']['achieved_rps'], 1)} requests/s (closed loop; not a capacity figure); "
             f"{_cache_brief(result['warmup'].get('cache'))}", ""]
    if s["trace_exhausted"]:
        lines += ["**The trace ran out: the last rates served fewer requests than their duration asked.**", ""]
    header = ["offered (req/s)", "achieved (req/s)", "sent", "answered", "p50 ms", "p90 ms", "p99 ms", "mean ms",
              "max ms", "p99 from schedule ms", "errors", "waited on user", "onloaded MB a request",
              "computed history tokens a request", "GPU evictions / host evictions / lost tokens",
              "generator CPU s", "lag p99 ms"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in result["rates"]:
        errors = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "none"
        cpu = "/".join(f"{g['cpu_s']:.2f}" for g in r["generators"])
        lag = "/".join(_num(g["p99_lag_ms"]) for g in r["generators"])
        lines.append("| " + " | ".join([f"{r['offered_rps']:g}", _num(r["achieved_rps"], 1), str(r["sent"]),
                                        str(r["answered"]), *(_num(r[k]) for k in ("p50_ms", "p90_ms", "p99_ms",
                                                                                    "mean_ms", "max_ms",
                                                                                    "p99_from_schedule_ms")),
                                        errors, str(r["user_waits"]), _mb(r.get("onloaded_bytes_per_request")),
                                        *_cache_cells(r.get("cache")), cpu, lag]) + " |")
    lines += ["", "Latency runs from the time each request could be sent (open loop): its scheduled time, or its "
              "user's previous answer if that came later (a user's visits stay in order; \"waited on user\" counts "
              "those requests). \"p99 from schedule\" counts that wait too. Generator CPU seconds and lag (how late "
              "requests were fired against their schedule) are per generator process: a lag near the latency means "
              "the generator, not the server, is the bottleneck. Computed history tokens a request: history the "
              "engine recomputed (not reused from GPU pages or loaded from host) per request it finished; GPU "
              "evictions: users whose GPU pages were reclaimed; host evictions: users whose host copy was dropped "
              "for room; lost tokens: tokens of users leaving the GPU that could not be kept on host (the engine "
              "core's counters over the rate)."]
    lines += cache_markdown(result)
    lines += profile_markdown(result)
    return "\n".join(lines) + "\n"


def _cache_cells(cache: dict | None) -> list[str]:
    """The rate table's cells of a phase's :func:`cache_stats`: computed history tokens a request, and GPU evictions
    / host evictions / lost tokens."""
    if cache is None:
        return ["-", "-"]
    return [_num(cache["computed_history_tokens_per_request"], 1),
            f"{cache['evicted_users']}/{cache['host_evicted_users']}/{cache['lost_tokens']}"]


def _cache_brief(cache: dict | None) -> str:
    """One line on a phase's cache (:func:`cache_stats`)."""
    if cache is None:
        return "the core's cache counters were not read"
    return (f"{_num(cache['computed_history_tokens_per_request'], 1)} computed history tokens a request, "
            f"{cache['evicted_users']} GPU evictions, {cache['host_evicted_users']} host evictions, "
            f"{cache['lost_tokens']} lost tokens")


def cache_markdown(result: dict) -> list[str]:
    """The cache per phase (warm-up, closed loop, each rate): the engine core's counters over it."""
    rows = [("warm-up", result["warmup"]), ("closed loop", result["closed_loop"]),
            *((f"{r['offered_rps']:g} req/s", r) for r in result["rates"])]
    rows = [(name, phase["cache"]) for name, phase in rows if phase.get("cache")]
    if not rows:
        return []
    header = ["phase", "requests finished", "history tokens a request", "computed history tokens a request",
              "GPU hits", "host hits", "GPU evictions (users / tokens)", "host evictions (users)", "lost tokens",
              "tails persisted (tokens)", "deferred offloads", "truncated tokens", "unfinished copies (tokens)"]
    lines = ["", "## The cache per phase (the engine core's counters)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    for name, c in rows:
        lines.append("| " + " | ".join([
            name, str(c["finished_requests"]), _num(c["history_tokens_per_request"], 1),
            _num(c["computed_history_tokens_per_request"], 1), share(c["gpu_hit_share"]), share(c["host_hit_share"]),
            f"{c['evicted_users']} / {c['evicted_tokens']}", str(c["host_evicted_users"]), str(c["lost_tokens"]),
            str(c["tail_persisted_tokens"]), str(c["deferred_offloads"]), str(c["truncated_tokens"]),
            str(c.get("unfinished_copy_tokens", "-"))]) + " |")
    lines += ["", "Two runs of the same trace (e.g. in process and over HTTP) reached the same cache state when "
              "these agree phase by phase; the totals since the core started are `summary.core_counters` in "
              "`bench_serve.json`."]
    return lines


def _mb(nbytes: float | None) -> str:
    """Bytes as MB with one decimal, ``-`` for ``None``."""
    return "-" if nbytes is None else f"{nbytes / 1e6:.1f}"


def profile_markdown(result: dict) -> list[str]:
    """The core's profile per rate (from its step log), when the run had one."""
    rows = [r for r in result["rates"] if r.get("core", {}).get("steps")]
    if not rows:
        return []
    heap = result["summary"].get("core_heap") or {}
    lines = ["", "## The engine core per rate (its step log)", ""]
    if heap:
        lines += [f"After warm-up the core froze {heap['frozen_objects']} objects out of garbage collection (a full "
                  f"collection over them took {heap['full_collection_s'] * 1e3:.1f} ms).", ""]
    header = ["offered (req/s)", "steps", "busy", "device busy", "launched ahead", "step ms p50/p99/max",
              "device ms p50/p99/max", "idle ms p99", "requests per step",
              "tokens per step p50/p99/max", "onloaded MB per step p50/p99/max", "queued p99/max", "GC s (max ms)",
              "mean ms per step by phase"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def spread(d: dict, keys: tuple[str, ...] = ("p50", "p99", "max"), digits: int = 1) -> str:
        return "/".join(_num(d[k], digits) for k in keys)

    for r in rows:
        c = r["core"]
        phases = ", ".join(f"{k} {v:.2f}" for k, v in c["phase_ms_mean"].items() if v >= 0.005)
        lines.append("| " + " | ".join([f"{r['offered_rps']:g}", str(c["steps"]), f"{c['busy_fraction']:.0%}",
                                        f"{c.get('device_busy_fraction', 0.0):.0%}",
                                        f"{c.get('overlapped_fraction', 0.0):.0%}", spread(c["step_ms"], digits=2),
                                        spread(c["device_ms"], digits=2) if "device_ms" in c else "-",
                                        _num(c["idle_ms"]["p99"]),
                                        _num(c["requests"]["mean"]), spread(c["tokens"], digits=0),
                                        spread(c["onloaded_MB"]), spread(c["waiting"], ("p99", "max"), 0),
                                        f"{c['gc_s']:.3f} ({c['gc_max_ms']:.1f})", phases]) + " |")
    lines += ["", "Busy: the share of the rate's span the core's host spent in steps (launching them and waiting "
              "for their results); device busy: the share the device spent in the steps' forwards (onload waits "
              "included; 0 on CPU); launched ahead: steps launched while the one before was still on the device "
              "(async scheduling); idle: time between a step's end and the next one's start (receiving, reporting, "
              "waiting for work). The longest steps are in `bench_serve.json` (`rates[].core.longest`)."]
    return lines


def plot(result: dict, path: Path) -> bool:
    """Latency p50 and p99 (ms) against achieved throughput (requests/s); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result["rates"] if r["achieved_rps"] is not None and r["p50_ms"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in ("p50_ms", "p99_ms"):
        ax.plot([r["achieved_rps"] for r in rows], [r[key] for r in rows], marker="o", label=key[:3])
    ax.axhline(P99_TARGET_MS, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="achieved throughput (requests/s)", ylabel="latency (ms)", yscale="log",
           title="bench-serve: latency against throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(result: dict, out: Path) -> list[Path]:
    """Write ``bench_serve.json``, ``bench_serve.md`` and (with matplotlib; else a warning) ``bench_serve.png``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench_serve.json", out / "bench_serve.md"]
    paths[0].write_text(json.dumps(result, indent=2, default=str))
    paths[1].write_text(markdown(result))
    if plot(result, out / "bench_serve.png"):
        paths.append(out / "bench_serve.png")
    else:
        print('warning: matplotlib is not installed, so no plot (bench_serve.png) was written; pip install '
              '".[bench]" to get it', file=sys.stderr)
    return paths
