"""The strongest check: caching never changes a score.

Random streams of returning users (new events between visits, occasional rewritten history, replayed
older visits) run through ``gpu_only`` and ``unlimited`` engines with pools small enough to evict every
few steps; every score must equal the ``recompute`` engine's within 1e-5 (float32, CPU).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gr_engine import GenerateParams, GREngine
from gr_engine.step_results import ScoreFetch
from gr_engine.synthetic import synthetic_requests
from tests.conftest import tiny_config, with_cache


def stream(config, num_users, visits, seed, rewrite_prob=0.05, replay_prob=0.05):
    requests = synthetic_requests(config.model, num_users, visits, first_history=(0, 120), new_events=(0, 24),
                                  num_candidates=(1, 12), rewrite_prob=rewrite_prob, seed=seed)
    rng = np.random.default_rng(seed)
    seen: dict = {}
    out = []
    for i, r in enumerate(requests):  # occasionally replay an older visit of the user (a shorter history)
        if r.user_id in seen and rng.random() < replay_prob:
            old = seen[r.user_id]
            out.append(msgspec.structs.replace(old, request_id=f"{old.request_id}-replay{i}"))
        seen.setdefault(r.user_id, r)
        out.append(r)
    return out


def max_diff(a, b) -> float:
    assert len(a) == len(b)
    worst = 0.0
    for x, y in zip(a, b):
        assert x.error is None and y.error is None, (x.error, y.error)
        assert x.request_id == y.request_id
        worst = max(worst, float(np.abs(np.asarray(x.scores) - np.asarray(y.scores)).max()))
    return worst


@pytest.fixture(scope="module")
def long_stream():
    """~2,500 requests from 40 returning users, and their scores under recompute."""
    config = tiny_config(max_num_seqs=4, max_num_batched_tokens=96)
    requests = stream(config, num_users=40, visits=60, seed=7)
    return config, requests, GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)


@pytest.mark.parametrize("mode,pages,host_chunks", [
    ("gpu_only", 160, 0), pytest.param("gpu_only", 400, 0, marks=pytest.mark.slow), ("hierarchical", 160, 24),
    ("hierarchical", 160, 800),
    ("unlimited", 4000, 0),
])
def test_cached_modes_equal_recompute_over_thousands_of_requests(long_stream, mode, pages, host_chunks):
    _, requests, expected = long_stream
    assert len(requests) > 2000
    engine = GREngine(with_cache(tiny_config(max_num_seqs=4, max_num_batched_tokens=96, host_chunks=host_chunks),
                                 mode=mode, num_gpu_pages=pages))
    # Split the stream over several rank() calls: the cache persists across calls, as across visits.
    outputs = []
    for part in np.array_split(np.arange(len(requests)), 5):
        outputs += engine.rank([requests[i] for i in part], use_tqdm=False)
    assert max_diff(outputs, expected) <= 1e-5
    kv = engine.kv.stats
    assert kv.truncated_tokens > 0  # rewritten or replayed histories were detected
    if mode == "gpu_only":
        assert kv.evicted_users > engine.stats.num_steps // 5  # an eviction every few steps
        assert engine.stats.total_hit_ratio > (0.03 if pages == 160 else 0.1)
    elif mode == "hierarchical":  # GPU eviction, onload and (with the small pool) host eviction
        assert kv.evicted_users > engine.stats.num_steps // 5 and kv.onloaded_tokens > 0
        assert sum(o.num_host_cached_tokens for o in outputs) == kv.onloaded_tokens
        assert engine.stats.host_hit_tokens == kv.onloaded_tokens
        if host_chunks == 24:
            assert kv.host_evicted_users > engine.stats.num_steps // 20
        else:
            assert engine.stats.total_hit_ratio > 0.8 > 0.3 > engine.stats.gpu_hit_ratio
    else:
        assert kv.evicted_users == 0 and engine.stats.total_hit_ratio > 0.85
    engine.kv.check_invariants()


RANDOM_CONFIGURATIONS = given(
    seed=st.integers(0, 10_000), page_size=st.sampled_from([1, 3, 4, 8]), max_num_seqs=st.integers(1, 6),
    budget=st.integers(13, 80), slack=st.integers(0, 80), mode=st.sampled_from(["gpu_only", "hierarchical"]),
    chunk_pages=st.integers(1, 5), host_chunks=st.integers(0, 40), max_pending=st.integers(1, 4),
    persist_tails=st.booleans(), prefetch=st.booleans(), call=st.integers(1, 9), retrieval=st.booleans())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@RANDOM_CONFIGURATIONS
def test_random_configurations_equal_recompute(**draw):
    check_random_configuration(**draw)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@RANDOM_CONFIGURATIONS
def test_many_random_configurations_equal_recompute(**draw):
    check_random_configuration(**draw)


def check_random_configuration(seed, page_size, max_num_seqs, budget, slack, mode, chunk_pages, host_chunks,
                               max_pending, persist_tails, prefetch, call, retrieval):
    """Random cache configurations, served ``call`` requests at a time (each call prefetches, with ``prefetch``),
    ranking or retrieval (``generate``, whose last history token is always recomputed)."""
    config = tiny_config(page_size=page_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_history_len=160, chunk_pages=chunk_pages, host_chunks=host_chunks)
    requests = stream(config, num_users=6, visits=8, seed=seed, rewrite_prob=0.1, replay_prob=0.1)
    params = GenerateParams(top_k=3) if retrieval else None
    if retrieval:
        requests = [r for r in requests if len(r.item_ids) > 0]

    def serve(engine, part):
        return engine.generate(part, params, use_tqdm=False) if retrieval else engine.rank(part, use_tqdm=False)

    min_pages = -(-160 // page_size)
    expected = serve(GREngine(with_cache(config, mode="recompute", num_gpu_pages=min_pages)), requests)
    engine = GREngine(with_cache(config, mode=mode, num_gpu_pages=min_pages + slack,
                                 max_pending_offloads=max_pending, persist_tails=persist_tails, prefetch=prefetch))
    got = [o for i in range(0, len(requests), call) for o in serve(engine, requests[i:i + call])]
    assert max_diff(got, expected) <= 1e-5
    engine.kv.check_invariants()


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_equals_recompute_over_thousands_of_requests(long_stream, prefetch):
    """Users loaded from host as their requests arrive (``prefetch``, or not), under a small GPU pool: the same
    scores as recompute, and the prefetch's onloads are counted as host hits."""
    _, requests, expected = long_stream
    engine = GREngine(with_cache(tiny_config(max_num_seqs=4, max_num_batched_tokens=96, host_chunks=800),
                                 mode="hierarchical", num_gpu_pages=160, prefetch=prefetch))
    outputs = []
    for part in np.array_split(np.arange(len(requests)), 40):  # many rank() calls: each one prefetches
        outputs += engine.rank([requests[i] for i in part], use_tqdm=False)
    assert max_diff(outputs, expected) <= 1e-5
    kv = engine.kv.stats
    assert kv.onloaded_tokens > 0 and engine.stats.host_hit_tokens > 0
    assert (kv.prefetched_tokens > 0) == prefetch
    # every byte moved, prefetches' included, is in some step's metrics
    assert engine.stats.onloaded_bytes == kv.onloaded_bytes and engine.stats.offloaded_bytes == kv.offloaded_bytes
    engine.kv.check_invariants()


