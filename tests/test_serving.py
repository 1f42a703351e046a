"""The online path on CPU: ``gr-engine serve`` as a subprocess on 127.0.0.1, and ``AsyncGREngine`` in process.

Every served score is checked against offline ``recompute`` of the same request (float32: 1e-5)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import numpy as np
import pytest

from gr_engine import EngineConfig, GREngine, RankRequest

from .conftest import tiny_config

httpx = pytest.importorskip("httpx")
pytest.importorskip("zmq")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

TOL = 1e-5


def make_stream(num_requests: int, num_users: int = 12, seed: int = 0) -> list[RankRequest]:
    """Returning users whose histories grow by 1-20 events a visit, 1-12 candidates each."""
    rng = np.random.default_rng(seed)
    histories: dict[int, tuple[list[int], list[int], list[int]]] = {}
    requests = []
    for i in range(num_requests):
        user = int(rng.integers(num_users))
        items, actions, times = histories.setdefault(user, ([], [], []))
        for _ in range(int(rng.integers(1, 21))):
            if len(items) == 240:
                items.clear(), actions.clear(), times.clear()  # a new history: the cache must notice
            items.append(int(rng.integers(200)))
            actions.append(int(rng.integers(8)))
            times.append(len(times))
        requests.append(RankRequest(request_id=f"r{i}", user_id=user, item_ids=list(items), action_ids=list(actions),
                                    timestamps=list(times),
                                    candidate_item_ids=rng.integers(200, size=int(rng.integers(1, 13))).tolist()))
    return requests


def recompute_scores(requests: list[RankRequest]) -> list[np.ndarray]:
    return [o.scores for o in GREngine(tiny_config(mode="recompute")).rank(requests, use_tqdm=False)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``gr-engine serve`` in a subprocess (``args``: more command-line arguments, e.g. ``--api-servers``; ``env``:
    more environment variables)."""

    def __init__(self, tmp: Path, *overrides: str, config: EngineConfig | None = None,
                 args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        path = tmp / "config.json"
        path.write_bytes(msgspec.json.encode(config or tiny_config(num_gpu_pages=96)))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "gr_engine", "serve", "--config", str(path), "--host", "127.0.0.1",
                   "--port", str(self.port), "--set", "serving.warmup=false", *args]
        for override in overrides:
            command += ["--set", override]
        self.log = (tmp / "server.log").open("w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None, (tmp / "server.log").read_text()
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("serve"), "serving.max_pending_requests=64", "serving.max_body_bytes=200000")
    yield srv
    assert srv.stop() == 0


def body(requests: list[RankRequest], **extra: object) -> bytes:
    return msgspec.json.encode({"requests": requests, **extra})


async def post_all(url: str, bodies: list[bytes], clients: int) -> list[httpx.Response]:
    """POST every body to ``url`` from ``clients`` concurrent connections; responses in order."""
    responses: list[httpx.Response | None] = [None] * len(bodies)
    queue = list(enumerate(bodies))[::-1]
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients)) as client:
        async def worker() -> None:
            while queue:
                i, content = queue.pop()
                responses[i] = await client.post(url, content=content, headers={"content-type": "application/json"})
        await asyncio.gather(*(worker() for _ in range(clients)))
    return responses


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, labels[k]) in ls for k in labels))


def test_concurrent_clients_get_offline_scores(server: Server) -> None:
    requests = make_stream(300)
    before = metric_samples(server.url)
    responses = asyncio.run(post_all(f"{server.url}/v1/rank", [body([r]) for r in requests], clients=32))
    offline = GREngine(tiny_config(num_gpu_pages=96)).rank(requests, use_tqdm=False)
    for request, response, reference, cached in zip(requests, responses, recompute_scores(requests), offline):
        assert response.status_code == 200, response.text
        [output] = response.json()["outputs"]
        assert output["error"] is None and output["request_id"] == request.request_id
        np.testing.assert_allclose(np.array(output["scores"], dtype=np.float32), reference, atol=TOL, rtol=0)
        np.testing.assert_allclose(np.array(output["scores"], dtype=np.float32), cached.scores, atol=TOL, rtol=0)
    after = metric_samples(server.url)
    assert total(after, "gr_engine_requests_total") - total(before, "gr_engine_requests_total") == 300
    assert total(after, "gr_engine_requests_total", outcome="ok") - total(before, "gr_engine_requests_total",
                                                                           outcome="ok") == 300
    assert (total(after, "gr_engine_request_latency_seconds_count")
            - total(before, "gr_engine_request_latency_seconds_count")) == 300
    assert total(after, "gr_engine_gpu_hit_tokens_total") > total(before, "gr_engine_gpu_hit_tokens_total")


