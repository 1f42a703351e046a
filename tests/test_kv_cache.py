"""KV cache manager: reuse, prefix validation, LRU eviction, locking and allocator invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cache_engine import CacheConfig, KVCacheManager, LRUIndex, page_prefix_hashes


def manager(mode="gpu_only", pages=16, page_size=4) -> KVCacheManager:
    return KVCacheManager(CacheConfig(mode=mode, page_size=page_size, num_gpu_pages=pages), num_layers=1,
                          num_heads=1, head_dim=2, dtype=torch.float32, device="cpu")


def history(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 100, n), rng.integers(0, 4, n), np.arange(n)


def hashes(items, actions, times, page_size=4):
    return page_prefix_hashes(np.asarray(items), np.asarray(actions), np.asarray(times), page_size)


def serve(kv, user, h, reuse_limit=None):
    """One whole request: acquire, commit everything, release; returns the reused token count."""
    hit = kv.acquire(user, h, len(h) if reuse_limit is None else reuse_limit)
    assert hit is not None
    kv.commit(user, len(h), h)
    kv.release(user)
    return hit.total


def test_lru_index_order():
    lru = LRUIndex()
    for key in "abc":
        lru.touch(key)
    lru.touch("a")
    assert list(lru) == ["b", "c", "a"]
    lru.remove("c")
    assert list(lru) == ["b", "a"] and len(lru) == 2 and "c" not in lru


def test_prefix_hashes_are_per_page_prefixes():
    items, actions, times = history(10)
    h = hashes(items, actions, times)
    other = items.copy()
    other[5] += 1  # changes page 1 (tokens 4..7) only
    h2 = hashes(other, actions, times)
    assert np.array_equal(h[:5], h2[:5]) and np.array_equal(h[8:], h2[8:])
    assert not np.any(h[5:8] == h2[5:8])
    times2 = times.copy()
    times2[9] += 1
    assert hashes(items, actions, times2)[9] != h[9]


def test_returning_user_reuses_cache():
    kv = manager()
    items, actions, times = history(30)
    assert serve(kv, "u", hashes(items[:10], actions[:10], times[:10])) == 0
    assert serve(kv, "u", hashes(items[:23], actions[:23], times[:23])) == 10
    assert serve(kv, "u", hashes(items, actions, times)) == 23
    assert serve(kv, "u", hashes(items, actions, times), reuse_limit=29) == 29  # retrieval recomputes the last
    kv.check_invariants()


def test_changed_history_is_cut_back_to_matching_pages():
    kv = manager()
    items, actions, times = history(22)
    serve(kv, "u", hashes(items, actions, times))
    changed = items.copy()
    changed[9] += 1  # inside page 2 (tokens 8..11)
    assert serve(kv, "u", hashes(changed, actions, times)) == 8
    assert kv.stats.truncated_tokens == 14
    # A shorter history ending mid-page can only reuse the pages it fully verifies.
    assert serve(kv, "u", hashes(changed[:14], actions[:14], times[:14])) == 12
    kv.check_invariants()


def test_lru_evicts_least_recent_unlocked_user():
    kv = manager(pages=6)
    h = hashes(*history(8))  # 2 pages each
    serve(kv, "a", h)
    serve(kv, "b", h)
    serve(kv, "c", h)
    serve(kv, "a", h)  # a becomes most recent
    assert serve(kv, "d", h) == 0
    assert set(kv.users) == {"a", "c", "d"} and kv.stats.evicted_users == 1
    kv.check_invariants()


def test_locked_users_are_never_evicted():
    kv = manager(pages=4)
    h = hashes(*history(8))
    assert kv.acquire("a", h, 8).total == 0  # a holds 2 pages, locked
    serve(kv, "b", h)
    assert kv.acquire("c", h, 8).total == 0  # evicts b (unlocked), never a
    assert "b" not in kv.users and kv.users["a"].locked
    assert kv.acquire("d", h, 8) is None  # only locked users remain: wait, change nothing
    kv.check_invariants()
    kv.release("c")  # released without commit: nothing cached
    assert "c" not in kv.users
    kv.check_invariants()


def test_recompute_mode_keeps_nothing():
    kv = manager(mode="recompute")
    h = hashes(*history(9))
    serve(kv, "u", h)
    assert serve(kv, "u", h) == 0 and not kv.users and kv.pool.num_free == 16


def test_unlimited_mode_never_evicts():
    kv = manager(mode="unlimited", pages=4)
    h = hashes(*history(8))
    serve(kv, "a", h)
    serve(kv, "b", h)
    assert kv.acquire("c", h, 8) is None
    assert "unlimited mode ran out" in kv.why_no_room(8)
    assert "needs 5 KV pages" in manager(pages=4).why_no_room(20)


def test_page_table_csr():
    kv = manager()
    h = hashes(*history(10))
    serve(kv, "a", h)
    serve(kv, "b", h[:3])
    indptr, indices = kv.page_table(["b", "a", "a"], [3, 10, 5])
    assert indptr.tolist() == [0, 1, 4, 6]
    a, b = kv.users["a"].pages.tolist(), kv.users["b"].pages.tolist()
    assert indices.tolist() == b + a + a[:2] and indices.dtype == np.int32


@pytest.mark.parametrize("seed", range(3))
def test_invariants_after_long_random_run(seed):
    """Thousands of random acquire/commit/release operations: no page owned twice, none leaked, and
    every reuse is a prefix of the request's history that equals what was committed for that user."""
    rng = np.random.default_rng(seed)
    kv = manager(pages=40, page_size=4)
    streams = {u: history(150, seed=100 * seed + u) for u in range(12)}
    committed: dict[int, np.ndarray] = {}  # per user: the events whose K/V the cache holds
    running: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
    for _ in range(3000):
        user = int(rng.integers(0, 12))
        if user in running:
            events, h, reused = running.pop(user)
            if rng.random() < 0.8:  # the whole history, or a chunk of it (the request then fails)
                m = len(h) if rng.random() < 0.7 else int(rng.integers(reused, len(h) + 1))
                kv.commit(user, m, h)
                committed[user] = events[:m]
            kv.release(user)
        else:
            n = min(150, kv.cached_tokens(user) + int(rng.integers(0, 30)))
            events = np.stack([a[:n] for a in streams[user]], axis=1).copy()
            if rng.random() < 0.1 and n:
                events[rng.integers(0, n), 0] += 1
            h = hashes(events[:, 0], events[:, 1], events[:, 2])
            before = committed.get(user, events[:0]) if user in kv.users else events[:0]
            hit = kv.acquire(user, h, n)
            if hit is None:
                continue
            reused = hit.total
            assert reused <= min(len(before), n)
            assert np.array_equal(before[:reused], events[:reused]), "reused KV of different events"
            committed[user] = events[:reused]
            running[user] = (events, h, reused)
        kv.check_invariants()
    assert kv.stats.evicted_users > 0 and kv.stats.truncated_tokens > 0