def test_generate_with_prefetch_equals_recompute():
    """``generate`` (the last history token always recomputed) in calls of four requests, each prefetching, under a
    small pool: the prefetched pages must match what was loaded."""
    config = tiny_config(max_num_seqs=4, host_chunks=400)
    requests = [r for r in stream(config, 30, 10, seed=3) if len(r.item_ids) > 0]
    params = GenerateParams(top_k=7)
    expected = GREngine(with_cache(config, mode="recompute")).generate(requests, params, use_tqdm=False)
    engine = GREngine(with_cache(config, mode="hierarchical", num_gpu_pages=130, prefetch=True))
    outputs = [o for i in range(0, len(requests), 4) for o in engine.generate(requests[i:i + 4], params,
                                                                              use_tqdm=False)]
    for out, ref in zip(outputs, expected, strict=True):
        assert out.error is None and out.item_ids == ref.item_ids
        np.testing.assert_allclose(out.scores, ref.scores, atol=1e-5, rtol=0)
    assert engine.kv.stats.prefetched_tokens > 0
    engine.kv.check_invariants()


def test_a_prefetched_user_whose_requests_are_all_refused_is_not_left_locked():
    """The prefetch runs before validation: when every request of the call is refused, no step follows, and the
    prefetched record is handed back at once (not left locked, holding pages nobody may evict)."""
    config = tiny_config(max_num_seqs=4, host_chunks=400)
    engine = GREngine(with_cache(config, mode="hierarchical", num_gpu_pages=60, prefetch=True))
    requests = stream(config, num_users=6, visits=3, seed=2)
    engine.rank(requests, use_tqdm=False)
    on_host = [u for u, r in engine.kv.users.items() if r.host_tokens and not r.num_pages]
    assert on_host
    user = on_host[0]
    bad = next(r for r in requests if r.user_id == user)
    bad = msgspec.structs.replace(bad, request_id="refused", candidate_item_ids=np.array([-5]))
    out, = engine.rank([bad], use_tqdm=False)
    assert out.error is not None and engine.kv.stats.prefetched_tokens > 0
    record = engine.kv.users[user]
    assert record.num_pages and not record.locked
    engine.kv.check_invariants()


