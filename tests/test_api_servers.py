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
    """``serving.max_pending_requests=64`` over two servers: each admits 32 requests at a time."""
    requests = make_stream(40, seed=67)
    response = httpx.post(f"{server.url}/v1/rank", content=body(requests), timeout=30)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert "32 requests" in response.json()["error"]
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
        assert all(engine.max_pending_requests == config.serving.max_pending_requests // 2 for engine in engines)

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
