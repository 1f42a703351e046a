"""``gr-engine bench-serve`` on CPU with the bench's tiny trace and model (``--quick``): in process, and against a
``gr-engine serve`` subprocess on 127.0.0.1 with two generator processes; served scores against offline
``recompute`` through the load's own request construction."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from gr_engine import EngineConfig, GREngine
from gr_engine.cli import main

from .test_serving import Server

httpx = pytest.importorskip("httpx")
pytest.importorskip("zmq")
pytest.importorskip("uvicorn")

RATES = "15,30"
#: Every request of a run must be answered (check_result): a CI core's steps of the quick model take tens of ms, so
#: the default queue-wait bound (serving.max_queue_ms) would refuse some at these rates.
NO_QUEUE_BOUND = "serving.max_queue_ms=0"


def check_result(out: Path, in_process: bool) -> dict:
    result = json.loads((out / "bench_serve.json").read_text())
    assert result["settings"]["in_process"] is in_process
    assert [r["offered_rps"] for r in result["rates"]] == [15.0, 30.0]
    for phase in [result["warmup"], result["closed_loop"], *result["rates"]]:
        assert phase["sent"] > 0 and phase["answered"] == phase["sent"], phase
        assert phase["errors"] == {}
        assert 0 < phase["p50_ms"] <= phase["p90_ms"] <= phase["p99_ms"] <= phase["max_ms"]
        assert phase["p99_ms"] <= phase["p99_from_schedule_ms"] and phase["max_ms"] <= phase["max_from_schedule_ms"]
        assert phase["achieved_rps"] > 0
        assert all(g["cpu_s"] >= 0 for g in phase["generators"])
    for r in result["rates"]:
        assert all(g["p99_lag_ms"] >= 0 and g["max_lag_ms"] >= g["p99_lag_ms"] for g in r["generators"])
        assert 0 <= r["user_waits"] <= r["sent"]
        assert r["onloaded_bytes_per_request"] is not None and r["onloaded_bytes_per_request"] >= 0
    assert result["warmup"]["sent"] == result["trace"]["users"]
    summary = result["summary"]
    assert summary["closed_loop_rps"] > 0 and summary["pcie_bound_rps"] is None  # CPU: no copy peak
    assert summary["device_bound_rps"] is None  # CPU: no device time
    assert summary["rps_at_p99_25ms"] is None or summary["rps_at_p99_25ms"] > 0
    assert summary["stalls_after_warmup"] == 0  # the core's counters reach the report (CPU: nothing compiles)
    table = (out / "bench_serve.md").read_text()
    assert "| 15 |" in table and "| 30 |" in table and "onloaded MB a request" in table
    for r in result["rates"]:  # each rate's row shows its onloaded MB a request
        row = next(line for line in table.splitlines() if line.startswith(f"| {r['offered_rps']:g} |"))
        assert f"| {r['onloaded_bytes_per_request'] / 1e6:.1f} |" in row
    check_cache(result, table)
    return result


def check_cache(result: dict, table: str) -> None:
    """Each phase's ``cache`` is the change of the core's counters over it: non-negative, one finished request per
    answer, computed history within the history, and the phases' changes add up to the run's (end - start); the
    tables show them."""
    from gr_engine.serving.load import PHASE_COUNTERS

    phases = [result["warmup"], result["closed_loop"], *result["rates"]]
    totals = result["summary"]["core_counters"]
    for phase in phases:
        c = phase["cache"]
        assert all(c[name] >= 0 for name in PHASE_COUNTERS), c
        assert c["finished_requests"] == phase["answered"], (c, phase["answered"])  # the counters cover the phase
        assert c["computed_history_tokens"] == c["history_tokens"] - c["gpu_hit_tokens"] - c["host_hit_tokens"] >= 0
        assert 0 <= c["computed_history_tokens_per_request"] <= c["history_tokens_per_request"]
        assert c["history_tokens_per_request"] == pytest.approx(c["history_tokens"] / c["finished_requests"])
        assert 0 <= c["gpu_hit_share"] + c["host_hit_share"] <= 1
    for name in PHASE_COUNTERS:
        assert sum(p["cache"][name] for p in phases) == totals["end"][name] - totals["start"][name] <= \
            totals["end"][name], name
    assert [r["onloaded_bytes"] for r in result["rates"]] == [r["cache"]["onloaded_bytes"] for r in result["rates"]]
    assert sum(p["cache"]["evicted_users"] for p in phases) > 0  # the quick trace outgrows the GPU pool
    assert "computed history tokens a request" in table and "GPU evictions / host evictions / lost tokens" in table
    for r in result["rates"]:
        c = r["cache"]
        row = next(line for line in table.splitlines() if line.startswith(f"| {r['offered_rps']:g} |"))
        assert f"| {c['computed_history_tokens_per_request']:.1f} | {c['evicted_users']}/" \
               f"{c['host_evicted_users']}/{c['lost_tokens']} |" in row, row
    warmup = result["warmup"]["cache"]
    assert f"{warmup['computed_history_tokens_per_request']:.1f} computed history tokens a request, " \
           f"{warmup['evicted_users']} GPU evictions" in table
    assert "## The cache per phase" in table and "| warm-up |" in table and "| closed loop |" in table


def test_in_process_two_rates(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["bench-serve", "--quick", "--in-process", "--mode", "hierarchical", "--rates", RATES,
                 "--duration", "1", "--closed-requests", "8", "--out", str(out),
                 "--set", "serving.warmup=false", "--set", NO_QUEUE_BOUND]) == 0
    result = check_result(out, in_process=True)
    assert result["engine_config"]["cache"]["mode"] == "hierarchical"
    assert result["engine_config"]["scheduler"]["max_num_seqs"] == 16
    # The core's step log (written to OUT by default) holds every step after its warm-up: each request of the run
    # took one step here (no chunking at this size), and each rate's profile covers that rate's steps.
    from gr_engine.serving.step_log import read_step_log

    assert result["engine_config"]["serving"]["step_log"] == str(out / "core_steps.jsonl")
    header, steps = read_step_log(out / "core_steps.jsonl")
    assert header.frozen_objects > 0 and header.full_collection_s > 0
    phases = [result["warmup"], result["closed_loop"], *result["rates"]]
    assert sum(s.requests for s in steps) == sum(p["answered"] for p in phases)
    assert all(s.tokens > 0 and s.seconds > 0 for s in steps)
    for r in result["rates"]:
        core = r["core"]
        assert 1 <= core["steps"] <= r["answered"] and 0 < core["busy_fraction"] < 1
        assert core["device_busy_fraction"] == 0 and 0 <= core["overlapped_fraction"] <= 1
        assert core["requests"]["max"] <= 16 and core["step_ms"]["max"] >= core["step_ms"]["p50"] > 0
    assert result["summary"]["core_heap"]["frozen_objects"] == header.frozen_objects
    assert "The engine core per rate" in (out / "bench_serve.md").read_text()


def test_write_config_is_the_bench_engine(tmp_path: Path) -> None:
    from gr_engine.serving.load import bench_engine_config, bench_settings

    path = tmp_path / "engine.json"
    assert main(["bench-serve", "--quick", "--mode", "gpu_only", "--write-config", str(path)]) == 0
    written = json.loads(path.read_text())
    expected = msgspec.to_builtins(bench_engine_config(bench_settings(quick=True), "gpu_only"))
    assert written == expected


@pytest.mark.parametrize("args, message", [
    (["--url", "http://127.0.0.1:1"], "cannot reach http://127.0.0.1:1: "),
    (["--url", "127.0.0.1:8000"], "cannot reach 127.0.0.1:8000: "),
    (["--in-process", "--rate", "nan"], "rates and --duration must be positive finite numbers"),
    (["--in-process", "--rates", "10,inf"], "rates and --duration must be positive finite numbers"),
    (["--in-process", "--timeout-ms", "-1"], "--timeout-ms must be a number >= 0, got -1.0"),
    (["--in-process", "--users", "0"], "the trace needs at least one user (--users), got 0"),  # was the default
])
def test_bad_arguments_and_unreachable_servers_are_one_line_errors(args: list[str], message: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """Each fails at once (before the trace is generated), exit 2, one line; an unreachable server used to end in a
    traceback after the trace was generated, a NaN rate in "cannot convert float NaN to integer"."""
    assert main(["bench-serve", "--quick", "--duration", "1", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "trace:" not in err, err


def test_write_config_of_the_gpu_bench_on_any_machine(tmp_path: Path) -> None:
    """Without ``--quick`` the bench's engine is a GPU's (device cuda): it is written on a machine without CUDA too
    (it used to fail there, "device 'cuda' requested but CUDA is not available"); its values are still checked."""
    path = tmp_path / "engine.json"
    assert main(["bench-serve", "--mode", "hierarchical", "--write-config", str(path)]) == 0
    assert json.loads(path.read_text())["device"] == "cuda"
    assert main(["bench-serve", "--mode", "hierarchical", "--write-config", str(path), "--set",
                 "cache.num_gpu_pages=-1"]) == 2


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """``gr-engine serve`` with the bench's quick gpu_only engine (written by ``--write-config``)."""
    tmp = tmp_path_factory.mktemp("bench-serve")
    config = tmp / "engine.json"
    assert main(["bench-serve", "--quick", "--mode", "gpu_only", "--write-config", str(config)]) == 0
    srv = Server(tmp, NO_QUEUE_BOUND, config=msgspec.json.decode(config.read_bytes(), type=EngineConfig))
    try:
        yield srv.url
    finally:
        srv.stop()


