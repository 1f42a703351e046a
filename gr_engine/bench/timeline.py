"""Per-batch device timelines from a profiler trace (a diagnostic for ``hier_over_bound_bs8``).

A hierarchical batch should take about the larger of its forward and its onload, both starting soon after the
batch arrives; the benchmark measures it taking about the forward *plus* the onload at ~40 GB/s. A Chrome trace of
``torch.profiler`` (host annotations and CUDA kernels with their streams and times) says where the time goes:
:func:`batch_timelines` cuts it into batches at the host annotations named ``batch`` and reports, for each, when
the offload, onload and forward kernels ran relative to the batch's arrival, how busy each kind kept the GPU and
how long onloads and the forward ran at the same time. ``benchmarks/batch_timeline.py`` records the trace.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

ONLOAD_KERNEL = "_onload_pages_kernel"
OFFLOAD_KERNEL = "_pack_chunks_kernel"
Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The sorted, disjoint union of ``(start, end)`` intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def length(intervals: Sequence[Interval]) -> float:
    """Total length of disjoint intervals."""
    return sum(end - start for start, end in intervals)


def intersection(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Total length where two disjoint, sorted interval lists overlap."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kind(event: dict) -> str | None:
    """``"onload"``, ``"offload"``, ``"forward"`` (any other kernel) or ``"copy"`` (a memory copy or set) for a
    device event of a Chrome trace, ``None`` for a host event."""
    category = event.get("cat", "")
    if category == "kernel":
        name = event.get("name", "")
        return "onload" if ONLOAD_KERNEL in name else "offload" if OFFLOAD_KERNEL in name else "forward"
    if category in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    return None


def batch_timelines(trace: dict, onloaded_bytes: Sequence[int] | None = None) -> list[dict]:
    """Per batch of ``trace`` (a Chrome trace as ``torch.profiler`` exports it: ``traceEvents`` with ``ph`` "X",
    ``ts`` and ``dur`` in microseconds), each device event assigned to the last batch annotation started before it.
    Times in milliseconds from the batch's start on the host:

    - ``host_ms``: the annotation's length (the batch's latency, as the caller saw it);
    - ``first_onload_ms`` / ``onload_end_ms``: the first onload kernel's start, the last one's end;
    - ``offload_before_onload_ms``: offload kernels' busy time before the first onload kernel (onloads into pages
      an eviction just freed wait for it);
    - ``onload_busy_ms``, ``forward_busy_ms``, ``copy_busy_ms``: time with at least one such event running;
    - ``forward_start_ms`` / ``forward_end_ms``: the first and last forward kernel;
    - ``overlap_ms``: time with onload and forward kernels running together;
    - ``onload_GBps`` (with ``onloaded_bytes``, one entry per batch): the bytes over the onload's span.
    """
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    batches = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                     if e.get("cat") == "user_annotation" and e.get("name") == "batch")
    starts = [start for start, _ in batches]
    spans: list[dict[str, list[Interval]]] = [{"onload": [], "offload": [], "forward": [], "copy": []}
                                              for _ in batches]
    for event in events:
        which = kind(event)
        start = float(event["ts"])
        index = bisect.bisect_right(starts, start) - 1  # the last batch started at or before the event
        if which is not None and index >= 0:
            spans[index][which].append((start, start + float(event["dur"])))
    out = []
    for index, ((begin, end), span) in enumerate(zip(batches, spans, strict=True)):
        merged = {name: union(intervals) for name, intervals in span.items()}
        onload, forward = merged["onload"], merged["forward"]
        first_onload = onload[0][0] if onload else None
        before = [(s, min(e, first_onload)) for s, e in merged["offload"]
                  if first_onload is not None and s < first_onload]

        def ms(t: float | None, begin: float = begin) -> float | None:
            return None if t is None else (t - begin) / 1e3

        row = {"host_ms": (end - begin) / 1e3, "first_onload_ms": ms(first_onload),
               "onload_end_ms": ms(onload[-1][1] if onload else None),
               "offload_before_onload_ms": length(before) / 1e3,
               "onload_busy_ms": length(onload) / 1e3, "forward_busy_ms": length(forward) / 1e3,
               "copy_busy_ms": length(merged["copy"]) / 1e3,
               "forward_start_ms": ms(forward[0][0] if forward else None),
               "forward_end_ms": ms(forward[-1][1] if forward else None),
               "overlap_ms": intersection(onload, forward) / 1e3}
        if onloaded_bytes is not None:
            row["onloaded_bytes"] = int(onloaded_bytes[index])
            seconds = (onload[-1][1] - onload[0][0]) / 1e6 if onload else 0.0
            row["onload_GBps"] = onloaded_bytes[index] / seconds / 1e9 if seconds > 0 else None
        out.append(row)
    return out