def test_bad_input_gets_400_or_a_per_request_error(server: Server) -> None:
    url = f"{server.url}/v1/rank"
    good = make_stream(3, seed=5)
    assert httpx.post(url, content=b"{not json", timeout=10).status_code == 400
    assert httpx.post(url, content=b'{"reqs": []}', timeout=10).status_code == 400
    assert httpx.post(url, content=b'{"requests": 3}', timeout=10).status_code == 400
    assert httpx.post(url, content=b"x" * 300_000, timeout=10).status_code == 413
    mixed = [msgspec.to_builtins(good[0]), {**msgspec.to_builtins(good[1]), "item_ids": "abc"},
             {**msgspec.to_builtins(good[1]), "candidate_item_ids": [10**6]},
             {**msgspec.to_builtins(good[1]), "timestamps": [5] + [0] * (len(good[1].timestamps) - 1)},
             msgspec.to_builtins(good[2])]
    response = httpx.post(url, content=json.dumps({"requests": mixed}), timeout=30)
    assert response.status_code == 200
    outputs = response.json()["outputs"]
    assert [o["error"] is None for o in outputs] == [True, False, False, len(good[1].timestamps) == 1, True]
    assert "item_ids" in outputs[1]["error"] and "candidate_item_ids" in outputs[2]["error"]
    assert [o["request_id"] for o in outputs] == ["r0", "r1", "r1", "r1", "r2"]
    reference = recompute_scores([good[0], good[2]])
    np.testing.assert_allclose(np.array(outputs[0]["scores"], dtype=np.float32), reference[0], atol=TOL, rtol=0)
    np.testing.assert_allclose(np.array(outputs[4]["scores"], dtype=np.float32), reference[1], atol=TOL, rtol=0)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_unknown_paths_methods_and_encodings_get_json_errors(server: Server) -> None:
    """An unknown path (404) or method (405, with ``Allow``) answers ``{"error": ...}`` as every other error does
    (they were Starlette's plain text); a compressed body (``Content-Encoding: gzip``) is a 415 saying so, counted
    as a bad request (it was read as malformed JSON)."""
    missing = httpx.get(f"{server.url}/v2/rank", timeout=10)
    assert missing.status_code == 404 and missing.json() == {"error": "Not Found"}
    wrong = httpx.get(f"{server.url}/v1/rank", timeout=10)
    assert wrong.status_code == 405 and wrong.json() == {"error": "Method Not Allowed"}
    assert wrong.headers["allow"] == "POST"
    before = total(metric_samples(server.url), "gr_engine_request_errors_total", kind="bad_request")
    compressed = httpx.post(f"{server.url}/v1/rank", content=gzip.compress(body(make_stream(2, seed=41))),
                            headers={"content-encoding": "gzip"}, timeout=10)
    assert compressed.status_code == 415 and "Content-Encoding 'gzip' is not supported" in compressed.json()["error"]
    assert total(metric_samples(server.url), "gr_engine_request_errors_total", kind="bad_request") == before + 1
    plain = httpx.post(f"{server.url}/v1/rank", content=body(make_stream(2, seed=41)),
                       headers={"content-encoding": "identity"}, timeout=10)
    assert plain.status_code == 200


def test_out_of_range_fields_are_400_or_a_per_request_error_never_a_500(server: Server) -> None:
    """Values that decode but cannot be served: a user id beyond 64 bits (the core's wire holds 64) fails alone; a
    NaN or negative ``timeout_ms`` (msgpack can carry NaN), a ``top_k`` beyond 64 bits or values nested thousands
    deep are a 400."""
    url = f"{server.url}/v1/rank"
    good = make_stream(2, seed=41)
    mixed = [{**msgspec.to_builtins(good[0]), "user_id": 2**70}, msgspec.to_builtins(good[1])]
    response = httpx.post(url, content=json.dumps({"requests": mixed}), timeout=30)
    assert response.status_code == 200
    outputs = response.json()["outputs"]
    assert "does not fit in 64 bits" in outputs[0]["error"] and outputs[1]["error"] is None
    np.testing.assert_allclose(np.array(outputs[1]["scores"], dtype=np.float32), recompute_scores(good[1:])[0],
                               atol=TOL, rtol=0)
    packed = {"content-type": "application/msgpack", "accept": "application/json"}
    for timeout in (float("nan"), -1.0):
        answer = httpx.post(url, content=msgspec.msgpack.encode({"requests": mixed[1:], "timeout_ms": timeout}),
                            headers=packed, timeout=30)
        assert answer.status_code == 400 and "timeout_ms" in answer.json()["error"], answer.text
    retrieval = {k: v for k, v in mixed[1].items() if k != "candidate_item_ids"}
    answer = httpx.post(f"{server.url}/v1/generate", timeout=30,
                        content=json.dumps({"requests": [retrieval], "params": {"top_k": 2**70}}))
    assert answer.status_code == 400 and "top_k" in answer.json()["error"], answer.text
    deep = [(b'{"requests": [' + b"[" * 5000 + b"]" * 5000 + b"]}", {}),  # msgspec: RecursionError, a 400
            (b"\x81\xa8requests\x91" + b"\x91" * 5000 + b"\x90", packed)]
    for content, headers in deep:
        answer = httpx.post(url, content=content, headers=headers, timeout=30)
        assert answer.status_code == 400 and "nested too deeply" in answer.json()["error"], answer.text
    assert "Exception in ASGI application" not in server.log_text()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_deadline_after_refuses_nan_and_negative_timeouts() -> None:
    from gr_engine.serving.admission import deadline_after

    assert deadline_after(10.0, 250) == 10.25 and deadline_after(10.0, 0) == 10.0
    assert deadline_after(10.0, None) is None and deadline_after(10.0, float("inf")) is None
    for bad in (float("nan"), -0.5):
        with pytest.raises(ValueError, match="timeout_ms must be a number >= 0"):
            deadline_after(10.0, bad)


