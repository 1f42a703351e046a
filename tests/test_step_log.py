"""The engine core's step log (``serving.step_log``) and its summary, and the load generator's two latencies."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import numpy as np
import pytest

from gr_engine.metrics import StepMetrics
from gr_engine.request import RankRequest
from gr_engine.serving.load import open_loop
from gr_engine.serving.step_log import StepLog, StepRecord, read_step_log, summarize


def metrics(requests: int, tokens: int, onloaded: int) -> StepMetrics:
    return StepMetrics(num_requests=requests, num_tokens=tokens, history_tokens=10 * requests, gpu_hit_tokens=5,
                       host_hit_tokens=3, onloaded_bytes=onloaded, offloaded_bytes=0,
                       phases={"forward": 0.002, "schedule": 0.001})


def test_log_round_trip_idle_time_and_collections(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "steps.jsonl")
    log.header(frozen_objects=12, full_collection_s=0.5)
    log.step(100.0, 0.010, metrics(4, 400, 2_000_000), waiting=3)
    gc.collect()  # timed into the next record
    log.step(100.030, 0.005, None, waiting=0)
    log.close()
    (tmp_path / "steps.jsonl").open("ab").write(b'{"type":"step","start":')  # a line cut short is skipped
    header, steps = read_step_log(tmp_path / "steps.jsonl")
    assert header.frozen_objects == 12 and header.full_collection_s == 0.5
    assert len(steps) == 2
    first, second = steps
    assert (first.requests, first.tokens, first.onloaded_bytes, first.waiting) == (4, 400, 2_000_000, 3)
    assert first.idle_s == 0.0 and first.phases == {"forward": 0.002, "schedule": 0.001}
    assert second.idle_s == pytest.approx(0.020)  # from the first one's end (100.010) to 100.030
    assert second.requests == 0 and second.phases == {}  # a step that ran no model
    assert second.gc_s > 0 and first.gc_s < second.gc_s
    assert log._on_gc not in gc.callbacks


def record(start: float, seconds: float, requests: int, tokens: int, onloaded: int, waiting: int) -> StepRecord:
    return StepRecord(start=start, seconds=seconds, idle_s=0.001, gc_s=0.0, requests=requests,
                      tokens=tokens, history_tokens=0, gpu_hit_tokens=0, host_hit_tokens=0, onloaded_bytes=onloaded,
                      waiting=waiting, phases={"forward": seconds / 2}, device_s=seconds * 3, overlapped=start % 3 == 0)


def test_summary_of_a_window() -> None:
    steps = [record(float(t), 0.002 * (t + 1), t % 8 + 1, 100 * t, 1_000_000 * t, t) for t in range(20)]
    s = summarize(steps, 5.0, 14.0, longest=3)
    inside = steps[5:15]
    assert s["steps"] == 10
    assert s["busy_fraction"] == pytest.approx(sum(r.seconds for r in inside) / 9.0)
    assert s["device_busy_fraction"] == pytest.approx(3 * s["busy_fraction"])
    assert s["device_ms"]["max"] == pytest.approx(90.0)
    assert s["overlapped_fraction"] == pytest.approx(0.3)  # starts 6, 9 and 12
    assert s["step_ms"]["max"] == pytest.approx(30.0) and s["step_ms"]["p50"] == pytest.approx(
        np.median([r.seconds * 1e3 for r in inside]))
    assert s["tokens"]["max"] == 1400 and s["onloaded_MB"]["max"] == pytest.approx(14.0)
    assert s["requests"]["mean"] == pytest.approx(np.mean([r.requests for r in inside]))
    assert s["waiting"]["max"] == 14
    assert s["phase_ms_mean"]["forward"] == pytest.approx(np.mean([r.seconds for r in inside]) * 1e3 / 2)
    assert [r["start"] for r in s["longest"]] == [14.0, 13.0, 12.0]
    assert summarize(steps, 50.0, 60.0) == {"steps": 0}


def test_latency_runs_from_the_users_previous_answer() -> None:
    """Two visits of one user due at once: the second is sent when the first is answered; its latency is one round
    trip from then, and two from its schedule."""
    delay = 0.05

    async def send(batch: list[RankRequest]) -> list[str | None]:
        await asyncio.sleep(delay)
        return [None] * len(batch)

    requests = [RankRequest(request_id=f"r{i}", user_id=u, item_ids=[1], action_ids=[0], timestamps=[1],
                            candidate_item_ids=[2]) for i, u in enumerate([7, 7, 8])]
    result = asyncio.run(open_loop(send, requests, np.array([0.0, 0.0, 0.0]), time.monotonic() + 0.01))
    latency, scheduled = result["latency_ms"], result["schedule_latency_ms"]
    assert result["user_waits"] == 1
    order = np.argsort(scheduled)  # answers are recorded as they come: user 8's and the first of user 7's first
    assert scheduled[order[-1]] >= 2 * delay * 1e3 * 0.95
    assert all(lat < 1.6 * delay * 1e3 for lat in latency)  # each one round trip from when it could be sent
    assert all(lat >= delay * 1e3 * 0.95 for lat in latency)