def test_commit_cannot_shrink_or_overflow():
    kv = manager()
    h = hashes(*history(9))
    serve(kv, "u", h[:6])
    kv.acquire("u", h, 9)
    with pytest.raises(RuntimeError):
        kv.commit("u", 5, h)
    with pytest.raises(RuntimeError):
        kv.commit("u", 13, h)


@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_incremental_hasher_equals_full_hashing(page_size):
    """Reusing the previous request's hashes never changes them: growing, shrinking, edited histories."""
    from cache_engine import IncrementalHasher

    rng = np.random.default_rng(page_size)
    hasher = IncrementalHasher(page_size, max_users=3)
    streams = {u: [a.copy() for a in history(80, seed=u)] for u in range(5)}
    for _ in range(400):
        user = int(rng.integers(0, 5))
        items, actions, times = streams[user]
        n = int(rng.integers(0, 81))
        if rng.random() < 0.2 and n:
            [items, actions, times][int(rng.integers(0, 3))][int(rng.integers(0, n))] += 1  # an edited event
        got = hasher(user, items[:n], actions[:n], times[:n])
        assert np.array_equal(got, hashes(items[:n], actions[:n], times[:n], page_size))


@pytest.mark.parametrize("page_size", [1, 4, 32])
def test_incremental_hasher_many_equals_full_hashing(page_size):
    """Batched hashing: several users at once, a user recurring within a batch, edits, empty histories."""
    from cache_engine import IncrementalHasher

    rng = np.random.default_rng(10 + page_size)
    hasher = IncrementalHasher(page_size, max_users=4)
    streams = {u: [a.copy() for a in history(300, seed=u)] for u in range(6)}
    for _ in range(60):
        batch = []
        for _ in range(int(rng.integers(1, 9))):
            user = int(rng.integers(0, 6))
            items, actions, times = (a.copy() for a in streams[user])
            n = int(rng.integers(0, 301))
            if rng.random() < 0.2 and n:
                items[int(rng.integers(0, n))] += 1  # an edited event
            batch.append((user, items[:n], actions[:n], times[:n]))
        got = hasher.many(batch)
        assert len(got) == len(batch)
        for (_, items, actions, times), hashed in zip(batch, got):
            assert np.array_equal(hashed, hashes(items, actions, times, page_size))


