"""The engine core's step log (``serving.step_log``): one JSON line per engine step, the profile of the core under
load, and its summary over a time window (``gr-engine bench-serve``'s per-rate profile; docs/serving.md).

Times are ``time.monotonic()`` seconds (one clock for every process of a machine, so a load generator's phase
bounds select the core's steps) and durations are seconds; sizes are tokens and bytes.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import msgspec
import numpy as np

from ..metrics import StepMetrics
from .load_report import percentiles


class StepLogHeader(msgspec.Struct, kw_only=True, tag="header"):
    """The log's first line, written once warm-up is done.

    Attributes:
        frozen_objects: objects the core moved out of the garbage collector's reach after warm-up (``gc.freeze``).
        full_collection_s: what one full collection over them took just before (the pause a generation-2
            collection would cost every time it ran, had they not been frozen).
    """

    frozen_objects: int
    full_collection_s: float


class StepRecord(msgspec.Struct, kw_only=True, tag="step"):
    """One engine step as the core saw it.

    Attributes:
        start: when the step began (monotonic s).
        seconds: the host's time in it: its launch and the wait for its results (with async scheduling the next
            step's launch runs between the two, and is not counted here).
        idle_s: time from the previous step's end to this one's start (receiving, reporting, waiting for work).
        gc_s: time in garbage collection since the previous record.
        requests, tokens: requests in the step and tokens it computed (uncached history plus candidates).
        history_tokens, gpu_hit_tokens, host_hit_tokens: history of the requests admitted in it and how much of it
            was served from GPU pages and from host chunks.
        onloaded_bytes: host -> GPU bytes the step copied.
        waiting: requests queued (not yet admitted) after the step.
        phases: seconds per engine phase (``gr_engine.metrics.PHASES``).
        device_s: the step's device time (``gr_engine.metrics.StepMetrics.device_s``; 0 on CPU).
        overlapped: it was launched before the step ahead of it had finished (``serving.async_scheduling``).
    """

    start: float
    seconds: float
    idle_s: float
    gc_s: float
    requests: int
    tokens: int
    history_tokens: int
    gpu_hit_tokens: int
    host_hit_tokens: int
    onloaded_bytes: int
    waiting: int
    phases: dict[str, float]
    device_s: float = 0.0
    overlapped: bool = False


_LINE = msgspec.json.Decoder(StepLogHeader | StepRecord)


class StepLog:
    """Writes the step log to ``path`` (truncated), one unbuffered line per record (readable while the core runs),
    and times the process's garbage collections while it is open."""

    def __init__(self, path: str | Path) -> None:
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - open until close()
        self._encoder = msgspec.json.Encoder()
        self._gc_s, self._gc_start, self._last_end = 0.0, 0.0, None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_start

    def header(self, frozen_objects: int, full_collection_s: float) -> None:
        """Write the log's first line: objects frozen out of garbage collection at warm-up's end and the seconds a
        full collection took then."""
        self._write(StepLogHeader(frozen_objects=frozen_objects, full_collection_s=full_collection_s))

    def step(self, start: float, seconds: float, metrics: StepMetrics | None, waiting: int,
             overlapped: bool = False) -> None:
        """Log a step that began at ``start`` (monotonic s) and took ``seconds`` of the host's time (its launch and
        the wait for its results); ``metrics``: the engine's record of it (``None``: the step ran no model, e.g.
        every admitted request failed); ``overlapped``: see :class:`StepRecord`."""
        idle = 0.0 if self._last_end is None else max(start - self._last_end, 0.0)
        self._last_end = start + seconds
        m = metrics
        self._write(StepRecord(
            start=start, seconds=seconds, idle_s=idle, gc_s=self._gc_s,
            requests=m.num_requests if m else 0, tokens=m.num_tokens if m else 0,
            history_tokens=m.history_tokens if m else 0, gpu_hit_tokens=m.gpu_hit_tokens if m else 0,
            host_hit_tokens=m.host_hit_tokens if m else 0, onloaded_bytes=m.onloaded_bytes if m else 0,
            waiting=waiting, phases=dict(m.phases) if m else {}, device_s=(m.device_s or 0.0) if m else 0.0,
            overlapped=overlapped))
        self._gc_s = 0.0

    def _write(self, record: StepLogHeader | StepRecord) -> None:
        self._file.write(self._encoder.encode(record) + b"\n")

    def close(self) -> None:
        """Stop timing garbage collections and close the file."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._file.close()


def read_step_log(path: str | Path) -> tuple[StepLogHeader | None, list[StepRecord]]:
    """The header (``None`` before warm-up ends) and the step records of a log (a partly written last line is
    skipped)."""
    header, steps = None, []
    for line in Path(path).read_bytes().splitlines():
        try:
            record = _LINE.decode(line)
        except msgspec.DecodeError:
            continue
        if isinstance(record, StepLogHeader):
            header = record
        else:
            steps.append(record)
    return header, steps


def summarize(steps: list[StepRecord], start: float, end: float, longest: int = 5) -> dict:
    """The steps that began in ``[start, end]`` (monotonic s): how busy the core and the device were (step seconds
    and device seconds over the span), the spread (p50, p90, p99, mean, max) of step, device and idle time (ms),
    requests, computed tokens and onloaded MB per step and queued requests; mean ms per step of each phase;
    garbage-collection seconds; the fraction of steps launched while the one ahead was unfinished; and the
    ``longest`` steps whole."""
    window = [s for s in steps if start <= s.start <= end]
    if not window:
        return {"steps": 0}
    column = {name: np.array([getattr(s, name) for s in window], dtype=np.float64)
              for name in ("seconds", "idle_s", "gc_s", "requests", "tokens", "onloaded_bytes",
                           "waiting", "device_s", "overlapped")}
    phases = sorted({name for s in window for name in s.phases})
    span = max(end - start, 1e-9)
    return {
        "steps": len(window), "busy_fraction": float(column["seconds"].sum() / span),
        "device_busy_fraction": float(column["device_s"].sum() / span), "device_s": float(column["device_s"].sum()),
        "device_ms": percentiles(column["device_s"] * 1e3, ""),
        "overlapped_fraction": float(column["overlapped"].mean()),
        "step_ms": percentiles(column["seconds"] * 1e3, ""), "idle_ms": percentiles(column["idle_s"] * 1e3, ""),
        "requests": percentiles(column["requests"], ""), "tokens": percentiles(column["tokens"], ""),
        "onloaded_MB": percentiles(column["onloaded_bytes"] * 1e-6, ""), "waiting": percentiles(column["waiting"], ""),
        "phase_ms_mean": {name: float(np.mean([s.phases.get(name, 0.0) for s in window]) * 1e3) for name in phases},
        "gc_s": float(column["gc_s"].sum()), "gc_max_ms": float(column["gc_s"].max() * 1e3),
        "longest": [msgspec.to_builtins(s) for s in sorted(window, key=lambda s: -s.seconds)[:longest]],
    }
