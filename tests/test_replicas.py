"""User-affinity replicas (docs/scale_out.md): ``ReplicaRouter`` over CPU engine cores in process, and
``gr-engine serve --replicas 2`` as a subprocess on 127.0.0.1. Every served score is checked against offline
``GREngine.rank`` of the same stream and against ``recompute`` (float32: 1e-5)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from gr_engine import EngineConfig, GREngine, RankRequest

from .conftest import tiny_config
from .test_serving import TOL, Server, body, make_stream, metric_samples, recompute_scores, total

httpx = pytest.importorskip("httpx")
pytest.importorskip("zmq")
router_module = pytest.importorskip("gr_engine.serving.router")
ReplicaRouter = router_module.ReplicaRouter
CallTooLarge = pytest.importorskip("gr_engine.serving.admission").CallTooLarge
replicas_module = pytest.importorskip("gr_engine.serving.replicas")
replica_devices = replicas_module.replica_devices


def replica_config() -> EngineConfig:
    config = tiny_config(num_gpu_pages=96)
    return msgspec.structs.replace(config, serving=msgspec.structs.replace(config.serving, warmup=False,
                                                                           max_pending_requests=64))


class Served:
    """A started router on an event loop of its own, and which replica answered each request id."""

    def __init__(self, replicas: int, config: EngineConfig | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.router = ReplicaRouter(config or replica_config(), replicas)
        self.answered: dict[str, list[int]] = {}  # request id -> replicas whose core answered it
        for replica, engine in self.router.engines.items():
            engine.observers.append(lambda output, kind, queue_s, replica=replica:
                                    self.answered.setdefault(output.request_id, []).append(replica))
        self.run(self.router.start())

    def run(self, awaitable):
        return self.loop.run_until_complete(asyncio.wait_for(awaitable, 120))

    def close(self) -> None:
        self.run(self.router.close())
        self.loop.close()

    def run_then_close(self, awaitable):
        """:meth:`run`, then :meth:`close` (whatever happened)."""
        try:
            return self.run(awaitable)
        finally:
            self.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    served = Served(3)
    yield served
    served.close()


async def by_user(router: router_module.ReplicaRouter, requests: list[RankRequest], clients: int,
                  timeout_ms: float | None = None) -> list:
    """Each request alone through ``router`` (within ``timeout_ms``) from ``clients`` concurrent clients, each user's
    requests in stream order by one client; outputs in request order."""
    outputs: list = [None] * len(requests)
    users = sorted({r.user_id for r in requests}, key=str)

    async def client(mine: set) -> None:
        for i, request in enumerate(requests):
            if request.user_id in mine:
                outputs[i] = await router.rank(request, timeout_ms)

    await asyncio.gather(*(client(set(users[k::clients])) for k in range(clients)))
    return outputs


def assert_exact(outputs: list, requests: list[RankRequest], offline: bool = True) -> None:
    references = recompute_scores(requests)
    cached = GREngine(tiny_config(num_gpu_pages=96)).rank(requests, use_tqdm=False) if offline else references
    for output, request, reference, other in zip(outputs, requests, references, cached):
        assert output.error is None and output.request_id == request.request_id, output.error
        np.testing.assert_allclose(output.scores, reference, atol=TOL, rtol=0)
        np.testing.assert_allclose(output.scores, getattr(other, "scores", other), atol=TOL, rtol=0)


def home_replicas(requests: list[RankRequest], replicas: int) -> list[int]:
    """Each request's home replica among ``replicas`` on the router's ring."""
    from gr_engine.routing import HashRing

    ring = HashRing(range(replicas))
    return [ring.route(r.user_id) for r in requests]


def test_replica_devices() -> None:
    assert replica_devices("cpu", 3, cuda_devices=0) == ["cpu"] * 3
    assert replica_devices("cuda", 2, cuda_devices=4) == ["cuda:0", "cuda:1"]
    assert replica_devices("auto", 2, cuda_devices=0) == ["cpu", "cpu"]
    assert replica_devices("cuda:3", 1, cuda_devices=4) == ["cuda:3"]
    with pytest.raises(ValueError, match=r"2 replicas need 2 CUDA devices.*has 1"):
        replica_devices("cuda", 2, cuda_devices=1)
    with pytest.raises(ValueError, match="names one device"):
        replica_devices("cuda:1", 2, cuda_devices=4)
    with pytest.raises(ValueError, match="at least 1"):
        replica_devices("cpu", 0)


def test_users_stay_on_their_replica_and_scores_are_exact(served: Served) -> None:
    router, stream = served.router, make_stream(240, num_users=24, seed=71)
    served.answered.clear()
    before = sum(router.counts.requests.values())
    outputs = served.run(by_user(router, stream[:160], clients=12))
    for start in range(160, 240, 8):  # bodies spanning users: split by replica, merged back in order
        outputs += served.run(router.rank_many(stream[start:start + 8]))
    assert_exact(outputs, stream)
    homes: dict[object, set[int]] = {}
    for request in stream:
        homes.setdefault(request.user_id, set()).update(served.answered[request.request_id])
    assert all(replicas == {router.ring.route(user)} for user, replicas in homes.items()), homes
    assert len({r for replicas in homes.values() for r in replicas}) == 3
    assert sum(router.counts.requests.values()) - before == 240
    assert router.counts.reroutes == router.counts.retries == 0


def visits(user: str, seed: int) -> list[RankRequest]:
    """Five visits of one user: a history of 30 events growing by 10 a visit, then the fourth visit's history
    with one early event rewritten."""
    rng = np.random.default_rng(seed)
    items, actions = rng.integers(200, size=60).tolist(), rng.integers(8, size=60).tolist()
    out = [RankRequest(request_id=f"{user}-{k}", user_id=user, item_ids=items[:n], action_ids=actions[:n],
                       timestamps=list(range(n)), candidate_item_ids=rng.integers(200, size=6).tolist())
           for k, n in enumerate((30, 40, 50, 60))]
    rewritten = msgspec.structs.replace(out[3], request_id=f"{user}-4", item_ids=[(items[0] + 1) % 200] + items[1:])
    return [*out, rewritten]


def test_a_user_returning_to_an_older_copy_of_its_kv_is_served_exactly(served: Served) -> None:
    router, user = served.router, "returning"
    stream, home = visits(user, seed=3), router.ring.route(user)
    [first] = served.run(router.rank_many(stream[:1]))
    router.suspend(home)  # visits 2-3 on the user's next replica, while the home keeps visit 1's KV
    try:
        nxt = router.ring.route(user)
        assert nxt == router.home_ring.preference(user, 2)[1] != home
        middle = [served.run(router.rank(r)) for r in stream[1:3]]
    finally:
        router.resume(home)
    assert router.counts.reroutes >= 2
    back = [served.run(router.rank(r)) for r in stream[3:]]  # home again: its KV is of visit 1, two visits old
    assert_exact([first, *middle, *back], stream, offline=False)
    assert [served.answered[r.request_id] for r in stream] == [[home], [nxt], [nxt], [home], [home]]
    assert 0 < back[0].num_gpu_cached_tokens <= 30  # visit 1's pages were reused, and only those
    assert back[1].num_gpu_cached_tokens == 0  # its first event differs from every cached history


def test_retrieval_deadlines_and_overload_through_the_router(served: Served) -> None:
    from gr_engine import GenerateParams, GenerateRequest

    router, stream = served.router, make_stream(48, num_users=16, seed=83)
    asks = [GenerateRequest(request_id=r.request_id, user_id=r.user_id, item_ids=r.item_ids,
                            action_ids=r.action_ids, timestamps=r.timestamps) for r in stream[:16]]
    params = GenerateParams(top_k=5, exclude_history=True)
    got = served.run(router.generate_many(asks, params))
    want = GREngine(tiny_config(mode="recompute")).generate(asks, params, use_tqdm=False)
    for output, reference in zip(got, want, strict=True):
        assert output.error is None and output.item_ids == reference.item_ids
        np.testing.assert_allclose(output.scores, reference.scores, atol=TOL, rtol=0)
    late = served.run(router.rank_many(stream, timeout_ms=1))  # 48 requests cannot all finish within 1 ms
    errors = [o.error for o in late if o.error is not None]
    assert errors and all(e == "deadline exceeded (1 ms)" for e in errors), errors
    with pytest.raises(CallTooLarge):  # 200 requests over 3 replicas: a part over the 64 a replica ever admits
        served.run(router.rank_many(make_stream(200, num_users=30, seed=89)))
    deadline = time.monotonic() + 30  # the withdrawn parts hold their admission until their cores answer them
    while any(e.num_pending for e in router.engines.values()):
        assert time.monotonic() < deadline, "withdrawn requests were never answered by their cores"
        served.run(asyncio.sleep(0.05))
    assert_exact(served.run(router.rank_many(stream)), stream, offline=False)  # served again, exactly


def test_suspending_the_last_replica_is_refused(served: Served) -> None:
    router = served.router
    with pytest.raises(ValueError, match="not a live replica off the ring"):
        router.resume(0)
    router.suspend(0)
    router.suspend(1)
    try:
        with pytest.raises(ValueError, match="last one"):
            router.suspend(2)
    finally:
        router.resume(0)
        router.resume(1)
    assert sorted(router.ring.replicas) == [0, 1, 2]


def test_a_killed_replica_loses_no_request_and_its_users_move_on() -> None:
    served = Served(3)
    router, stream = served.router, make_stream(200, num_users=24, seed=73)
    victim = router.ring.route(stream[0].user_id)
    engine = router.engines[victim]

    async def run() -> list:
        load = asyncio.create_task(by_user(router, stream, clients=12))
        deadline = time.monotonic() + 60
        while len(served.answered) < 40:
            assert time.monotonic() < deadline and not load.done(), "the load did not get 40 answers"
            await asyncio.sleep(0.01)
        os.kill(engine.core_pid, signal.SIGSTOP)  # frozen: it accepts nothing more and answers nothing
        while not engine.num_pending:
            assert time.monotonic() < deadline and not load.done(), "no request reached the frozen replica"
            await asyncio.sleep(0.01)
        os.kill(engine.core_pid, signal.SIGKILL)  # its accepted requests are now retried elsewhere
        return await load

    outputs = served.run_then_close(run())
    assert_exact(outputs, stream)  # every request answered, exactly, the lost ones by their retry
    assert router.dead == {victim} and victim not in router.ring
    assert router.counts.retries >= 1 and router.counts.reroutes >= router.counts.retries
    moved = 0
    for request in stream:
        where = served.answered[request.request_id]
        order = router.home_ring.preference(request.user_id, 2)
        if order[0] == victim:
            assert where in ([victim], [order[1]]), (request.request_id, where)
            moved += where == [order[1]]
        else:
            assert where == [order[0]]
    assert moved >= router.counts.retries


async def kill_core(router, replica: int) -> None:
    """SIGKILL ``replica``'s engine core and wait until its client sees it dead (at most 30 s)."""
    os.kill(router.engines[replica].core_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while router.engines[replica].is_alive():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def test_a_dead_replica_restarted_gets_its_users_back_and_serves_them_exactly() -> None:
    """After its core is killed, a replica's users are served by their next replica; :meth:`restart` starts a new
    core on the replica's device and puts it back on the ring: its users return to it, where their history is
    computed anew (it holds no KV), and every answer equals offline recompute."""
    served = Served(2)
    router, stream = served.router, make_stream(150, num_users=16, seed=83)
    victim = router.ring.route(stream[0].user_id)
    homes = [router.home_ring.route(r.user_id) for r in stream]

    async def run() -> list:
        outputs = await by_user(router, stream[:50], clients=8)
        with pytest.raises(ValueError, match="not dead"):
            await router.restart(victim)
        await kill_core(router, victim)
        outputs += await by_user(router, stream[50:100], clients=8)  # all on the other replica
        await router.restart(victim)
        return outputs + await by_user(router, stream[100:], clients=8)

    outputs = served.run_then_close(run())
    assert_exact(outputs, stream, offline=False)
    assert router.dead == set() and victim in router.ring and router.counts.restarts == 1
    for i, request in enumerate(stream):
        where = served.answered[request.request_id]
        assert where == ([1 - victim] if 50 <= i < 100 else [homes[i]]), (i, where)
    assert sum(home == victim for home in homes[100:]) > 0


def test_a_router_closed_and_started_again_puts_every_replica_back_on_the_ring() -> None:
    """A replica that died before :meth:`close` starts afresh with the others on the next :meth:`start` (it stayed in
    ``dead``, off the ring, until ``supervise`` restarted an engine already running): its users are served by it
    again, exactly."""
    served = Served(2)
    router, stream = served.router, make_stream(60, num_users=12, seed=89)
    victim = router.ring.route(stream[0].user_id)
    homes = [router.home_ring.route(r.user_id) for r in stream]

    async def run() -> list:
        outputs = await by_user(router, stream[:20], clients=4)
        await kill_core(router, victim)
        outputs += await by_user(router, stream[20:40], clients=4)  # all on the other replica
        assert router.dead == {victim} and victim not in router.ring
        await router.close()
        await router.start()
        assert router.dead == set() and sorted(router.ring.replicas) == [0, 1]
        return outputs + await by_user(router, stream[40:], clients=4)

    outputs = served.run_then_close(run())
    assert_exact(outputs, stream, offline=False)
    for i, request in enumerate(stream[40:], start=40):
        assert served.answered[request.request_id] == [homes[i]], (i, served.answered[request.request_id])
    assert victim in homes[40:]


def test_a_stalled_replica_is_off_the_ring_while_silent_and_back_once_it_reports() -> None:
    """A replica whose core is alive but stopped (SIGSTOP): a request it accepted before it was found silent gets its
    deadline error, once (never sent again); once its listing says ``"unresponsive"`` it is off the ring, its users
    are answered by their next replica within their deadline, exactly, and nothing more is sent to it; after SIGCONT
    it reports again, is back on the ring by itself (``"ready"``), and its users return to it."""
    config = replica_config()
    config = msgspec.structs.replace(config, serving=msgspec.structs.replace(config.serving, heartbeat_s=0.2,
                                                                             health_timeout_s=3.0))
    served = Served(3, config)
    router, stream = served.router, make_stream(150, num_users=18, seed=101)
    victim = router.home_ring.route(stream[0].user_id)
    engine = router.engines[victim]
    homes = [router.home_ring.route(r.user_id) for r in stream]
    nexts = [router.home_ring.preference(r.user_id, 2)[1] for r in stream]
    late = msgspec.structs.replace(stream[0], request_id="late")

    def listed() -> tuple[str, bool]:
        entry = router.replica_states()[victim]
        return entry["state"], entry["on_ring"]

    async def wait_for(state: tuple[str, bool]) -> None:
        deadline = time.monotonic() + 20
        while listed() != state:
            assert time.monotonic() < deadline, f"replica {victim} is {listed()}, not {state}"
            await asyncio.sleep(0.05)

    async def run() -> list:
        outputs = await by_user(router, stream[:50], clients=6)
        os.kill(engine.core_pid, signal.SIGSTOP)
        try:
            assert listed() == ("ready", True)  # not silent for long enough yet: it takes the request
            [timed_out] = await router.rank_many([late], timeout_ms=1000)
            assert timed_out.error == "deadline exceeded (1000 ms)", timed_out.error
            await wait_for(("unresponsive", False))
            assert router.unresponsive == {victim} and router.is_healthy() and router.state == "ready"
            with pytest.raises(ValueError, match="unresponsive"):
                router.resume(victim)
            sent = router.counts.requests[victim]
            outputs += await by_user(router, stream[50:100], clients=6, timeout_ms=10_000)
            assert router.counts.requests[victim] == sent  # nothing more went to the silent replica
        finally:
            os.kill(engine.core_pid, signal.SIGCONT)
        await wait_for(("ready", True))
        assert router.unresponsive == set() and router.dead == set()
        return outputs + await by_user(router, stream[100:], clients=6)

    outputs = served.run_then_close(run())
    assert_exact(outputs, stream, offline=False)
    for i, request in enumerate(stream):
        where = served.answered[request.request_id]
        assert where == ([nexts[i]] if 50 <= i < 100 and homes[i] == victim else [homes[i]]), (i, where)
    assert served.answered["late"] == [victim]  # its deadline error only: not resent, not answered after SIGCONT
    assert sum(home == victim for home in homes[50:100]) > 0 and sum(home == victim for home in homes[100:]) > 0
    assert router.counts.reroutes == sum(home == victim for home in homes[50:100]) and router.counts.retries == 0


class Silent:
    """A stand-in replica for :class:`ReplicaSet` whose health a test sets: ``silent`` (alive, not reporting) and
    ``alive``."""

    def __init__(self) -> None:
        self.config, self.observers = tiny_config(), []
        self.silent, self.alive = False, True

    async def start(self) -> Silent:
        return self

    async def close(self, timeout_s: float = 60.0) -> None:
        pass

    def is_alive(self) -> bool:
        return self.alive

    def is_healthy(self) -> bool:
        return self.alive and not self.silent

    @property
    def state(self) -> str:
        return "ready" if self.alive else "dead"

    core_pid = None


def test_silent_replicas_leave_the_ring_and_come_back_by_the_health_rule() -> None:
    """The ring follows ``reported_state``: a silent replica is off it, and on it again once it reports; a suspended
    one stays off; while none of the replicas that would take users reports, all of them stay on it; a silent one
    that dies is dead (as any dead one)."""
    engines = {i: Silent() for i in range(3)}
    replicas = replicas_module.ReplicaSet(tiny_config(), 3, engines=engines)
    asyncio.run(replicas.start())

    def on_ring() -> list[int]:
        replicas.replica_states()  # what /health lists: the ring is brought up to date first
        return sorted(replicas.ring.replicas)

    engines[1].silent = True
    assert on_ring() == [0, 2] and replicas.unresponsive == {1}
    assert [r["state"] for r in replicas.replica_states()] == ["ready", "unresponsive", "ready"]
    engines[1].silent = False
    assert on_ring() == [0, 1, 2] and replicas.unresponsive == set()

    engines[1].silent = True  # silent, then suspended: it stays off the ring when it reports again
    assert on_ring() == [0, 2]
    replicas.suspend(1)
    engines[1].silent = False
    assert on_ring() == [0, 2] and replicas.unresponsive == set()
    replicas.resume(1)
    assert on_ring() == [0, 1, 2]

    for engine in engines.values():  # none reports: no better replica to send users to, so all stay on
        engine.silent = True
    assert on_ring() == [0, 1, 2] and not replicas.is_healthy() and replicas.state == "ready"
    engines[2].silent = False  # one reports: the others are off until they do
    assert on_ring() == [2] and replicas.unresponsive == {0, 1} and replicas.is_healthy()
    engines[2].alive = False  # the one reporting dies: the silent ones are all there is, back on the ring
    assert on_ring() == [0, 1] and replicas.dead == {2} and replicas.unresponsive == set()
    engines[0].silent = False
    assert on_ring() == [0] and replicas.unresponsive == {1}
    engines[1].alive = False  # silent, then dead: dead
    assert on_ring() == [0] and replicas.dead == {1, 2} and replicas.unresponsive == set()


def test_an_added_replica_takes_over_only_the_users_the_ring_gives_it() -> None:
    """``add_replica`` starts a third core and puts it on the ring: afterwards the users the ring now gives it are
    served there (their history computed anew), every other user stays where it was, answers equal recompute."""
    served = Served(2)
    router, stream = served.router, make_stream(160, num_users=24, seed=89)
    before = [router.ring.route(r.user_id) for r in stream]

    async def run() -> list:
        outputs = await by_user(router, stream[:80], clients=8)
        assert await router.add_replica() == 2
        router.engines[2].observers.append(lambda output, kind, queue_s:
                                           served.answered.setdefault(output.request_id, []).append(2))
        return outputs + await by_user(router, stream[80:], clients=8)

    outputs = served.run_then_close(run())
    assert_exact(outputs, stream, offline=False)
    after = [router.ring.route(r.user_id) for r in stream]
    assert all(b == a or a == 2 for b, a in zip(before, after))  # only moves to the new replica
    moved = {r.user_id for r, a in zip(stream, after) if a == 2}
    assert 0 < len(moved) < 24 and router.devices == ["cpu"] * 3
    assert [router.home_ring.route(r.user_id) for r in stream] == after
    for i, request in enumerate(stream):
        assert served.answered[request.request_id] == [before[i] if i < 80 else after[i]], i
    assert router.counts.requests[2] == sum(a == 2 for a in after[80:])


def test_serve_with_two_replicas_gives_offline_scores_metrics_and_survives_one(tmp_path: Path) -> None:
    from .test_serving_msgpack import post_by_user

    server = Server(tmp_path, args=("--replicas", "2"))
    try:
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        assert health["status"] == "ok" and [r["state"] for r in health["replicas"]] == ["ready", "ready"]
        stream = make_stream(340, num_users=24, seed=79)
        before = metric_samples(server.url)
        responses = asyncio.run(post_by_user(f"{server.url}/v1/rank", stream[:240], lambda r: body([r]),
                                             {"content-type": "application/json"}, clients=12))
        responses += [httpx.post(f"{server.url}/v1/rank", content=body(stream[i:i + 10]), timeout=30)
                      for i in range(240, 300, 10)]  # bodies spanning users and replicas
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
        outputs = [o for r in responses for o in r.json()["outputs"]]
        offline = GREngine(tiny_config(num_gpu_pages=96)).rank(stream[:300], use_tqdm=False)
        references = recompute_scores(stream)
        for request, output, reference, cached in zip(stream[:300], outputs, references[:300], offline, strict=True):
            assert output["error"] is None and output["request_id"] == request.request_id
            scores = np.array(output["scores"], dtype=np.float32)
            np.testing.assert_allclose(scores, reference, atol=TOL, rtol=0)
            np.testing.assert_allclose(scores, cached.scores, atol=TOL, rtol=0)
        after = metric_samples(server.url)

        def delta(name: str, **labels: str) -> float:
            return total(after, name, **labels) - total(before, name, **labels)

        routed = [delta("gr_engine_router_requests_total", replica=r) for r in ("0", "1")]
        assert min(routed) > 0 and sum(routed) == 300, routed
        assert delta("gr_engine_router_reroutes_total") == delta("gr_engine_router_retries_total") == 0
        assert delta("gr_engine_requests_total", outcome="ok") == 300
        for replica in ("0", "1"):  # each replica's core figures, under its own label
            assert delta("gr_engine_step_seconds_count", replica=replica) > 0
            assert delta("gr_engine_computed_tokens_total", replica=replica) > 0
        assert delta("gr_engine_step_seconds_count") == sum(delta("gr_engine_step_seconds_count", replica=r)
                                                            for r in ("0", "1"))

        os.kill(health["replicas"][0]["core_pid"], signal.SIGKILL)  # one replica dies: the other serves all
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200
        states = [(r["state"], r["on_ring"]) for r in health.json()["replicas"]]
        assert states[1] == ("ready", True) and states[0] in (("dead", False), ("ready", True))  # (restarted?)
        responses = [httpx.post(f"{server.url}/v1/rank", content=body(stream[i:i + 10]), timeout=30)
                     for i in range(300, 320, 10)]
        deadline = time.monotonic() + 60  # the server starts a new core for the dead replica
        while [r["on_ring"] for r in httpx.get(f"{server.url}/health", timeout=10).json()["replicas"]] != [True, True]:
            assert time.monotonic() < deadline, "the dead replica was not restarted"
            time.sleep(0.2)
        restarted = metric_samples(server.url)
        responses += [httpx.post(f"{server.url}/v1/rank", content=body(stream[i:i + 10]), timeout=30)
                      for i in range(320, 340, 10)]
        outputs = [o for r in responses for o in r.json()["outputs"]]
        for output, reference in zip(outputs, references[300:], strict=True):
            assert output["error"] is None, output["error"]
            np.testing.assert_allclose(np.array(output["scores"], dtype=np.float32), reference, atol=TOL, rtol=0)
        final = metric_samples(server.url)
        assert total(final, "gr_engine_router_restarts_total") == 1
        retries = total(final, "gr_engine_router_retries_total")
        sent = [total(final, "gr_engine_router_requests_total", replica=r) - total(
            after, "gr_engine_router_requests_total", replica=r) for r in ("0", "1")]
        assert sum(sent) == 40 + retries
        homed = sum(server_replica == 0 for server_replica in home_replicas(stream[320:340], 2))
        assert total(final, "gr_engine_router_requests_total", replica="0") - total(
            restarted, "gr_engine_router_requests_total", replica="0") == homed > 0  # its users are back on it
    finally:
        assert server.stop() == 0


def test_replicas_with_several_api_servers_is_refused() -> None:
    result = subprocess.run([sys.executable, "-m", "gr_engine", "serve", "--replicas", "2", "--api-servers", "2"],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2 and "cannot be combined with --api-servers" in result.stderr, result.stderr


def test_a_request_whose_retry_fails_too_gets_a_clear_error() -> None:
    served = Served(2)
    router, [request] = served.router, make_stream(1, seed=97)
    home, nxt = router.home_ring.preference(request.user_id, 2)
    for engine in router.engines.values():
        os.kill(engine.core_pid, signal.SIGSTOP)

    async def run():
        call = asyncio.create_task(router.rank(request))
        deadline = time.monotonic() + 30
        for replica in (home, nxt):  # each accepts the request, then dies without answering
            while not router.engines[replica].num_pending:
                assert time.monotonic() < deadline and not call.done(), f"replica {replica} never got the request"
                await asyncio.sleep(0.01)
            os.kill(router.engines[replica].core_pid, signal.SIGKILL)
        return await call

    try:
        output = served.run(run())
        assert output.request_id == request.request_id and output.scores.shape == (0, 0)
        assert f"replica {home} died before answering" in output.error
        assert f"the retry on replica {nxt} failed too" in output.error
        assert router.counts.retries == 1 and router.dead == {home, nxt}
        assert router.state == "dead" and not router.is_healthy()
        with pytest.raises(router_module.EngineDead, match="no replica is alive"):
            served.run(router.rank(request))
    finally:
        served.close()
