"""Intake: batched value checks, byte comparison of kept histories, hashes handed out as views.

Each fast path is checked against a plain reference: the hash definition computed with Python ints, the
per-request checks, and the per-request intake the engine ran before checking whole batches at once.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import gr_engine.validation as validation
from cache_engine import IncrementalHasher, page_prefix_hashes
from gr_engine import GREngine, RankRequest
from gr_engine.validation import (
    RequestArrays,
    RequestError,
    check_candidates,
    check_events,
    parse_fields,
    values_valid,
)
from tests.conftest import tiny_config

_M = 2**64 - 1


def _mix(x: int) -> int:
    x ^= x >> 30
    x = x * 0xBF58476D1CE4E5B9 & _M
    x ^= x >> 27
    x = x * 0x94D049BB133111EB & _M
    return x ^ (x >> 31)


def reference_hashes(items, actions, times, page_size: int) -> list[int]:
    """The hash definition, token by token with Python ints (two's complement for negative ids)."""
    out, total = [], 0
    for i, (item, action, time) in enumerate(zip(items, actions, times)):
        if i % page_size == 0:
            total = 0
        token = _mix((int(item) & _M) * 0x9E3779B97F4A7C15 + (i % page_size) * 0x27D4EB2F165667C5 & _M)
        token = _mix(token ^ ((int(time) & _M) * 0x165667B19E3779F9 & _M))
        token = _mix(token ^ ((int(action) & _M) * 0xC2B2AE3D27D4EB4F & _M))
        total = (total + token) & _M
        out.append(total)
    return out


@pytest.mark.parametrize("page_size", [1, 3, 8])
@pytest.mark.parametrize("kind", ["int64", "int32", "uint64", "list", "strided"])
def test_page_prefix_hashes_follow_the_definition(page_size, kind):
    rng = np.random.default_rng(page_size)
    for n in (0, 1, page_size, 2 * page_size + 1, 37):
        fields = [rng.integers(-(2**31), 2**31, n) for _ in range(3)]
        if kind == "int32":
            fields = [f.astype(np.int32) for f in fields]
        elif kind == "uint64":
            fields = [f.astype(np.uint64) + np.uint64(2**63) for f in fields]
        elif kind == "list":
            fields = [f.tolist() for f in fields]
        elif kind == "strided":
            fields = [np.repeat(f, 2)[::2] for f in fields]
        got = page_prefix_hashes(*fields, page_size)
        assert got.dtype == np.uint64 and got.tolist() == reference_hashes(*fields, page_size)


def _kept(page_size=8, n=60, seed=0):
    rng = np.random.default_rng(seed)
    fields = [rng.integers(0, 1000, 200), rng.integers(0, 8, 200), np.cumsum(rng.integers(0, 5, 200))]
    hasher = IncrementalHasher(page_size)
    hasher("u", *(f[:n] for f in fields))
    return hasher, fields


@pytest.mark.parametrize("field", [0, 1, 2])
@pytest.mark.parametrize("at", [0, 7, 31, 55, 58, 59, 60, 70])
def test_one_changed_event_is_never_reused(field, at):
    """The kept history has 60 events (7 whole pages of 8, then 4); the next request has 72, one of them changed.
    A change within the 56 events of whole pages shares nothing; one after them keeps the 56."""
    hasher, fields = _kept()
    new = [f[:72].copy() for f in fields]
    new[field][at] += 1
    match = hasher.match("u", *new)
    assert match.length == (0 if at < 56 else 56)
    assert np.array_equal(match.hashes, page_prefix_hashes(*new, 8)[: match.length])
    assert np.array_equal(hasher.many([("u", *new)], [match])[0], page_prefix_hashes(*new, 8))


def test_other_integer_dtypes_compare_by_value():
    hasher, fields = _kept()
    same = [f[:72].astype(np.int32) for f in fields]
    assert hasher.match("u", *same).length == 56
    as_lists = [f[:72].tolist() for f in fields]
    assert hasher.match("u", *as_lists).length == 56
    strided = [np.repeat(f[:72], 2)[::2] for f in fields]
    assert hasher.match("u", *strided).length == 56
    shifted = [f[:72].astype(np.uint64) + np.uint64(2**32) for f in fields]
    assert hasher.match("u", *shifted).length == 0
    assert np.array_equal(hasher.many([("u", *shifted)])[0], page_prefix_hashes(*shifted, 8))


def test_shorter_history_then_longer_again():
    hasher, fields = _kept()
    short = [f[:30].copy() for f in fields]
    match = hasher.match("u", *short)
    assert match.length == 24
    first = hasher.many([("u", *short)], [match])[0]
    assert np.array_equal(first, page_prefix_hashes(*short, 8))
    longer = [f[:90].copy() for f in fields]
    longer[2][40:] += 1  # events past the short history differ from the first kept one
    assert hasher.match("u", *longer).length == 24
    assert np.array_equal(hasher("u", *longer), page_prefix_hashes(*longer, 8))
    assert np.array_equal(first, page_prefix_hashes(*short, 8))  # handed out earlier: unchanged


@pytest.mark.parametrize("page_size", [1, 4, 32])
def test_hashes_handed_out_never_change(page_size):
    """Returned hashes are views of the kept buffers: whatever comes next (growth, shrinking, edits, a user twice
    in a batch, eviction), every array handed out keeps its values."""
    rng = np.random.default_rng(page_size)
    hasher = IncrementalHasher(page_size, max_users=3)
    streams = {u: [rng.integers(0, 50, 300), rng.integers(0, 4, 300), np.arange(300)] for u in range(5)}
    lengths = dict.fromkeys(range(5), 0)
    handed_out = []
    for _ in range(150):
        batch = []
        for _ in range(int(rng.integers(1, 6))):
            user = int(rng.integers(0, 5))
            grown = min(300, lengths[user] + int(rng.integers(0, 20)))
            lengths[user] = n = grown if rng.random() < 0.8 else int(rng.integers(0, 301))
            fields = [f[:n].copy() for f in streams[user]]
            if rng.random() < 0.2 and n:
                fields[int(rng.integers(0, 3))][int(rng.integers(max(0, n - 2 * page_size), n))] += 1
            batch.append((user, *fields))
        matches = [hasher.match(*request) for request in batch]
        for request, hashes in zip(batch, hasher.many(batch, matches)):
            expected = page_prefix_hashes(*request[1:], page_size)
            assert np.array_equal(hashes, expected)
            handed_out.append((hashes, expected))
    assert all(np.array_equal(hashes, expected) for hashes, expected in handed_out)


def test_kept_history_is_always_one_requests():
    """Two requests of a user in one batch, both matched against the same kept history: what is kept afterwards
    is the second request's history, never a mix of both (whose junction no request ever had validated)."""
    hasher, fields = _kept(n=64)
    first = [f[:60].copy() for f in fields]
    first[2][56:60] += 1000  # its last, partial page differs
    second = [f[:80] for f in fields]
    batch = [("u", *first), ("u", *second)]
    hasher.many(batch, [hasher.match(*request) for request in batch])
    mixed = [f.copy() for f in second]
    mixed[2][56:60] = first[2][56:60]
    assert hasher.match("u", *mixed).length == 0
    assert hasher.match("u", *second).length == 80


def test_returning_user_is_extended_in_place():
    """A history that extends the kept one is written after it: the hashes of consecutive visits share memory."""
    hasher, fields = _kept(n=60)
    first = hasher("u", *(f[:70] for f in fields))
    second = hasher("u", *(f[:75] for f in fields))
    assert np.shares_memory(first, second)
    assert np.array_equal(second, page_prefix_hashes(*(f[:75] for f in fields), 8))


def test_remembered_events_are_copied():
    rng = np.random.default_rng(3)
    fields = [rng.integers(0, 100, 120), rng.integers(0, 4, 120), np.arange(120)]
    originals = [f.copy() for f in fields]
    hasher = IncrementalHasher(4)
    hasher.remember("u", *fields, page_prefix_hashes(*fields, 4))
    for f in fields:
        f[:] = 7  # the caller's arrays change afterwards
    grown = [np.concatenate([f, [1]]) for f in originals]
    assert hasher.match("u", *grown).length == 120
    assert np.array_equal(hasher("u", *grown), page_prefix_hashes(*grown, 4))


def test_match_copies_nothing():
    """The kept history is compared in place, however long (``bytearray.startswith`` on the request's arrays)."""
    n = 200_000
    fields = [np.arange(n, dtype=np.int64) for _ in range(3)]
    hasher = IncrementalHasher(32)
    hasher("u", *fields)
    request = [f.copy() for f in fields]
    tracemalloc.start()
    try:
        match = hasher.match("u", *request)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert match.length == n and peak < 4096


def _arrays(rng, n, start, config):
    """A request's arrays whose events before ``start`` may be anything (they are not checked)."""
    items = rng.integers(0, config.model.num_items, n)
    actions = rng.integers(0, config.model.num_actions, n)
    times = np.cumsum(rng.integers(0, 3, n))
    candidates = rng.integers(0, config.model.num_items, int(rng.integers(0, 4)))
    where = int(rng.integers(0, n)) if n else 0
    fault = rng.random()
    if n and fault < 0.1:
        items[where] = config.model.num_items + int(rng.integers(0, 2))
    elif n and fault < 0.2:
        actions[where] = -1
    elif n and fault < 0.3:
        times[where:] -= 1 if where else 0
    elif n and fault < 0.35:
        times[start:] -= int(rng.integers(1, 3))  # backwards from the last known event to the first new one
    elif fault < 0.4 and len(candidates):
        candidates[-1] = -5
    return RequestArrays(items, actions, times, candidates), start


def _passes(arrays, start, config) -> bool:
    try:
        check_candidates(arrays, config)
        check_events(arrays, config, start)
    except RequestError:
        return False
    return True


@pytest.mark.parametrize("join_limit", [0, 6, 1024])
def test_values_valid_equals_the_per_request_checks(join_limit, monkeypatch):
    """Random batches (empty histories, nothing new, long histories checked where they are, faults before and
    after ``start``, at batch-mates' boundaries): the batched check agrees with the per-request ones."""
    monkeypatch.setattr(validation, "_JOIN_LIMIT", join_limit)
    config = tiny_config()
    rng = np.random.default_rng(join_limit)
    agreed = {True: 0, False: 0}
    for _ in range(3000):
        batch = []
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(0, 25))
            batch.append(_arrays(rng, n, int(rng.integers(0, n + 1)), config))
        expected = all(_passes(arrays, start, config) for arrays, start in batch)
        assert values_valid(batch, config) == expected
        agreed[expected] += 1
    assert min(agreed.values()) > 300
    assert values_valid([], config)


