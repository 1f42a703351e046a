"""The cache's eviction counters in the core's reports (``CoreStats``) and on ``/metrics`` (``gr_engine_*_total``):
they are the engine's own ``kv.stats`` after a stream whose tiny GPU pool and host tier force GPU evictions, host
evictions, lost tokens and deferred offloads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from gr_engine import GREngine

from .conftest import tiny_config
from .test_serving import Server, make_stream, metric_samples

httpx = pytest.importorskip("httpx")
zmq = pytest.importorskip("zmq")
parser = pytest.importorskip("prometheus_client.parser")

from gr_engine.serving.protocol import CACHE_COUNTERS, CoreReport, CoreStats  # noqa: E402

#: GPU pages for about one and a half of the stream's longest histories, host chunks for 128 tokens: the stream
#: below evicts users from both tiers, loses tokens and defers offloads (checked: every counter is positive).
CONFIG = tiny_config(mode="hierarchical", num_gpu_pages=96, host_chunks=8)
#: Counters the stream must move (so that a core or server that does not report them fails).
FORCED = ("evicted_users", "evicted_tokens", "host_evicted_users", "lost_tokens", "tail_persisted_tokens",
          "deferred_offloads", "prefetched_tokens", "onloaded_tokens", "offloaded_tokens")


def stream() -> list:
    return make_stream(60, seed=5)


def replayed() -> GREngine:
    """An engine that served :func:`stream` one request at a time, as a client awaiting each answer sends it."""
    engine = GREngine(CONFIG)
    for request in stream():
        engine.rank([request], use_tqdm=False)
    return engine


def expected_totals(engine: GREngine) -> dict[str, int]:
    """What the core reports of ``engine``: its cache counters, finished requests and their history tokens."""
    cache = engine.kv.stats
    return {**{name: getattr(cache, name) for name in CACHE_COUNTERS},
            "finished_requests": engine.stats.num_requests, "history_tokens": engine.stats.history_tokens}


def test_core_stats_carry_the_cache_counters() -> None:
    """The core's stats are the engine's ``kv.stats`` and totals, survive the report's msgpack round trip, and reach
    ``/metrics`` as ``gr_engine_<name>_total`` counters with help texts."""
    from gr_engine.serving import core as core_module
    from gr_engine.serving.metrics import ServingMetrics

    context = zmq.Context()
    inputs = context.socket(zmq.ROUTER)
    try:
        engine = replayed()
        expected = expected_totals(engine)
        assert all(expected[name] > 0 for name in FORCED), expected
        stats = core_module.EngineCore(engine, inputs, context)._stats()
        assert {name: getattr(stats, name) for name in expected} == expected
        wire = msgspec.msgpack.encode(CoreReport(outputs=[], stats=stats, state="ready"))
        decoded = msgspec.msgpack.decode(wire, type=CoreReport).stats
        assert decoded == stats
        text = ServingMetrics(SimpleNamespace(stats=decoded, observers=[])).render().decode()
    finally:
        inputs.close(linger=0)
        context.term()
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for name, value in expected.items():
        family = families[f"gr_engine_{name}"]
        assert family.type == "counter" and len(family.documentation) > 10, family
        assert [(s.name, s.value) for s in family.samples] == [(f"gr_engine_{name}_total", value)]


def test_an_older_cores_stats_still_decode() -> None:
    """A report from a core without the cache counters (its stats array ends before them) decodes, with 0s."""
    stats = CoreStats(running=1, waiting=2, steps=3, step_seconds=0.5, step_buckets=[1, 2], computed_tokens=4,
                      gpu_hit_tokens=5, host_hit_tokens=6, gpu_pages_used=7, gpu_pages_free=8, host_bytes_used=9,
                      onloaded_bytes=10, offloaded_bytes=11, kernel_compilations=0, kernel_cache_loads=0,
                      graph_captures=0, queue_wait_s=0.25, service_s=0.125, evicted_users=12, lost_tokens=13)
    fields = msgspec.to_builtins(stats)
    old = fields[:CoreStats.__struct_fields__.index("finished_requests")]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode([[], old, "ready"]), type=CoreReport).stats
    assert decoded.service_s == 0.125 and decoded.onloaded_bytes == 10
    assert decoded.evicted_users == decoded.lost_tokens == decoded.finished_requests == 0
    assert msgspec.msgpack.decode(msgspec.msgpack.encode([[], fields, "ready"]), type=CoreReport).stats == stats


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("serve-cache"), config=CONFIG)
    yield srv
    assert srv.stop() == 0


def test_metrics_equal_the_engines_cache_counters(server: Server, tmp_path: Path) -> None:
    """Served one request at a time over HTTP, the stream leaves ``/metrics`` with the cache counters of an engine
    that served it the same way offline (the engine's steps and evictions do not depend on where it runs)."""
    before = metric_samples(server.url)
    assert all(before.get((f"gr_engine_{name}_total", ()), 0.0) == 0 for name in CACHE_COUNTERS)
    for request in stream():
        response = httpx.post(f"{server.url}/v1/rank", content=msgspec.json.encode({"requests": [request]}),
                              timeout=60)
        assert response.status_code == 200 and response.json()["outputs"][0]["error"] is None
    after = metric_samples(server.url)
    expected = expected_totals(replayed())
    served = {name: after[(f"gr_engine_{name}_total", ())] for name in expected}
    assert served == {name: float(value) for name, value in expected.items()}
    assert all(served[name] > 0 for name in FORCED), served