@pytest.mark.parametrize("body", ["json", "msgpack"])
def test_http_with_two_generator_processes(server: str, tmp_path: Path, body: str) -> None:
    out = tmp_path / "out"
    assert main(["bench-serve", "--quick", "--url", server, "--rates", RATES, "--duration", "1",
                 "--processes", "2", "--closed-requests", "8", "--out", str(out), "--body", body]) == 0
    result = check_result(out, in_process=False)
    assert all(len(r["generators"]) == 2 for r in result["rates"])
    assert result["settings"]["processes"] == 2 and result["settings"]["body"] == body
    assert result["engine_config"]["cache"]["mode"] == "gpu_only"  # the server's engine (GET /v1/config)


@pytest.mark.parametrize("body", ["json", "msgpack"])
def test_served_scores_equal_offline_recompute(server: str, body: str) -> None:
    """The load's own requests and bodies (:func:`~gr_engine.serving.load_http.rank_body`) get offline scores."""
    from gr_engine.bench.trace import generate_trace
    from gr_engine.serving.load import bench_engine_config, bench_settings
    from gr_engine.serving.load_http import rank_body

    settings = bench_settings(quick=True)
    trace = generate_trace(settings.trace)
    requests = [trace.rank_request(i) for i in trace.steady[-6:]]  # late visits: long, partly cached histories
    content_type = {"json": "application/json", "msgpack": "application/msgpack"}[body]
    response = httpx.post(f"{server}/v1/rank", content=rank_body(requests, body=body), timeout=60,
                          headers={"content-type": content_type, "accept": "application/json"})
    assert response.status_code == 200, response.text
    served = response.json()["outputs"]
    with GREngine(bench_engine_config(settings, "recompute")) as engine:
        offline = engine.rank(requests, use_tqdm=False)
    for output, reference in zip(served, offline, strict=True):
        assert output["error"] is None
        np.testing.assert_allclose(np.array(output["scores"], dtype=np.float32), reference.scores, atol=1e-4, rtol=0)