def test_metrics_count_every_request_once(server: Server) -> None:
    stream = make_stream(20, seed=29)
    bad = [{**msgspec.to_builtins(r), "candidate_item_ids": [10**6]} for r in stream[:3]]
    before = metric_samples(server.url)
    response = httpx.post(f"{server.url}/v1/rank", timeout=30,
                          content=json.dumps({"requests": [msgspec.to_builtins(r) for r in stream] + bad + [7]}))
    assert response.status_code == 200
    after = metric_samples(server.url)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("gr_engine_requests_total") == 24 and delta("gr_engine_requests_total", outcome="ok") == 20
    assert delta("gr_engine_request_errors_total", kind="invalid") == 4
    assert delta("gr_engine_request_latency_seconds_count") == 24
    assert ("gr_engine_queue_wait_seconds", ()) in after  # the estimate admission uses is exported


def test_overload_is_503_and_the_server_stays_up(server: Server) -> None:
    """Over ``serving.max_pending_requests`` (64) with others pending: a 503 to retry; a body over it by itself: a
    413 (retrying cannot help). Overloaded requests are counted once each; afterwards bodies are served exactly."""
    requests = make_stream(100, seed=7)
    response = httpx.post(f"{server.url}/v1/rank", content=body(requests), timeout=30)
    assert response.status_code == 413 and "split the call" in response.json()["error"]
    before = total(metric_samples(server.url), "gr_engine_request_errors_total", kind="overloaded")
    bodies = [body(requests[i:i + 40]) for i in range(0, 80, 20)]  # 4 x 40 at once: 160 > 64
    responses = asyncio.run(post_all(f"{server.url}/v1/rank", bodies, clients=4))
    refused = [r for r in responses if r.status_code == 503]
    assert refused and {r.status_code for r in responses} <= {200, 503}
    assert all(r.headers["retry-after"] == "1" for r in refused)
    after = total(metric_samples(server.url), "gr_engine_request_errors_total", kind="overloaded")
    assert after - before == 40 * len(refused)
    ok = httpx.post(f"{server.url}/v1/rank", content=body(requests[:50]), timeout=30)
    assert ok.status_code == 200
    for output, reference in zip(ok.json()["outputs"], recompute_scores(requests[:50])):
        np.testing.assert_allclose(np.array(output["scores"], dtype=np.float32), reference, atol=TOL, rtol=0)


def read_answer(connection: socket.socket) -> bytes:
    """An HTTP answer read from ``connection`` until its JSON body ends (or the server closes it)."""
    connection.settimeout(30)
    answer = b""
    while not answer.endswith(b"}") and (part := connection.recv(4096)):
        answer += part
    return answer