def _reference_errors(engine, requests, last, in_flight):
    """The per-request intake (parse_fields, check_candidates, the duplicate check, then check_events of the events
    after the user's last accepted history's shared whole pages): each request's error or None."""
    ps, config, ids, errors = engine.config.cache.page_size, engine.config, set(), []
    for request in requests:
        try:
            arrays = parse_fields(request, config, ranking=True)
            check_candidates(arrays, config)
            if request.request_id in in_flight or request.request_id in ids:
                raise RequestError(f"request_id {request.request_id!r} is already in flight")
            kept, start = last.get(request.user_id), 0
            if kept is not None:
                common = min(len(kept[0]), arrays.num_history) // ps * ps
                new = (arrays.item_ids, arrays.action_ids, arrays.timestamps)
                if all(np.array_equal(k[:common], f[:common]) for k, f in zip(kept, new)):
                    start = common
            check_events(arrays, config, start)
        except RequestError as exc:
            errors.append(str(exc))
            continue
        ids.add(request.request_id)
        errors.append(None)
    return errors


@pytest.mark.parametrize("join_limit", [0, 1024])
@pytest.mark.parametrize("mode", ["gpu_only", "recompute"])
def test_intake_equals_the_per_request_intake(mode, join_limit, monkeypatch):
    """Batches of returning users with growing, shrinking and edited histories, faults in new and old events,
    bad candidates, duplicate and in-flight ids, other dtypes: every request gets the per-request intake's
    error or is queued with the exact hashes of its history."""
    monkeypatch.setattr(validation, "_JOIN_LIMIT", join_limit)
    engine = GREngine(tiny_config(mode=mode, page_size=4))
    queued = []
    monkeypatch.setattr(engine.scheduler, "add", queued.append)
    rng = np.random.default_rng(7)
    streams = {u: [rng.integers(0, 200, 256), rng.integers(0, 8, 256), np.cumsum(rng.integers(0, 3, 256))]
               for u in range(6)}
    lengths, last, count, failed, deferred = dict.fromkeys(range(6), 0), {}, 0, 0, 0
    for _ in range(300):
        requests = []
        for _ in range(int(rng.integers(1, 7))):
            user, count = int(rng.integers(0, 6)), count + 1
            lengths[user] = n = min(256, lengths[user] + int(rng.integers(0, 12))) if rng.random() < 0.85 \
                else int(rng.integers(0, 257))
            fields = [f[:n].copy() for f in streams[user]]
            fault, where = rng.random(), int(rng.integers(0, n)) if n else 0
            candidates = rng.integers(0, 200, 3)
            if n and fault < 0.05:
                fields[0][where] = 200
            elif n and fault < 0.1:
                fields[1][where] = -1
            elif n and fault < 0.15 and where:
                fields[2][where] = fields[2][where - 1] - 1
            elif fault < 0.2:
                candidates[1] = 999
            elif n and fault < 0.25:
                fields[int(rng.integers(0, 3))][where] += 1  # an edit, often still valid
            elif fault < 0.3:
                fields = [f.astype(np.int32) for f in fields]
            request_id = str(count - 1 if rng.random() < 0.05 else count)
            requests.append(RankRequest(request_id=request_id, user_id=user, item_ids=fields[0],
                                        action_ids=fields[1], timestamps=fields[2], candidate_item_ids=candidates))
        in_flight = set(engine.intake._in_flight)
        expected = _reference_errors(engine, requests, last, in_flight)
        before = len(queued)
        added = engine.intake.add(requests, None)
        # Users with nothing cached or kept are hashed once their step is launched: here, at once (as a step would).
        deferred += sum(state.token_hashes is None for state in queued[before:])
        engine.intake.hash_deferred(queued[before:])
        states = iter(queued[before:])
        for request, result, error in zip(requests, added, expected):
            if error is not None:
                assert isinstance(result, RequestError) and str(result) == error
                failed += 1
                continue
            state = next(states)
            assert state.seq_id == result
            arrays = [np.asarray(f, dtype=np.int64) for f in (request.item_ids, request.action_ids,
                                                                request.timestamps)]
            if mode != "recompute":
                assert np.array_equal(state.token_hashes, page_prefix_hashes(*arrays, 4))
            last[request.user_id] = arrays
        if rng.random() < 0.7:
            engine.intake._in_flight.clear()
    assert failed > 100
    assert (deferred > 0) == (mode != "recompute")  # first visits (and histories edited at page 0) in caching modes


