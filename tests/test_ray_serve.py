"""The replica router on Ray Serve (:func:`gr_engine.serving.ray_serve.build_app`): two CPU engine deployments
behind the HTTP ingress, on a local Ray. Served scores equal ``recompute`` (float32: 1e-5), and every request's
cached-token count equals offline ``GREngine.rank`` of the same stream, which holds only if each user's visits
were all served by one replica, in order (the cache mode never evicts, so a visit's hits are its previous visit's
history whatever the batch-mates)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from gr_engine import GREngine, RankRequest
from gr_engine.routing import HashRing

from .conftest import tiny_config
from .test_serving import TOL, Server, body, free_port, make_stream, metric_samples, recompute_scores, total

serve = pytest.importorskip("ray.serve")
ray = pytest.importorskip("ray")
ray_serve = pytest.importorskip("gr_engine.serving.ray_serve")

#: Never evicts, and holds every user of the stream below.
CONFIG = msgspec.structs.replace(tiny_config(mode="unlimited", num_gpu_pages=8192),
                                 serving=msgspec.structs.replace(tiny_config().serving, warmup=False,
                                                                 max_pending_requests=64))
COUNTERS = ("num_gpu_cached_tokens", "num_host_cached_tokens", "num_computed_tokens")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """One local Ray and Ray Serve on 127.0.0.1 for the module, running two engine replicas; its base URL (Ray's
    CPUs are logical: one per deployment, for a second application of three too)."""
    ray.init(num_cpus=7, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(ray_serve.build_app(CONFIG, 2), name="gr-engine", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


async def by_user(url: str, requests: list[RankRequest], clients: int) -> list[httpx.Response]:
    """Each request alone in a body, from ``clients`` concurrent clients, each user's requests in stream order by
    one client; responses in request order."""
    responses: list = [None] * len(requests)
    users = sorted({r.user_id for r in requests}, key=str)

    async def client(mine: set) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            for i, request in enumerate(requests):
                if request.user_id in mine:
                    responses[i] = await http.post(f"{url}/v1/rank", content=body([request]),
                                                   headers={"content-type": "application/json"})

    await asyncio.gather(*(client(set(users[k::clients])) for k in range(clients)))
    return responses


def test_users_stay_on_their_replica_and_scores_are_exact(url: str) -> None:
    stream = make_stream(100, num_users=12, seed=5)
    served = [r.json()["outputs"] for r in asyncio.run(by_user(url, stream[:80], clients=4))]
    with httpx.Client(timeout=60) as http:  # bodies spanning users: split by replica, merged back in order
        for start in range(80, 100, 5):
            response = http.post(f"{url}/v1/rank", content=body(stream[start:start + 5]),
                                 headers={"content-type": "application/json"})
            assert response.status_code == 200, response.text
            served += [[output] for output in response.json()["outputs"]]
    outputs = [output for [output] in served]
    offline = GREngine(CONFIG).rank(stream, use_tqdm=False)
    for request, output, reference, alone in zip(stream, outputs, recompute_scores(stream), offline):
        assert output["error"] is None and output["request_id"] == request.request_id, output
        np.testing.assert_allclose(np.array(output["scores"], dtype=np.float32), reference, atol=TOL, rtol=0)
        np.testing.assert_allclose(np.array(output["scores"], dtype=np.float32), alone.scores, atol=TOL, rtol=0)
    for output, alone in zip(outputs[:80], offline[:80]):  # one user at a time: the same hits as offline
        assert {c: output[c] for c in COUNTERS} == {c: getattr(alone, c) for c in COUNTERS}, output["request_id"]
    homes = HashRing(range(2))
    samples = metric_samples(url)
    for replica in range(2):
        expected = sum(homes.route(r.user_id) == replica for r in stream)
        assert expected > 0
        assert total(samples, "gr_engine_router_requests_total", replica=str(replica)) == expected
    assert total(samples, "gr_engine_requests_total", outcome="ok") == 100


def test_bad_input_is_answered_per_request(url: str) -> None:
    good = make_stream(1, seed=9)[0]
    content = msgspec.json.encode({"requests": [good, {"user_id": 1, "item_ids": "x"}]})
    response = httpx.post(f"{url}/v1/rank", content=content, headers={"content-type": "application/json"},
                          timeout=60)
    assert response.status_code == 200, response.text
    first, second = response.json()["outputs"]
    assert first["error"] is None and second["error"].startswith("invalid request")
    assert httpx.post(f"{url}/v1/rank", content=b"{not json", timeout=60).status_code == 400
    too_large = httpx.post(f"{url}/v1/rank", content=body(make_stream(140, seed=2)), timeout=60)
    assert too_large.status_code == 413 and "split the call" in too_large.json()["error"], too_large.text
    health = httpx.get(f"{url}/health", timeout=60).json()
    assert health["status"] == "ok" and [r["on_ring"] for r in health["replicas"]] == [True, True]



class FakeHandle:
    """A deployment handle whose ``rank_many`` answers with offline ``GREngine.rank`` (``engine``), or raises
    ``error`` as Ray does when the replica's actor has died."""

    def __init__(self, engine: GREngine | None, error: Exception | None = None) -> None:
        self.engine, self.error, self.calls = engine, error, 0
        self.rank_many = self

    def remote(self, requests: list[RankRequest], timeout_ms: float | None) -> object:
        self.calls += 1

        async def answer() -> list:
            if self.error is not None:
                raise self.error
            return [(output, None, 0.0) for output in self.engine.rank(requests, use_tqdm=False)]
        return answer()