def test_bodies_received_at_once_are_bounded(tmp_path: Path) -> None:
    """Two clients send most of a 150 kB body and stall (300 kB of the 400 kB ``serving.max_reading_bytes``): a third
    body declaring 150 kB, and a chunked one (no declared length) once it passes the 100 kB left, are refused at once
    as overloaded (503, ``Retry-After``; counted); a stalled body completed is served, and the bytes of both stalled
    bodies are free again once one is answered and the other's client left (a body of 150 kB is then served). Without
    the bound, 16 clients each sending 31 MiB of a body grew the API server by 500 MiB, and more would grow it more."""
    server = Server(tmp_path, "serving.max_body_bytes=200000", "serving.max_reading_bytes=400000")
    size = 150_000
    head = (b"POST /v1/rank HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {size}\r\n\r\n".encode())
    requests = make_stream(2, seed=37)
    whole = body(requests[:1])
    whole += b" " * (size - len(whole))
    try:
        before = total(metric_samples(server.url), "gr_engine_request_errors_total", kind="overloaded")
        stalled = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        for connection in stalled:
            connection.sendall(head + whole[:1000])
        time.sleep(0.5)  # both are being received
        with socket.create_connection(("127.0.0.1", server.port)) as third:
            third.sendall(head)
            answer = read_answer(third)
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer.lower(), answer
        assert b"serving.max_reading_bytes" in answer, answer
        chunked = httpx.post(f"{server.url}/v1/rank", content=iter([b" " * 20_000] * 9), timeout=30)
        assert chunked.status_code == 503 and "max_reading_bytes" in chunked.json()["error"]
        stalled[0].sendall(whole[1000:])
        answer = read_answer(stalled[0])
        assert answer.startswith(b"HTTP/1.1 200"), answer
        [output] = json.loads(answer.split(b"\r\n\r\n", 1)[1])["outputs"]
        np.testing.assert_allclose(np.array(output["scores"], dtype=np.float32), recompute_scores(requests[:1])[0],
                                   atol=TOL, rtol=0)
        for connection in stalled:
            connection.close()
        time.sleep(0.5)
        later = httpx.post(f"{server.url}/v1/rank", content=whole, timeout=30)
        assert later.status_code == 200
        after = total(metric_samples(server.url), "gr_engine_request_errors_total", kind="overloaded")
        assert after - before == 2
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.log_text()