def test_http_sender_counts_answers_errors_and_refusals() -> None:
    """The generators' sender (aiohttp) against a stand-in server: a 200 answer's per-output errors by kind, a
    non-200 status as ``http_<status>``, and the body sent is the one encoded for the request."""
    import asyncio
    import socket

    aiohttp = pytest.importorskip("aiohttp")
    from aiohttp import web

    from gr_engine.request import RankRequest
    from gr_engine.serving.load_http import http_sender

    received: list[bytes] = []

    async def rank(request: web.Request) -> web.Response:
        received.append(await request.read())
        if len(received) == 2:
            return web.Response(status=503, text="overloaded")
        answer = {"outputs": [{"error": None if len(received) == 1 else "request timed out after 5 ms (deadline)"}]}
        return web.Response(body=msgspec.msgpack.encode(answer), content_type="application/msgpack")

    async def run() -> list[list[str | None]]:
        app = web.Application()
        app.router.add_post("/v1/rank", rank)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        requests = [RankRequest(request_id=f"r{i}", user_id=i, item_ids=[1], action_ids=[0], timestamps=[0],
                                candidate_item_ids=[2]) for i in range(3)]
        bodies = {r.request_id: f"body {r.request_id}".encode() for r in requests}
        try:
            async with aiohttp.ClientSession() as session:
                send = http_sender(session, f"http://127.0.0.1:{port}", "msgpack", bodies)
                return [await send([r]) for r in requests]
        finally:
            await runner.cleanup()

    outcomes = asyncio.run(asyncio.wait_for(run(), 60))
    assert outcomes == [[None], ["http_503"], ["error: request timed out after 5 ms"]]
    assert received == [b"body r0", b"body r1", b"body r2"]