def test_a_dead_replica_is_taken_off_the_ring_and_its_requests_retried_once() -> None:
    router_module = pytest.importorskip("gr_engine.serving.router")
    live, dead = FakeHandle(GREngine(CONFIG)), FakeHandle(None, ray.exceptions.ActorDiedError())
    replicas = {0: ray_serve._HandleReplica(live, CONFIG), 1: ray_serve._HandleReplica(dead, CONFIG)}
    router = router_module.ReplicaRouter(CONFIG, 2, engines=replicas)
    stream = make_stream(40, num_users=12, seed=11)
    moved = sum(router.home_ring.route(r.user_id) == 1 for r in stream)

    async def serve_all() -> list:
        async with router:
            return await router.rank_many(stream)

    outputs = asyncio.run(serve_all())
    for request, output, reference in zip(stream, outputs, recompute_scores(stream)):
        assert output.error is None and output.request_id == request.request_id, output.error
        np.testing.assert_allclose(output.scores, reference, atol=TOL, rtol=0)
    assert moved > 0 and dead.calls == 1 and router.counts.retries == moved
    assert list(router.ring.replicas) == [0] and router.dead == {1}
    dead_again = FakeHandle(None, ray.exceptions.ActorDiedError())
    router = router_module.ReplicaRouter(CONFIG, 1, engines={0: ray_serve._HandleReplica(dead_again, CONFIG)})

    async def serve_twice() -> list:
        async with router:
            first = await router.rank_many(stream[:3])
            with pytest.raises(router_module.EngineDead, match="no replica is alive"):
                await router.rank_many(stream[:3])
            return first

    assert all("no replica is left" in output.error for output in asyncio.run(serve_twice()))


class Reporting:
    """A deployment handle whose ``health`` answers as :meth:`EngineReplica.health` does: ``reported``, no counters."""

    def __init__(self) -> None:
        self.reported, self.health = "ready", self

    def remote(self) -> object:
        async def answer() -> tuple[str, None]:
            return self.reported, None
        return answer()


def test_the_polled_engine_state_decides_the_ring() -> None:
    """A deployment polled ``"unresponsive"`` is listed so and off the ring, and back once polled ``"ready"``; one
    polled ``"dead"`` (its core died, its actor lives) is dead and not recovered until its core answers again."""
    router_module = pytest.importorskip("gr_engine.serving.router")
    handles = [Reporting(), Reporting()]
    replicas = {i: ray_serve._HandleReplica(handle, CONFIG) for i, handle in enumerate(handles)}
    router = router_module.ReplicaRouter(CONFIG, 2, engines=replicas)

    async def listed() -> list[tuple[str, bool]]:
        await asyncio.gather(*(replica.poll() for replica in replicas.values()))
        return [(r["state"], r["on_ring"]) for r in router.replica_states()]

    async def run() -> None:
        async with router:
            handles[1].reported = "unresponsive"
            assert await listed() == [("ready", True), ("unresponsive", False)] and router.is_healthy()
            handles[1].reported = "ready"
            assert await listed() == [("ready", True), ("ready", True)]
            handles[1].reported = "dead"
            assert await listed() == [("ready", True), ("dead", False)] and router.dead == {1}
            assert not await replicas[1].recover()
            handles[1].reported = "ready"
            await router.restart(1)
            assert await listed() == [("ready", True), ("ready", True)] and router.counts.restarts == 1

    asyncio.run(run())