@pytest.mark.parametrize("api_servers", [1, 2])
def test_a_port_in_use_is_a_clear_error_before_any_engine_starts(api_servers: int) -> None:
    """``gr-engine serve`` on a port another socket listens on exits 2 with one line naming the address, and no engine
    core was started (before, one API server built and warmed up its engine, then failed to bind); a port out of
    range is a usage error."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "gr_engine", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--api-servers", str(api_servers), "--set", "serving.warmup=false"],
                                capture_output=True, text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "in use" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "engine core" not in result.stderr, result.stderr
    result = subprocess.run([sys.executable, "-m", "gr_engine", "serve", "--port", "99999"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "a port is 0 to 65535, got 99999" in result.stderr, result.stderr


def test_deadline_gives_an_error_not_a_late_answer(server: Server) -> None:
    """Requests late at their deadline get an error, never a late answer, and ``/metrics`` counts each request as
    its caller saw it (the core's later answer to a timed-out request is not counted again)."""
    requests = make_stream(40, seed=9)
    before = metric_samples(server.url)
    t0 = time.monotonic()
    response = httpx.post(f"{server.url}/v1/rank", content=body(requests, timeout_ms=1), timeout=30)
    assert response.status_code == 200 and time.monotonic() - t0 < 5
    outputs = response.json()["outputs"]
    late = [o["error"] is not None for o in outputs]
    assert any(late)  # 40 requests cannot all finish within 1 ms
    for output, reference in zip(outputs, recompute_scores(requests)):
        if output["error"] is None:
            np.testing.assert_allclose(np.array(output["scores"], dtype=np.float32), reference, atol=TOL, rtol=0)
        else:
            assert "deadline exceeded" in output["error"], output["error"]
    time.sleep(1.0)  # the core's answers to the aborted requests arrive meanwhile
    after = metric_samples(server.url)

    def delta(outcome: str) -> float:
        return (total(after, "gr_engine_requests_total", outcome=outcome)
                - total(before, "gr_engine_requests_total", outcome=outcome))

    assert (delta("ok"), delta("timeout")) == (late.count(False), late.count(True))


def test_config_and_ready(server: Server) -> None:
    config = httpx.get(f"{server.url}/v1/config", timeout=10).json()
    assert config["cache"]["num_gpu_pages"] == 96 and config["serving"]["max_pending_requests"] == 64
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_memory_stays_bounded(server: Server) -> None:
    core = httpx.get(f"{server.url}/health", timeout=10).json()["core_pid"]
    stream = make_stream(3000, num_users=40, seed=11)
    bodies = [body(stream[i:i + 4]) for i in range(0, len(stream), 4)]
    asyncio.run(post_all(f"{server.url}/v1/rank", bodies[:250], clients=16))
    start = rss_bytes(server.process.pid) + rss_bytes(core)
    responses = asyncio.run(post_all(f"{server.url}/v1/rank", bodies[250:], clients=16))
    assert all(r.status_code == 200 for r in responses)
    grown = rss_bytes(server.process.pid) + rss_bytes(core) - start
    assert grown < 40 * 2**20, f"grew {grown / 2**20:.1f} MiB over 2000 requests"


def test_health_turns_503_when_the_core_dies(tmp_path: Path) -> None:
    server = Server(tmp_path)
    try:
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200
        os.kill(health.json()["core_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health", timeout=10).status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 after the core was killed"
            time.sleep(0.1)
        response = httpx.post(f"{server.url}/v1/rank", content=body(make_stream(1)), timeout=10)
        assert response.status_code == 503
        assert server.process.poll() is None  # the server itself stays up and says why
    finally:
        server.stop()


def test_a_core_dying_mid_call_counts_each_request_once(tmp_path: Path) -> None:
    """A body whose core dies while its requests are pending is a 503; its request that failed the API server's
    checks is counted once (``invalid``, its output), the others once as ``unavailable``."""
    server = Server(tmp_path)
    try:
        core_pid = httpx.get(f"{server.url}/health", timeout=10).json()["core_pid"]
        stream = make_stream(2, seed=71)
        bad = msgspec.structs.replace(stream[0], request_id="bad", candidate_item_ids=[])
        before = metric_samples(server.url)
        os.kill(core_pid, signal.SIGSTOP)  # the call's valid requests stay pending
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{server.url}/v1/rank", content=body([*stream, bad]), timeout=30)
            time.sleep(1.0)
            os.kill(core_pid, signal.SIGKILL)
            response = answer.result()
        assert response.status_code == 503, response.text
        after = metric_samples(server.url)

        def delta(name: str, **labels: str) -> float:
            return total(after, name, **labels) - total(before, name, **labels)

        assert delta("gr_engine_request_errors_total", kind="invalid") == 1
        assert delta("gr_engine_request_errors_total", kind="unavailable") == 2
        assert delta("gr_engine_request_errors_total") == 3
    finally:
        server.stop()


def sigterm_under_load(server: Server, stream: list) -> dict[int, list]:
    """16 clients post ``stream`` one request at a time; SIGTERM once 60 are answered. Asserts the server exits 0,
    every answer equals recompute, and that the stop cut the stream short; returns the answered scores by index."""
    answered: dict[int, list] = {}
    failures: list[BaseException] = []

    async def client(indices: list[int]) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            for i in indices:
                try:
                    response = await http.post(f"{server.url}/v1/rank", content=body([stream[i]]))
                except httpx.TransportError as exc:  # refused or cut off: expected only after SIGTERM
                    failures.append(exc)
                    return
                assert response.status_code == 200, response.text
                answered[i] = response.json()["outputs"][0]["scores"]

    async def run() -> None:
        tasks = [asyncio.create_task(client(list(range(k, len(stream), 16)))) for k in range(16)]
        deadline = time.monotonic() + 120
        while len(answered) < 60 and not failures:
            assert time.monotonic() < deadline, "the load did not get 60 answers"
            await asyncio.sleep(0.01)
        server.process.send_signal(signal.SIGTERM)
        await asyncio.gather(*tasks)

    try:
        asyncio.run(run())
        assert server.process.wait(60) == 0
    finally:
        server.stop()
    assert 60 <= len(answered) < len(stream), failures
    served = sorted(answered)
    for i, reference in zip(served, recompute_scores([stream[i] for i in served])):
        np.testing.assert_allclose(np.array(answered[i], dtype=np.float32), reference, atol=TOL, rtol=0)
    return answered


def test_stalled_core_and_stalled_or_vanished_clients(tmp_path: Path) -> None:
    """A core that stops reporting: ``/health`` 503 saying ``"unresponsive"`` (not ``"ready"``). A client that
    stops mid-body: a 408 after ``serving.body_timeout_s``, and SIGTERM is not held by it; one that disconnects
    mid-body: no traceback in the log."""
    server = Server(tmp_path, "serving.health_timeout_s=1", "serving.body_timeout_s=1")
    try:
        core = httpx.get(f"{server.url}/health", timeout=10).json()["core_pid"]
        os.kill(core, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while (health := httpx.get(f"{server.url}/health", timeout=10)).status_code == 200:
                assert time.monotonic() < deadline, "/health still 200 with the core stopped"
                time.sleep(0.1)
            assert health.json()["status"] == "unresponsive"
            assert httpx.get(f"{server.url}/ready", timeout=10).json()["status"] == "unresponsive"
        finally:
            os.kill(core, signal.SIGCONT)
        head = (b"POST /v1/rank HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n") + b'{"requests": ['
        with socket.create_connection(("127.0.0.1", server.port)) as stalled:
            stalled.sendall(head)
            stalled.settimeout(20)
            answer = b""
            while not answer.endswith(b"}") and (part := stalled.recv(4096)):  # headers and body may come apart
                answer += part
        assert answer.startswith(b"HTTP/1.1 408") and b"serving.body_timeout_s" in answer, answer
        with socket.create_connection(("127.0.0.1", server.port)) as vanished:
            vanished.sendall(head)
        stalled = socket.create_connection(("127.0.0.1", server.port))
        stalled.sendall(head)
        time.sleep(0.2)
        t0 = time.monotonic()
        assert server.stop() == 0 and time.monotonic() - t0 < 15  # not held by the stalled body
        stalled.close()
        assert "Exception in ASGI application" not in server.log_text() and "Traceback" not in server.log_text()
        # the two stalled bodies got their 408s; the vanished client is not counted as answered
        assert "answered 2 of 3 request bodies accepted; 1 clients left before sending theirs" in server.log_text()
    finally:
        server.stop()


def test_sigterm_under_load_loses_no_accepted_request(tmp_path: Path) -> None:
    server = Server(tmp_path)
    answered = sigterm_under_load(server, make_stream(400, seed=13))
    # Requests cut off by the shutdown were never read by the server: it answered every body it accepted.
    assert f"answered {len(answered)} of {len(answered)} request bodies accepted; 0 clients" in server.log_text()


def test_cancelled_requests_that_have_not_started_are_dropped() -> None:
    from gr_engine.serving import AsyncGREngine

    async def run() -> None:
        async with AsyncGREngine(tiny_config(num_gpu_pages=96)) as engine:
            kinds: list[str | None] = []
            engine.observers.append(lambda output, kind, queue_s: kinds.append(kind))
            stream = make_stream(200, seed=17)
            task = asyncio.create_task(engine.rank_many(stream))
            await asyncio.sleep(0)  # the task sends all 200, then waits
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 60
            while engine.num_pending:  # the core answers every request: served, or dropped as cancelled
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert len(kinds) == 200 and kinds.count("cancelled") > 0
            assert set(kinds) <= {None, "cancelled"}
            later = make_stream(30, seed=19)
            outputs = await engine.rank_many(later)
            for output, reference in zip(outputs, recompute_scores(later)):
                np.testing.assert_allclose(output.scores, reference, atol=TOL, rtol=0)

    asyncio.run(run())


def test_an_undecodable_message_is_dropped_and_the_core_keeps_serving() -> None:
    """Bytes that are not a message of this version (a stray process on the core's socket) are logged and dropped;
    the core keeps serving its clients exactly."""
    import zmq

    from gr_engine.serving import AsyncGREngine

    async def run() -> None:
        async with AsyncGREngine(tiny_config(num_gpu_pages=96)) as engine:
            first = make_stream(10, seed=29)
            await engine.rank_many(first[:5])
            context = zmq.Context()
            stray = context.socket(zmq.DEALER)
            stray.connect(f"ipc://{engine._dir.name}/core")
            stray.send(b"\xc1 not msgpack")
            stray.send(msgspec.msgpack.encode({"type": "nothing"}))
            stray.send_multipart([b"two", b"frames"])
            stray.close(linger=1000)
            context.term()
            outputs = await asyncio.wait_for(engine.rank_many(first[5:]), 60)
            for output, reference in zip(outputs, recompute_scores(first[5:])):
                np.testing.assert_allclose(output.scores, reference, atol=TOL, rtol=0)
            assert engine._process.is_alive()

    asyncio.run(run())


def test_abort_waiting_between_steps() -> None:
    """The engine-side hook of the core: waiting requests dropped between steps; the rest are served exactly."""
    engine = GREngine(tiny_config(num_gpu_pages=96))
    stream = make_stream(40, seed=23)
    engine.add_requests(stream[:20])
    outputs = engine.step()
    engine.add_requests(stream[20:])
    dropped = engine.abort_waiting([r.request_id for r in stream[10:30:2]], "cancelled")
    assert dropped and all(o.error == "cancelled" for o in dropped)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) + len(dropped) == 40
    by_id = {o.request_id: o for o in outputs}
    served = [r for r in stream if r.request_id in by_id]
    for request, reference in zip(served, recompute_scores(served)):
        np.testing.assert_allclose(by_id[request.request_id].scores, reference, atol=TOL, rtol=0)
    engine.kv.check_invariants()


@pytest.mark.parametrize("max_queue_ms", [1.0, 0.0])
def test_admission_refuses_while_the_queue_wait_is_over_max_queue_ms(max_queue_ms: float) -> None:
    """A burst of 200 requests queues in the core; while the core's reported queue wait is over
    ``serving.max_queue_ms`` a new call is refused as overloaded (0: admitted); afterwards calls are admitted again.
    Every answer equals offline recompute."""
    from gr_engine.serving import AsyncGREngine, EngineOverloaded, ServingConfig

    config = msgspec.structs.replace(tiny_config(num_gpu_pages=96), serving=ServingConfig(max_queue_ms=max_queue_ms))
    stream = make_stream(200, seed=29)
    lone = make_stream(2, num_users=1, seed=31)
    lone = [msgspec.structs.replace(r, user_id=999, request_id=f"lone{i}") for i, r in enumerate(lone)]

    async def run() -> None:
        async with AsyncGREngine(config) as engine:
            burst = asyncio.create_task(engine.rank_many(stream))
            deadline = time.monotonic() + 60
            while engine.stats is None or engine.stats.waiting < 20 or engine.stats.queue_wait_s <= 0.001:
                assert time.monotonic() < deadline and not burst.done(), "the queue never built up"
                await asyncio.sleep(0.002)
            assert engine.stats.queue_wait_s < 60
            if max_queue_ms:
                with pytest.raises(EngineOverloaded, match="max_queue_ms"):
                    await engine.rank_many(lone[:1])
                served = []
            else:
                served = await engine.rank_many(lone[:1])
            outputs = await burst
            while engine.stats.waiting:  # the report after the last step says the queue is empty
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            served += await engine.rank_many(lone[len(served):])
            assert all(o.error is None for o in outputs + served)
            for output, reference in zip(outputs + served, recompute_scores(stream + lone)):
                np.testing.assert_allclose(output.scores, reference, atol=TOL, rtol=0)

    asyncio.run(run())


def test_an_idle_core_waits_max_batch_wait_ms_for_a_fuller_batch() -> None:
    """With ``serving.max_batch_wait_ms=2000`` and steps of 4, four requests sent 50 ms apart (users 2, 3, 2, 0) wait
    for one another: the first step starts once the fourth has arrived (not after the whole wait) and runs three
    (a user's second visit waits for its first), the second runs the leftover at once. Scores equal recompute."""
    from gr_engine.serving import AsyncGREngine, ServingConfig

    config = msgspec.structs.replace(tiny_config(num_gpu_pages=96, max_num_seqs=4, max_num_batched_tokens=2048),
                                     serving=ServingConfig(max_batch_wait_ms=2000, max_queue_ms=0))
    [first] = make_stream(1, num_users=4, seed=37)

    async def run() -> None:
        async with AsyncGREngine(config) as engine:
            await engine.rank(first)  # a first step, so that the core's idle wait starts afresh
            steps = engine.stats.steps
            again = [msgspec.structs.replace(r, request_id=f"again{i}") for i, r in enumerate(make_stream(4, 4, 41))]
            tasks = []
            for request in again:
                tasks.append(asyncio.create_task(engine.rank(request)))
                await asyncio.sleep(0.05)
            last_sent = time.monotonic()
            outputs = await asyncio.gather(*tasks)
            assert [r.user_id for r in again] == [2, 3, 2, 0]
            assert time.monotonic() - last_sent < 1.5, "the core waited out max_batch_wait_ms"
            assert engine.stats.steps == steps + 2, "the first three requests did not share one step"
            for output, reference in zip(outputs, recompute_scores(again)):
                np.testing.assert_allclose(output.scores, reference, atol=TOL, rtol=0)

    asyncio.run(run())


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_async_scheduling_launches_the_next_step_before_waiting(tmp_path: Path, async_scheduling: bool) -> None:
    """Under a burst, the core with ``serving.async_scheduling`` launches steps while the one ahead is unfinished (the
    step log says which), and without it never does; every answer equals offline recompute either way."""
    from gr_engine.serving import AsyncGREngine, ServingConfig
    from gr_engine.serving.step_log import read_step_log

    log = tmp_path / "steps.jsonl"
    config = msgspec.structs.replace(
        tiny_config(num_gpu_pages=96, max_num_seqs=4),
        serving=ServingConfig(max_queue_ms=0, async_scheduling=async_scheduling, step_log=str(log)))
    stream = make_stream(120, seed=43)

    async def run() -> list:
        async with AsyncGREngine(config) as engine:
            return await engine.rank_many(stream)

    outputs = asyncio.run(run())
    for output, reference in zip(outputs, recompute_scores(stream)):
        np.testing.assert_allclose(output.scores, reference, atol=TOL, rtol=0)
    _, steps = read_step_log(log)
    overlapped = sum(s.overlapped for s in steps)
    assert sum(s.requests for s in steps) >= len(stream)
    assert overlapped > len(steps) // 2 if async_scheduling else overlapped == 0, (overlapped, len(steps))


def test_queue_wait_estimate_follows_the_service_rate(monkeypatch) -> None:
    """``CoreStats.queue_wait_s`` is the requests waiting times the decayed busy seconds per answered request: at a
    steady 2.5 ms a request, 20 waiting requests read 50 ms; after the service slows to 5 ms a request it moves
    toward 100 ms within a few tens of steps; a step that answers nothing counts its time with the next."""
    import types

    import zmq

    from gr_engine.serving import core as core_module

    clock = [100.0]
    monkeypatch.setattr(core_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0],
                                                                   perf_counter=time.perf_counter))
    context = zmq.Context()
    inputs = context.socket(zmq.ROUTER)
    try:
        engine = GREngine(tiny_config(num_gpu_pages=96))
        core = core_module.EngineCore(engine, inputs, context)
        core._busy_from = clock[0]

        def serve(steps: int, seconds: float, answered: int) -> None:
            for _ in range(steps):
                clock[0] += seconds
                core._count_service(answered)

        serve(300, 0.010, 4)
        assert core._stats().queue_wait_s == 0.0  # nothing waits
        engine.add_requests(make_stream(20, num_users=20, seed=47))
        assert engine.num_waiting == 20
        assert core._stats().queue_wait_s == pytest.approx(0.050, rel=1e-9)
        serve(32, 0.020, 4)
        moved = core._stats().queue_wait_s
        assert 0.050 + 0.5 * 0.050 < moved < 0.100  # most of the way within SERVICE_STEPS steps
        serve(400, 0.020, 4)
        assert core._stats().queue_wait_s == pytest.approx(0.100, rel=1e-6)
        serve(1, 0.010, 0)  # (a long history's first chunk: nothing answered)
        before = (core._served_s, core._served)
        serve(1, 0.010, 4)
        decay = 1 - 1 / core_module.SERVICE_STEPS
        assert core._served_s == pytest.approx(before[0] * decay + 0.020)
        assert core._served == pytest.approx(before[1] * decay + 4)
    finally:
        inputs.close(linger=0)
        context.term()