def test_generate_equals_recompute():
    config = tiny_config(max_num_seqs=4)
    requests = [r for r in stream(config, 20, 10, seed=3) if len(r.item_ids) > 0]
    params = GenerateParams(top_k=7)
    expected = GREngine(with_cache(config, mode="recompute")).generate(requests, params, use_tqdm=False)
    engine = GREngine(with_cache(config, num_gpu_pages=300))
    outputs = engine.generate(requests, params, use_tqdm=False)
    for out, ref, req in zip(outputs, expected, requests):
        assert out.error is None and out.item_ids == ref.item_ids and len(out.item_ids) == 7
        np.testing.assert_allclose(out.scores, ref.scores, atol=1e-5, rtol=0)
        assert not set(out.item_ids) & set(req.item_ids)  # exclude_history
    assert engine.stats.gpu_hit_ratio > 0.3


def test_corrupted_cache_is_caught_by_the_differential_check():
    """Negative control: if cached KV were wrong, the comparison with recompute would fail."""
    config = tiny_config()
    requests = stream(config, 4, 3, seed=1, rewrite_prob=0, replay_prob=0)
    requests = [r for r in requests if len(r.item_ids) > 8]
    first, later = requests[:4], requests[4:]
    engine = GREngine(config)
    engine.rank(first, use_tqdm=False)
    engine.kv.kv_cache.add_(0.01)  # tamper with every cached page
    expected = GREngine(with_cache(config, mode="recompute")).rank(later, use_tqdm=False)
    with pytest.raises(AssertionError):
        assert max_diff(engine.rank(later, use_tqdm=False), expected) <= 1e-5