def test_first_visits_are_hashed_when_their_step_is_launched():
    """A user with nothing cached, kept or in flight is queued unhashed (``token_hashes`` None) and hashed when its
    first step is launched, before that step commits: the cache then holds its exact hashes and the next visit reuses
    its pages, with the scores of recompute. A request of a user already in flight, or held by the cache, is hashed
    at intake."""
    config = tiny_config(mode="gpu_only", page_size=4)
    engine, reference = GREngine(config), GREngine(tiny_config(mode="recompute", page_size=4))
    states = []
    add = engine.scheduler.add
    engine.scheduler.add = lambda state: (states.append(state), add(state))
    rng = np.random.default_rng(3)
    fields = [rng.integers(0, 200, 40), rng.integers(0, 8, 40), np.cumsum(rng.integers(0, 3, 40))]

    def request(request_id: str, n: int) -> RankRequest:
        return RankRequest(request_id=request_id, user_id=5, item_ids=fields[0][:n], action_ids=fields[1][:n],
                           timestamps=fields[2][:n], candidate_item_ids=np.arange(3))

    visits = [request("first", 30), request("second", 34)]  # the second queued while the first is in flight
    engine.add_requests(visits)
    assert states[0].token_hashes is None
    assert np.array_equal(states[1].token_hashes, page_prefix_hashes(*(f[:34] for f in fields), 4))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        if states[0].status.name != "WAITING":
            assert np.array_equal(states[0].token_hashes, page_prefix_hashes(*(f[:30] for f in fields), 4))
    assert engine.kv.hashed_tokens(5) == 34 and states[1].num_gpu_hits == 30  # all of the first visit
    engine.add_requests([request("third", 40)])
    assert states[2].token_hashes is not None and states[2].token_hashes.shape == (40,)  # the cache holds the user
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert states[2].num_gpu_hits == 34
    expected = {o.request_id: o for o in reference.rank(visits + [request("third", 40)], use_tqdm=False)}
    for output in outputs:
        assert output.error is None
        np.testing.assert_allclose(output.scores, expected[output.request_id].scores, atol=1e-5)