def test_admission_counts_the_clients_own_sends_between_reports() -> None:
    """The client's queue-wait estimate adds what it sent since the core's latest report: with the core frozen (no
    report comes), calls are admitted while (sent since the report) x the report's seconds per answered request is
    within ``serving.max_queue_ms``, and refused beyond, without waiting for a report; once the core runs again every
    admitted request is answered exactly and calls are admitted again."""
    from gr_engine.serving import AsyncGREngine, EngineOverloaded, ServingConfig

    config = msgspec.structs.replace(tiny_config(num_gpu_pages=96),
                                     serving=ServingConfig(max_queue_ms=1.0, heartbeat_s=60.0))
    first, burst, later = make_stream(30, seed=53), make_stream(40, seed=59), make_stream(4, seed=61)
    burst = [msgspec.structs.replace(r, request_id=f"b{i}") for i, r in enumerate(burst)]
    later = [msgspec.structs.replace(r, request_id=f"l{i}") for i, r in enumerate(later)]

    async def run() -> None:
        async with AsyncGREngine(config) as engine:
            await engine.rank_many(first)  # the latest report: nothing waits, a service time per request
            deadline = time.monotonic() + 30
            while engine.stats.waiting or engine.stats.running:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            service = engine.stats.service_s
            assert service > 0 and engine.queue_wait_s() == 0.0
            engine.admission.max_queue_s = 5.5 * service  # so the 7th call is refused: 6 sent x service > the bound
            os.kill(engine.core_pid, signal.SIGSTOP)
            try:
                tasks = []
                for request in burst:
                    tasks.append(asyncio.ensure_future(engine.rank(request)))
                    await asyncio.sleep(0)  # the call is admitted (or refused) and sent
                    if tasks[-1].done():
                        with pytest.raises(EngineOverloaded, match="max_queue_ms"):
                            tasks.pop().result()
                        break
                assert len(tasks) == 6
                assert engine.queue_wait_s() == pytest.approx(6 * service)
            finally:
                os.kill(engine.core_pid, signal.SIGCONT)
            outputs = await asyncio.gather(*tasks)
            for output, reference in zip(outputs, recompute_scores(first + burst)[len(first):]):
                np.testing.assert_allclose(output.scores, reference, atol=TOL, rtol=0)
            while engine.queue_wait_s() > engine.admission.max_queue_s:  # a report after the answers resets the count
                assert time.monotonic() < deadline + 30
                await asyncio.sleep(0.01)
            assert all(o.error is None for o in await engine.rank_many(later))

    asyncio.run(run())