def test_streaming_api_matches_batch_api():
    config = tiny_config()
    requests = stream(config, 8, 5, seed=11)
    expected = GREngine(config).rank(requests, use_tqdm=False)
    engine = GREngine(config)
    outputs = {}
    for r in requests:
        engine.add_request(r)
        for out in engine.step():
            outputs[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert max_diff([outputs[r.request_id] for r in requests], expected) <= 1e-5


def rank_launching_ahead(engine, requests, seed=3):
    """Serve ``requests`` through ``launch_step`` / ``finish_step`` as an async core would, with random arrivals
    between launches and up to 3 steps launched and unfinished; returns the outputs in request order and how many
    steps were launched while another was unfinished."""
    rng = np.random.default_rng(seed)
    outputs, launched, sent, overlapped = {}, [], 0, 0
    while sent < len(requests) or engine.has_unfinished_requests():
        for r in requests[sent: sent + int(rng.integers(0, 4))]:
            engine.add_request(r)
            sent += 1
        if engine.scheduler.num_unfinished:
            launched.append(engine.launch_step())
            overlapped += len(launched) > 1
        while launched and (len(launched) > int(rng.integers(1, 4)) or not engine.scheduler.num_unfinished):
            for out in engine.finish_step(launched.pop(0)):
                outputs[out.request_id] = out
    return [outputs[r.request_id] for r in requests], overlapped


def test_launched_steps_overlap_and_equal_recompute():
    """Async scheduling: steps launched while earlier ones are unfinished (a user's next visit among them, its
    history read from what the unfinished step writes) score as under recompute, under eviction and host traffic;
    steps finish only once each and in launch order."""
    config = with_cache(tiny_config(max_num_seqs=3, host_chunks=200), mode="hierarchical", num_gpu_pages=100)
    requests = stream(config, num_users=10, visits=8, seed=12)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    engine = GREngine(config)
    outputs, overlapped = rank_launching_ahead(engine, requests)
    assert overlapped > 10 and engine.stats.host_hit_tokens > 0 and engine.kv.stats.evicted_users > 0
    assert max_diff(outputs, expected) <= 1e-5
    engine.kv.check_invariants()
    for r in stream(config, 2, 1, seed=5):
        engine.add_request(r)
    steps = [engine.launch_step(), engine.launch_step()]
    with pytest.raises(RuntimeError, match="launch order"):
        engine.finish_step(steps[1])
    engine.finish_step(steps[0])
    with pytest.raises(RuntimeError, match="launch order"):
        engine.finish_step(steps[0])


def test_fp8_host_tier_drift_is_small():
    """FP8 host chunks are an approximation: scores drift a little from recompute, never wildly."""
    config = with_cache(tiny_config(max_num_seqs=4, host_chunks=400), mode="hierarchical", num_gpu_pages=120,
                        host_dtype="float8_e4m3fn")
    requests = stream(config, num_users=12, visits=10, seed=4, rewrite_prob=0, replay_prob=0)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    engine = GREngine(config)
    outputs = engine.rank(requests, use_tqdm=False)
    assert engine.stats.host_hit_tokens > 0
    drift = max_diff(outputs, expected)
    served_from_host = [o for o in outputs if o.num_host_cached_tokens]
    assert served_from_host and 0 < drift < 0.25, drift


def test_sasrec_model_equal_to_recompute_with_caching():
    """The softmax (SASRec-style) model uses the same engine and cache: caching changes no score."""
    config = tiny_config(max_num_seqs=4, architecture="sasrec", host_chunks=200)
    requests = stream(config, num_users=16, visits=12, seed=8)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    for mode, pages in (("gpu_only", 160), ("hierarchical", 160)):
        engine = GREngine(with_cache(config, mode=mode, num_gpu_pages=pages))
        assert max_diff(engine.rank(requests, use_tqdm=False), expected) <= 1e-5
        assert engine.stats.total_hit_ratio > 0.1 and engine.kv.stats.evicted_users > 0


def test_time_bias_model_equal_to_recompute_with_caching():
    """With a relative time bias (computed in attention from the request's timestamps), cached K/V stay
    valid: caching changes no score, including rewritten and replayed histories."""
    config = tiny_config(max_num_seqs=4, time_bias_buckets=20, host_chunks=200)
    requests = stream(config, num_users=16, visits=12, seed=9, rewrite_prob=0.1, replay_prob=0.1)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    for mode in ("gpu_only", "hierarchical"):
        engine = GREngine(with_cache(config, mode=mode, num_gpu_pages=160))
        assert max_diff(engine.rank(requests, use_tqdm=False), expected) <= 1e-5
        assert engine.stats.total_hit_ratio > 0.1


@pytest.mark.parametrize(("mode", "phase"), [("gpu_only", "fetch"), ("hierarchical", "wait")])
def test_a_failed_scoring_fails_only_that_steps_requests_and_loses_no_cache(monkeypatch, mode, phase):
    """Step 7's bookkeeping runs before scoring: when scoring fails (queuing the results' copy at launch, or waiting
    for it at collection), the step's finishing requests get an error, the K/V they appended stays committed, and
    every later request scores as under recompute."""
    config = with_cache(tiny_config(max_num_seqs=4, max_num_batched_tokens=200), mode=mode, num_gpu_pages=60)
    requests = stream(config, num_users=8, visits=6, seed=11)
    expected = {r.request_id: r for r in GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)}
    engine = GREngine(config)
    owner = engine.runner if phase == "fetch" else ScoreFetch  # wait: a method of every step's fetch
    scoring, calls = getattr(owner, phase), []

    def failing(*args):
        calls.append(len(calls))
        if len(calls) == 3:
            raise RuntimeError("injected scoring failure")
        return scoring(*args)

    monkeypatch.setattr(owner, phase, failing)
    outputs = engine.rank(requests, use_tqdm=False)
    failed = [o for o in outputs if o.error]
    assert 1 <= len(failed) <= 4 and all("injected scoring failure" in o.error for o in failed)
    served = [o for o in outputs if o.error is None]
    assert len(served) + len(failed) == len(requests)
    assert max_diff(served, [expected[o.request_id] for o in served]) <= 1e-5
    assert not engine.has_unfinished_requests()
    engine.kv.check_invariants()


def test_running_and_waiting_counts_follow_launched_steps():
    """``num_running`` counts a launched step's finishing requests until the step is finished (they are committed at
    launch and leave the scheduler then); ``num_waiting`` the requests no step admitted yet."""
    config = tiny_config(max_num_seqs=3)
    engine = GREngine(config)
    requests = synthetic_requests(config.model, 5, 1, first_history=(5, 10), new_events=(0, 0),
                                  num_candidates=(1, 3), seed=2)
    for r in requests:
        engine.add_request(r)
    assert (engine.num_running, engine.num_waiting) == (0, 5)
    first = engine.launch_step()
    assert (engine.num_running, engine.num_waiting) == (3, 2)
    second = engine.launch_step()
    assert (engine.num_running, engine.num_waiting) == (5, 0)
    assert len(engine.finish_step(first)) == 3 and (engine.num_running, engine.num_waiting) == (2, 0)
    assert len(engine.finish_step(second)) == 2 and (engine.num_running, engine.num_waiting) == (0, 0)