def test_serve_ray_refuses_api_servers(capsys) -> None:
    from gr_engine.cli import main

    assert main(["serve", "--ray", "--api-servers", "2"]) != 0
    assert "--ray serves through Ray Serve's HTTP proxy" in capsys.readouterr().err


@pytest.mark.slow
def test_the_serve_command_on_ray(tmp_path) -> None:
    """``gr-engine serve --ray`` in a subprocess with a Ray of its own (one replica: this host may have 2 CPUs, one
    for the ingress): answers, then stops on SIGTERM with status 0."""
    server = Server(tmp_path, config=CONFIG, args=("--ray", "--replicas", "1"), env={"RAY_ADDRESS": "local"})
    try:
        [request] = make_stream(1, seed=3)
        response = httpx.post(f"{server.url}/v1/rank", content=body([request]), timeout=60)
        np.testing.assert_allclose(np.array(response.json()["outputs"][0]["scores"], dtype=np.float32),
                                   recompute_scores([request])[0], atol=TOL, rtol=0)
    finally:
        assert server.stop() == 0, server.log_text()


def test_a_killed_engine_actor_loses_no_request_and_its_replica_comes_back(url: str) -> None:
    """A second application ("slow": each core waits 1 s for a fuller batch, so calls stay inside the engine
    actors): engine-1's actor is killed while it holds calls (Ray Serve then starts a replacement). Every request is
    answered exactly (the calls the dead actor held are retried on their users' next replica), the replica is back
    on the ingress's ring once its deployment answers again, and ``/metrics`` has each replica's core figures."""
    slow = msgspec.structs.replace(CONFIG, serving=msgspec.structs.replace(CONFIG.serving, max_batch_wait_ms=1000))
    serve.run(ray_serve.build_app(slow, 2), name="slow", route_prefix="/slow")
    base = f"{url}/slow"
    stream = make_stream(60, num_users=12, seed=13)
    homes = HashRing(range(2))
    [victim] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if "slow" in a["name"] and "engine-1" in a["name"]]
    actor = ray.get_actor(victim["name"], namespace=victim["namespace"])

    async def run() -> list[httpx.Response]:
        first = await by_user(base, stream[:20], clients=6)
        load = asyncio.create_task(by_user(base, stream[20:40], clients=6))
        await asyncio.sleep(0.6)  # the calls have reached the actors (a loaded CI core takes ~0.3 s) and wait there
        ray.kill(actor, no_restart=True)
        return first + await load

    try:
        responses = asyncio.run(run())
        deadline = time.monotonic() + 120
        while [r["on_ring"] for r in httpx.get(f"{base}/health", timeout=60).json()["replicas"]] != [True, True]:
            assert time.monotonic() < deadline, "the replaced replica never came back on the ring"
            time.sleep(0.5)
        restored = metric_samples(base)
        responses += asyncio.run(by_user(base, stream[40:], clients=6))
        samples = metric_samples(base)
    finally:
        serve.delete("slow")
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    outputs = [r.json()["outputs"][0] for r in responses]
    for request, output, reference in zip(stream, outputs, recompute_scores(stream), strict=True):
        assert output["error"] is None and output["request_id"] == request.request_id, output
        np.testing.assert_allclose(np.array(output["scores"], dtype=np.float32), reference, atol=TOL, rtol=0)
    assert total(samples, "gr_engine_router_retries_total") >= 1
    assert total(samples, "gr_engine_router_restarts_total") == 1
    back = total(samples, "gr_engine_router_requests_total", replica="1") - total(
        restored, "gr_engine_router_requests_total", replica="1")
    assert back == sum(homes.route(r.user_id) == 1 for r in stream[40:]) > 0  # its users are back on it
    for replica in ("0", "1"):  # each core's figures, polled from its deployment
        assert total(samples, "gr_engine_step_seconds_count", replica=replica) > 0


