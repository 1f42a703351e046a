"""msgpack bodies of ``gr-engine serve`` (docs/serving.md, "Body formats"), against a subprocess on 127.0.0.1: raw
int64 arrays and plain msgpack arrays give the scores of JSON bodies and of offline ``GREngine.rank``; a malformed
body is a 400; a raw field of the wrong size or dtype is that request's error while its batch-mates are served."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from gr_engine import GREngine, RankRequest

from .conftest import tiny_config
from .test_serving import TOL, Server, make_stream, metric_samples, recompute_scores, total

httpx = pytest.importorskip("httpx")

MSGPACK = "application/msgpack"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("serve-msgpack"), "serving.max_pending_requests=64")
    yield srv
    assert srv.stop() == 0


def packed(request: RankRequest, raw: bool = True) -> dict:
    """A request's msgpack fields: integer arrays as little-endian int64 bytes (``raw``) or msgpack arrays."""
    fields = msgspec.structs.asdict(request)
    for name in ("item_ids", "action_ids", "timestamps", "candidate_item_ids"):
        fields[name] = np.asarray(fields[name], dtype="<i8").tobytes() if raw else list(fields[name])
    return fields


def as_user(requests: list[RankRequest], offset: int) -> list[RankRequest]:
    """The stream for other users (``user_id + offset``): each body format gets users of its own."""
    return [msgspec.structs.replace(r, user_id=r.user_id + offset) for r in requests]


def scores_of(output: dict) -> np.ndarray:
    """A ranking output's scores from a JSON answer (nested lists) or a msgpack one (float32 bytes and shape)."""
    if isinstance(output["scores"], bytes):
        return np.frombuffer(output["scores"], dtype="<f4").reshape(output["scores_shape"])
    return np.array(output["scores"], dtype=np.float32)


async def post_by_user(url: str, requests: list[RankRequest], encode, headers: dict[str, str],
                       clients: int) -> list[httpx.Response]:
    """POST ``encode(request)`` of each request from ``clients`` concurrent connections, each user's requests in
    stream order by one client; responses in request order."""
    responses: list[httpx.Response | None] = [None] * len(requests)
    users = sorted({r.user_id for r in requests}, key=str)
    async with httpx.AsyncClient(timeout=60) as client:
        async def worker(mine: set) -> None:
            for i, request in enumerate(requests):
                if request.user_id in mine:
                    responses[i] = await client.post(url, content=encode(request), headers=headers)
        await asyncio.gather(*(worker(set(users[k::clients])) for k in range(clients)))
    return responses


def test_msgpack_bodies_give_json_and_offline_scores(server: Server) -> None:
    stream = make_stream(90, seed=41)
    url = f"{server.url}/v1/rank"
    ways = {  # body, headers, users of its own
        "json": (lambda r: msgspec.json.encode({"requests": [r]}), {"content-type": "application/json"}),
        "raw": (lambda r: msgspec.msgpack.encode({"requests": [packed(r)]}),
                {"content-type": MSGPACK, "accept": MSGPACK}),
        "arrays": (lambda r: msgspec.msgpack.encode({"requests": [packed(r, raw=False)]}),
                   {"content-type": "application/x-msgpack"}),  # no Accept: answered in msgpack too
        "raw-json-answer": (lambda r: msgspec.msgpack.encode({"requests": [packed(r)]}),
                            {"content-type": MSGPACK, "accept": "application/json"}),
    }
    reference = recompute_scores(stream)
    offline = GREngine(tiny_config(num_gpu_pages=96)).rank(stream, use_tqdm=False)
    served = {}
    for k, (name, (encode, headers)) in enumerate(ways.items()):
        requests = as_user(stream, 1000 * (k + 1))
        responses = asyncio.run(post_by_user(url, requests, encode, headers, clients=6))
        outputs = []
        for response in responses:
            assert response.status_code == 200, response.text
            expected = "application/json" if name in ("json", "raw-json-answer") else MSGPACK
            assert response.headers["content-type"].startswith(expected)
            decode = msgspec.json.decode if expected == "application/json" else msgspec.msgpack.decode
            [output] = decode(response.content)["outputs"]
            assert output["error"] is None, output["error"]
            outputs.append(scores_of(output))
        served[name] = outputs
    for i, (ref, cached) in enumerate(zip(reference, offline)):
        for name in ways:
            assert served[name][i].dtype == np.float32 and served[name][i].shape == ref.shape
            np.testing.assert_allclose(served[name][i], ref, atol=TOL, rtol=0)
            np.testing.assert_allclose(served[name][i], cached.scores, atol=TOL, rtol=0)
            np.testing.assert_allclose(served[name][i], served["json"][i], atol=TOL, rtol=0)


