"""Misuse of the Python APIs: each gets a clear exception or a per-request ``error``, and leaves the engine serving
later requests with ``recompute``'s scores."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from gr_engine import EngineConfig, GenerateParams, GREngine, RankRequest
from tests.conftest import tiny_config, with_cache

pytest.importorskip("zmq")
AsyncGREngine = pytest.importorskip("gr_engine.serving.client").AsyncGREngine
ReplicaRouter = pytest.importorskip("gr_engine.serving.router").ReplicaRouter


def request(request_id: str, user: int, n: int) -> RankRequest:
    """User ``user``'s first ``n`` events (the same events on every visit), ranking three candidates."""
    rng = np.random.default_rng(user)
    return RankRequest(request_id=request_id, user_id=user, item_ids=rng.integers(0, 200, n).tolist(),
                       action_ids=rng.integers(0, 8, n).tolist(), timestamps=list(range(n)),
                       candidate_item_ids=[3, 1, 4])


def serving_config() -> EngineConfig:
    """The tiny config for a client's own core, without warm-up (seconds to start on CPU)."""
    config = tiny_config(num_gpu_pages=96)
    return msgspec.structs.replace(config, serving=msgspec.structs.replace(config.serving, warmup=False))


def assert_recomputed(outputs, requests) -> None:
    """Each output is ``recompute``'s for its request (float32 within 1e-5)."""
    reference = GREngine(with_cache(tiny_config(), mode="recompute")).rank(requests, use_tqdm=False)
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    for output, expected in zip(outputs, reference, strict=True):
        assert output.error is None and expected.error is None
        np.testing.assert_allclose(output.scores, expected.scores, rtol=0, atol=1e-5)


def test_rank_keeps_the_outputs_of_add_request_requests_it_stepped():
    engine = GREngine(tiny_config())
    added = [request("a1", 1, 8), request("a2", 1, 12)]  # one user: two steps, the second after rank's own
    for r in added:
        engine.add_request(r)
    ranked = [request("b", 2, 8)]
    assert_recomputed(engine.rank(ranked, use_tqdm=False), ranked)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert_recomputed(outputs, added)


def test_step_while_a_launched_step_is_unfinished_is_refused_before_launching():
    engine = GREngine(tiny_config())
    first = [request("a", 1, 8)]
    engine.add_request(first[0])
    launched = engine.launch_step()
    later = [request("b", 2, 8)]
    engine.add_request(later[0])
    with pytest.raises(RuntimeError, match="finish_step"):
        engine.step()
    assert_recomputed(engine.finish_step(launched), first)
    assert_recomputed(engine.step(), later)  # its step was not launched and lost: the engine goes on
    assert not engine.has_unfinished_requests()
    again = [request("c", 3, 8)]
    assert_recomputed(engine.rank(again, use_tqdm=False), again)


def test_abort_waiting_refuses_a_string_of_ids():
    engine = GREngine(tiny_config())
    waiting = [request("a", 1, 8), request("b", 2, 8), request("ab", 3, 8)]
    engine.add_requests(waiting)
    with pytest.raises(TypeError, match="collection"):
        engine.abort_waiting("ab", "aborted")  # not ids "a" and "b"
    assert [o.request_id for o in engine.abort_waiting(["ab"], "aborted")] == ["ab"]
    assert_recomputed(engine.step(), waiting[:2])


def test_a_started_client_refuses_a_second_start_and_serves_once_started_again():
    engine = AsyncGREngine(serving_config())
    first, second, third = [request("a", 1, 8)], [request("b", 1, 12)], [request("c", 1, 16)]

    async def serve(requests: list[RankRequest], start_twice: bool = False) -> list:
        async with engine:
            if start_twice:
                with pytest.raises(RuntimeError, match="close"):
                    await engine.start()  # (it started a second core, and the client went back to "starting")
            return await engine.rank_many(requests)

    async def twice() -> None:
        assert_recomputed(await serve(first, start_twice=True), first)
        assert_recomputed(await serve(second), second)  # started again after close (the same event loop)

    asyncio.run(twice())
    assert_recomputed(asyncio.run(serve(third)), third)  # and on another event loop


def test_generate_params_changed_in_python_fail_their_requests_not_the_core():
    fractional = GenerateParams(top_k=2)
    fractional.top_k = 1.5  # (not checked on assignment)
    later = [request("b", 2, 12)]

    async def serve() -> None:
        async with AsyncGREngine(serving_config()) as engine:
            for params, error in ((fractional, "top_k must be an integer"), ({"top_k": 2}, "must be a GenerateParams")):
                [output] = await engine.generate_many([request("a", 1, 8)], params)
                assert output.request_id == "a" and error in output.error
            assert_recomputed(await engine.rank_many(later), later)  # the core was not killed by a message

    asyncio.run(serve())


def test_a_started_router_refuses_a_second_start_and_an_iterator_and_keeps_serving():
    served = [request("a", 1, 8), request("b", 2, 8)]

    async def serve() -> list:
        async with ReplicaRouter(serving_config(), 2) as router:
            with pytest.raises(RuntimeError, match="close"):
                await router.start()  # (it closed every replica: "the router is not started")
            with pytest.raises(TypeError, match="sequence"):
                await router.rank_many(iter(served))  # (routing consumed it: "Set of Tasks/Futures is empty")
            return await router.rank_many(served)

    assert_recomputed(asyncio.run(serve()), served)


def test_an_object_that_is_not_a_request_is_labelled_by_its_keys():
    valid = request("ok", 1, 8)
    call = [{"request_id": "d", "user_id": 7}, None, valid, {"user_id": True}]

    def assert_labelled(outputs: list) -> None:
        assert [(o.request_id, o.user_id) for o in outputs] == [("d", 7), ("", None), ("ok", 1), ("", None)]
        assert all("expected a RankRequest" in o.error for o in outputs[:2] + outputs[3:])
        assert_recomputed(outputs[2:3], [valid])

    assert_labelled(GREngine(tiny_config()).rank(call, use_tqdm=False))

    async def serve() -> None:
        async with AsyncGREngine(serving_config()) as engine:
            assert_labelled(await engine.rank_many(call, ))
        async with ReplicaRouter(serving_config(), 2) as router:
            assert_labelled(await router.rank_many(call))

    asyncio.run(serve())