def engine_core_pid(app: str, deployment: str) -> int:
    """The engine-core process of ``deployment``'s one replica in application ``app``: the child of its actor's
    process that ``multiprocessing`` spawned (this host's, as the module's Ray is local)."""
    [entry] = [a for a in ray.util.list_named_actors(all_namespaces=True)
               if f"{app}#{deployment}#" in a["name"]]
    actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
    parent = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60)
    cores = []
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (proc / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone
        if ppid == parent and b"spawn_main" in command:
            cores.append(int(proc.name))
    [core] = cores
    return core


def test_a_silent_engine_core_is_off_the_ring_until_it_reports_again(url: str) -> None:
    """A third application ("quiet": cores report every 0.2 s and count as silent after 3 s): engine-1's core is
    stopped (SIGSTOP) while its actor runs. The ingress's ``/health`` lists that replica ``"unresponsive"`` and off
    the ring (still 200: the other one serves); its users' new requests are answered exactly by their next replica
    and none goes to it. After SIGCONT it is ``"ready"`` and on the ring again, the same core (Ray Serve did not
    replace it: its health check fails only for a dead core), and its users return to it."""
    quiet = msgspec.structs.replace(CONFIG, serving=msgspec.structs.replace(CONFIG.serving, heartbeat_s=0.2,
                                                                            health_timeout_s=3.0))
    serve.run(ray_serve.build_app(quiet, 2), name="quiet", route_prefix="/quiet")
    base = f"{url}/quiet"
    stream = make_stream(60, num_users=12, seed=17)
    homes = [HashRing(range(2)).route(r.user_id) for r in stream]

    def listed() -> list[tuple[str, bool]]:
        return [(r["state"], r["on_ring"]) for r in httpx.get(f"{base}/health", timeout=60).json()["replicas"]]

    def wait_for(states: list[tuple[str, bool]]) -> None:
        deadline = time.monotonic() + 30
        while (now := listed()) != states:
            assert time.monotonic() < deadline, f"replicas are {now}, not {states}"
            time.sleep(0.2)

    try:
        core = engine_core_pid("quiet", "engine-1")
        responses = asyncio.run(by_user(base, stream[:20], clients=4))
        os.kill(core, signal.SIGSTOP)
        try:
            wait_for([("ready", True), ("unresponsive", False)])
            health = httpx.get(f"{base}/health", timeout=60)
            assert health.status_code == 200 and health.json()["status"] == "ok", health.text
            before = metric_samples(base)
            responses += asyncio.run(by_user(base, stream[20:40], clients=4))
            during = metric_samples(base)
        finally:
            os.kill(core, signal.SIGCONT)
        wait_for([("ready", True), ("ready", True)])
        back = metric_samples(base)
        responses += asyncio.run(by_user(base, stream[40:], clients=4))
        samples = metric_samples(base)
        assert engine_core_pid("quiet", "engine-1") == core
    finally:
        serve.delete("quiet")
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    outputs = [r.json()["outputs"][0] for r in responses]
    offline = GREngine(quiet).rank(stream, use_tqdm=False)
    for request, output, reference, alone in zip(stream, outputs, recompute_scores(stream), offline, strict=True):
        assert output["error"] is None and output["request_id"] == request.request_id, output
        np.testing.assert_allclose(np.array(output["scores"], dtype=np.float32), reference, atol=TOL, rtol=0)
        np.testing.assert_allclose(np.array(output["scores"], dtype=np.float32), alone.scores, atol=TOL, rtol=0)

    def sent(samples: dict, replica: str) -> float:
        return total(samples, "gr_engine_router_requests_total", replica=replica)

    moved = sum(home == 1 for home in homes[20:40])
    assert moved > 0 and sent(during, "1") == sent(before, "1")  # nothing went to the silent replica
    assert sent(during, "0") - sent(before, "0") == 20
    assert total(during, "gr_engine_router_reroutes_total") - total(before, "gr_engine_router_reroutes_total") == moved
    assert sent(samples, "1") - sent(back, "1") == sum(home == 1 for home in homes[40:]) > 0  # its users are back
    assert total(samples, "gr_engine_router_retries_total") == 0
    assert total(samples, "gr_engine_router_restarts_total") == 0