def test_msgpack_generate_equals_json(server: Server) -> None:
    stream = as_user(make_stream(6, seed=43), 9000)
    requests = [{k: v for k, v in packed(r).items() if k != "candidate_item_ids"} for r in stream]
    params = {"top_k": 5, "exclude_history": True}
    as_msgpack = httpx.post(f"{server.url}/v1/generate", timeout=30, headers={"content-type": MSGPACK},
                            content=msgspec.msgpack.encode({"requests": requests, "params": params}))
    as_json = httpx.post(f"{server.url}/v1/generate", timeout=30,
                         content=msgspec.json.encode({"requests": stream, "params": params}))
    assert as_msgpack.status_code == as_json.status_code == 200
    packed_outputs = msgspec.msgpack.decode(as_msgpack.content)["outputs"]
    json_outputs = as_json.json()["outputs"]
    for a, b in zip(packed_outputs, json_outputs, strict=True):
        assert a["error"] is None and b["error"] is None and len(a["item_ids"]) == 5
        assert a["item_ids"] == b["item_ids"]
        np.testing.assert_allclose(a["scores"], b["scores"], atol=TOL, rtol=0)


def test_malformed_msgpack_is_400(server: Server) -> None:
    url = f"{server.url}/v1/rank"
    good = msgspec.msgpack.encode({"requests": [packed(make_stream(1, seed=47)[0])]})
    headers = {"content-type": MSGPACK}
    for content in (b"\xc1", good[:-3], msgspec.json.encode({"requests": []}), msgspec.msgpack.encode({"reqs": []}),
                    msgspec.msgpack.encode({"requests": 3}), msgspec.msgpack.encode([1, 2]), good + b"\x00"):
        response = httpx.post(url, content=content, headers=headers, timeout=10)
        assert response.status_code == 400, (content, response.text)
        assert response.headers["content-type"].startswith(MSGPACK)
        assert "invalid body" in msgspec.msgpack.decode(response.content)["error"]
    assert httpx.post(url, content=good, headers=headers, timeout=10).status_code == 200


def test_bad_raw_field_is_that_requests_error(server: Server) -> None:
    good = as_user(make_stream(4, seed=53), 7000)
    mixed = [
        packed(good[0]),
        {**packed(good[1]), "item_ids": b"\x01" * 12},  # not a whole number of int64 values
        {**packed(good[1]), "item_ids": np.asarray(good[1].item_ids, dtype="<i4").tobytes()},  # int32
        {**packed(good[1]), "candidate_item_ids": (np.asarray(good[1].candidate_item_ids, dtype="<f8") + 1).tobytes()},
        {**packed(good[1]), "timestamps": "abc"},
        {**packed(good[1]), "action_ids": packed(good[1])["action_ids"][8:]},  # one event short
        7,
        packed(good[2], raw=False),
        packed(good[3]),
    ]
    before = metric_samples(server.url)
    response = httpx.post(f"{server.url}/v1/rank", content=msgspec.msgpack.encode({"requests": mixed}),
                          headers={"content-type": MSGPACK}, timeout=30)
    assert response.status_code == 200, response.text
    outputs = msgspec.msgpack.decode(response.content)["outputs"]
    assert [o["error"] is None for o in outputs] == [True, False, False, False, False, False, False, True, True]
    assert "not a whole number of little-endian int64" in outputs[1]["error"]
    assert "item_ids" in outputs[2]["error"] and "differ in length" in outputs[5]["error"]
    assert "candidate_item_ids" in outputs[3]["error"] and "timestamps" in outputs[4]["error"]
    assert [o["request_id"] for o in outputs] == ["r0", "r1", "r1", "r1", "r1", "r1", "request-6", "r2", "r3"]
    assert all(o["scores"] == b"" and o["scores_shape"] == [0, 0] for o in outputs if o["error"] is not None)
    for output, reference in zip([outputs[0], outputs[7], outputs[8]],
                                 recompute_scores([good[0], good[2], good[3]])):
        np.testing.assert_allclose(scores_of(output), reference, atol=TOL, rtol=0)
    after = metric_samples(server.url)
    assert total(after, "gr_engine_request_errors_total", kind="invalid") - total(
        before, "gr_engine_request_errors_total", kind="invalid") == 6
    assert total(after, "gr_engine_requests_total", outcome="ok") - total(
        before, "gr_engine_requests_total", outcome="ok") == 3


def test_load_generator_sends_the_documented_msgpack_body() -> None:
    """The load generator's msgpack body is the one documented: raw int64 arrays (what :func:`packed` builds)."""
    from gr_engine.serving.load_http import rank_body

    request = make_stream(1, seed=59)[0]
    assert msgspec.msgpack.decode(rank_body([request], 5.0, body="msgpack")) == {
        "requests": [packed(request)], "timeout_ms": 5.0}
