"""``gr-engine serve --api-servers N``: several API-server processes over one engine core (docs/serving.md), as a
subprocess on 127.0.0.1, and clients attached to one core in process. Every served score is checked against offline
``GREngine.rank`` of the same stream and against ``recompute`` (float32: 1e-5)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from gr_engine import GREngine, RankRequest

from .conftest import tiny_config
from .test_serving import TOL, Server, body, make_stream, metric_samples, recompute_scores, sigterm_under_load, total
from .test_serving_msgpack import post_by_user

httpx = pytest.importorskip("httpx")

ANSWERED = re.compile(r"API server (\d+): stopped; answered (\d+) of (\d+) request bodies accepted")
FROZEN = re.compile(r"API server (\d+): the engine core is ready; (\d+) objects frozen out of garbage collection")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("api-servers"), "serving.max_pending_requests=64", args=("--api-servers", "2"))
    yield srv
    assert srv.stop() == 0
    answered = {int(m[0]): (int(m[1]), int(m[2])) for m in ANSWERED.findall(srv.log_text())}
    assert set(answered) == {0, 1} and all(a == b for a, b in answered.values()), srv.log_text()


def per_server(samples: dict, before: dict) -> dict[str, float]:
    return {s: total(samples, "gr_engine_http_bodies_total", server=s)
            - total(before, "gr_engine_http_bodies_total", server=s) for s in ("0", "1")}


def test_two_api_servers_give_offline_scores_and_metrics_add_up(server: Server) -> None:
    stream = make_stream(300, num_users=24, seed=61)
    before = metric_samples(server.url)
    responses = asyncio.run(post_by_user(f"{server.url}/v1/rank", stream, lambda r: body([r]),
                                         {"content-type": "application/json"}, clients=16))
    offline = GREngine(tiny_config(num_gpu_pages=96)).rank(stream, use_tqdm=False)
    for request, response, reference, cached in zip(stream, responses, recompute_scores(stream), offline):
        assert response.status_code == 200, response.text
        [output] = response.json()["outputs"]
        assert output["error"] is None and output["request_id"] == request.request_id
        scores = np.array(output["scores"], dtype=np.float32)
        np.testing.assert_allclose(scores, reference, atol=TOL, rtol=0)
        np.testing.assert_allclose(scores, cached.scores, atol=TOL, rtol=0)
    after = metric_samples(server.url)  # one scrape, answered by either server, reports both
    bodies = per_server(after, before)
    assert bodies["0"] > 0 and bodies["1"] > 0 and sum(bodies.values()) == 300, bodies
    for name, labels in [("gr_engine_requests_total", {}), ("gr_engine_requests_total", {"outcome": "ok"}),
                         ("gr_engine_request_latency_seconds_count", {})]:
        assert total(after, name, **labels) - total(before, name, **labels) == 300, name
    assert total(after, "gr_engine_step_seconds_count") > total(before, "gr_engine_step_seconds_count")
    assert total(after, "gr_engine_gpu_hit_tokens_total") > total(before, "gr_engine_gpu_hit_tokens_total")


def test_each_api_server_freezes_its_start_up_heap(server: Server) -> None:
    """Each API server process froze its start-up heap (imports, app, client) once the core was ready."""
    frozen = {int(m[0]): int(m[1]) for m in FROZEN.findall(server.log_text())}
    assert set(frozen) == {0, 1} and min(frozen.values()) > 10_000, server.log_text()


def test_each_api_server_admits_its_share(server: Server) -> None:
    """``serving.max_pending_requests=64`` over two servers: each admits 32 requests at a time (a body of more can
    never be admitted: a 413, not a retryable 503)."""
    requests = make_stream(40, seed=67)
    response = httpx.post(f"{server.url}/v1/rank", content=body(requests), timeout=30)
    assert response.status_code == 413 and "retry-after" not in response.headers
    assert "32 requests" in response.json()["error"] and "split the call" in response.json()["error"]
    ok = httpx.post(f"{server.url}/v1/rank", content=body(requests[:30]), timeout=30)
    assert ok.status_code == 200
    for output, reference in zip(ok.json()["outputs"], recompute_scores(requests[:30])):
        np.testing.assert_allclose(np.array(output["scores"], dtype=np.float32), reference, atol=TOL, rtol=0)


def health_of_each(url: str, want: int, servers: int = 2, timeout_s: float = 20.0) -> dict[int, dict]:
    """``/health`` on new connections until every server has answered with status ``want``."""
    seen: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < servers:
        assert time.monotonic() < deadline, f"not every API server's /health became {want}: {seen}"
        response = httpx.get(f"{url}/health", timeout=10)  # a new connection: the kernel picks a server
        answer = response.json()
        if response.status_code == want:
            seen[answer["server"]] = answer
        else:
            seen.pop(answer["server"], None)
            time.sleep(0.05)
    return seen


def test_killing_the_core_makes_every_health_503(tmp_path: Path) -> None:
    server = Server(tmp_path, args=("--api-servers", "2"))
    try:
        healthy = health_of_each(server.url, 200)
        [core] = {answer["core_pid"] for answer in healthy.values()}
        os.kill(core, signal.SIGKILL)
        health_of_each(server.url, 503)
        assert httpx.post(f"{server.url}/v1/rank", content=body(make_stream(1)), timeout=10).status_code == 503
        assert server.process.poll() is None  # the servers stay up and say why
    finally:
        assert server.stop() == 1  # the core did not stop cleanly


def test_a_killed_launcher_leaves_no_body_unanswered_and_no_process_behind(tmp_path: Path) -> None:
    """SIGKILL of the launcher under load: the core stops (its parent is gone) with requests pending; each API
    server fails them (503) instead of waiting for answers that never come, and exits."""
    server = Server(tmp_path, "serving.max_pending_requests=256", args=("--api-servers", "2"))
    stream = make_stream(800, num_users=60, seed=131)
    [core] = {answer["core_pid"] for answer in health_of_each(server.url, 200).values()}
    api_servers = [int(pid) for pid in Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children")
                   .read_text().split() if int(pid) != core]

    async def load() -> list[int]:
        async with httpx.AsyncClient(timeout=40) as client:
            async def worker(k: int) -> list[int]:
                statuses = []
                for i in range(k * 4, len(stream), 64):
                    try:
                        response = await client.post(f"{server.url}/v1/rank", content=body(stream[i:i + 4]))
                    except (httpx.ConnectError, httpx.RemoteProtocolError):  # the servers are gone: not accepted
                        break  # (a body accepted and never answered times out instead, failing the test)
                    statuses.append(response.status_code)
                return statuses

            tasks = [asyncio.create_task(worker(k)) for k in range(16)]
            await asyncio.sleep(1.0)
            os.kill(server.process.pid, signal.SIGKILL)
            return [status for statuses in await asyncio.gather(*tasks) for status in statuses]

    statuses = asyncio.run(load())
    assert statuses and set(statuses) <= {200, 503}
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
              for pid in [*api_servers, core]):
        assert time.monotonic() < deadline, "an API server or the core outlived the launcher by 30 s"
        time.sleep(0.2)
    server.log.close()


def test_sigterm_under_load_loses_nothing(tmp_path: Path) -> None:
    server = Server(tmp_path, args=("--api-servers", "3"))
    answered = sigterm_under_load(server, make_stream(400, seed=71))
    log = server.log_text()
    counts = {int(m[0]): (int(m[1]), int(m[2])) for m in ANSWERED.findall(log)}
    assert set(counts) == {0, 1, 2}, log
    assert all(a == b for a, b in counts.values()), counts  # each answered every body it accepted
    assert sum(a for a, _ in counts.values()) == len(answered), (counts, len(answered))


def test_clients_attached_to_one_core_get_their_own_outputs() -> None:
    """Two :class:`AsyncGREngine` attached to one core reuse the same client-side ids; each gets its own answers,
    and the core exits 0 once both have left."""
    from gr_engine.serving.client import AsyncGREngine, CoreHandle
    from gr_engine.serving.core import start_core

    config = tiny_config(num_gpu_pages=96)
    streams = [make_stream(40, seed=73), [msgspec.structs.replace(r, user_id=r.user_id + 500)
                                          for r in make_stream(40, seed=79)]]

    async def run(handle: CoreHandle) -> list[list]:
        engines = [AsyncGREngine(config, handle) for _ in streams]
        for engine in engines:
            await engine.start()
        assert all(engine.admission.max_requests == config.serving.max_pending_requests // 2 for engine in engines)

        async def serve(engine: AsyncGREngine, stream: list[RankRequest]) -> list:
            return [output for i in range(0, len(stream), 4) for output in await engine.rank_many(stream[i:i + 4])]

        outputs = await asyncio.gather(*(serve(e, s) for e, s in zip(engines, streams)))
        for engine in engines:
            await engine.close()
        return outputs

    with tempfile.TemporaryDirectory() as folder:
        address = f"ipc://{folder}/core"
        core = start_core(config, address, clients=2)
        try:
            outputs = asyncio.run(run(CoreHandle(address, core.pid, clients=2)))
            core.join(60)
            assert core.exitcode == 0
        finally:
            if core.is_alive():
                core.kill()
    for stream, served in zip(streams, outputs):
        assert [o.request_id for o in served] == [r.request_id for r in stream]
        for output, reference in zip(served, recompute_scores(stream)):
            np.testing.assert_allclose(output.scores, reference, atol=TOL, rtol=0)