def test_incremental_hasher_remembered_history_is_reused_exactly():
    from cache_engine import IncrementalHasher

    items, actions, times = history(300, seed=3)
    hasher = IncrementalHasher(8)
    hasher.remember("u", items[:200], actions[:200], times[:200], hashes(items[:200], actions[:200], times[:200], 8))
    got = hasher.many([("u", items[:260], actions[:260], times[:260])])[0]
    assert np.array_equal(got, hashes(items[:260], actions[:260], times[:260], 8))
    edited = items.copy()
    edited[5] += 1  # a changed old event: nothing reused, still exact
    got = hasher.many([("u", edited[:260], actions[:260], times[:260])])[0]
    assert np.array_equal(got, hashes(edited[:260], actions[:260], times[:260], 8))


@pytest.mark.parametrize("page_size", [1, 4, 32])
def test_incremental_hasher_with_matches_taken_first_equals_full_hashing(page_size):
    """The engine's order: every request of a batch is matched first (to validate only the new events), then
    hashed; kept histories grow in place. Users recur within batches; histories grow, shrink and get edited."""
    from cache_engine import IncrementalHasher

    rng = np.random.default_rng(20 + page_size)
    hasher = IncrementalHasher(page_size, max_users=4)
    streams = {u: [a.copy() for a in history(400, seed=u)] for u in range(6)}
    lengths = dict.fromkeys(range(6), 0)
    for _ in range(80):
        batch = []
        for _ in range(int(rng.integers(1, 9))):
            user = int(rng.integers(0, 6))
            lengths[user] = n = int(min(400, lengths[user] + rng.integers(0, 40))) if rng.random() < 0.8 \
                else int(rng.integers(0, 401))
            items, actions, times = (a[:n].copy() for a in streams[user])
            if rng.random() < 0.15 and n:
                times[int(rng.integers(0, n))] += 1  # an edited event
            batch.append((user, items, actions, times))
        matches = [hasher.match(*request) for request in batch]
        for (_, items, actions, times), match in zip(batch, matches):
            assert np.array_equal(match.hashes, hashes(items, actions, times, page_size)[: match.length])
        got = hasher.many(batch, matches)
        for (_, items, actions, times), hashed in zip(batch, got):
            assert np.array_equal(hashed, hashes(items, actions, times, page_size))


def test_incremental_hasher_never_writes_remembered_arrays():
    """Remembered arrays are the caller's: a longer next history is copied, not written into them."""
    from cache_engine import IncrementalHasher

    items, actions, times = history(300, seed=5)
    originals = [a.copy() for a in (items, actions, times)]
    hasher = IncrementalHasher(4)
    hasher.remember("u", items[:100], actions[:100], times[:100], hashes(items[:100], actions[:100], times[:100], 4))
    other = [a.copy() for a in (items, actions, times)]
    other[0][97:] += 7  # past the last whole page (96) the next histories differ from the remembered one
    for n in (99, 150, 200, 300):  # 99: fits the remembered arrays, whose first 96 events it shares
        got = hasher.many([("u", *(a[:n] for a in other))])[0]
        assert np.array_equal(got, hashes(*(a[:n] for a in other), 4))
    for array, original in zip((items, actions, times), originals):
        assert np.array_equal(array, original)


def test_incremental_hasher_second_request_of_a_batch_never_writes_over_the_first():
    """Two requests of one user matched against the same kept history: the first (shorter, its last partial page
    edited) is kept in place; the second must then be copied, or the kept events would mix both."""
    from cache_engine import IncrementalHasher

    items, actions, times = history(80, seed=6)
    hasher = IncrementalHasher(8)
    hasher(0, items[:64], actions[:64], times[:64])
    first = [a[:60].copy() for a in (items, actions, times)]
    first[0][58] += 1
    second = [a[:80] for a in (items, actions, times)]
    batch = [(0, *first), (0, *second)]
    hasher.many(batch, [hasher.match(*request) for request in batch])
    mixed = [a.copy() for a in second]
    mixed[0][56:60] = first[0][56:60]  # what the kept events would hold had the second written over the first
    got = hasher(0, *mixed)
    assert np.array_equal(got, hashes(*mixed, 8))
