"""The cache manager's fast paths: in-place page and hash buffers, the numpy page stack, prefix verification by
one byte comparison, the per-user index of chunk copies in flight, and record generations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cache_engine import HostChunkStore, LRUIndex, PagePool, page_prefix_hashes
from tests.test_host_tier import PS, hashes, kv_of, manager, run
from tests.test_kv_cache import manager as gpu_manager


def events_hashes(items: np.ndarray, page_size: int) -> np.ndarray:
    return page_prefix_hashes(items, np.zeros(len(items), int), np.arange(len(items)), page_size)


def reference_reuse(old: np.ndarray, new: np.ndarray, page_size: int) -> int:
    """What page-by-page verification may reuse of a record holding events ``old`` for a request with history
    ``new``: the longest common prefix, rounded down to a page boundary unless it ends where ``old`` ends."""
    common = int(np.argmin(np.append(old[: len(new)] == new[: len(old)], False)))
    if common == len(old) <= len(new):
        return common
    return common // page_size * page_size


@pytest.mark.parametrize("seed", range(3))
def test_verified_prefix_equals_event_by_event_reference(seed):
    """Random histories that grow, shrink and change at random places: the reuse found by comparing page
    hashes (one byte comparison, then the first mismatch) is exactly the common prefix the events allow."""
    rng = np.random.default_rng(seed)
    page_size = 4
    kv = gpu_manager(pages=400, page_size=page_size)
    events = {u: rng.integers(0, 30, 60) for u in range(5)}
    cached: dict[int, np.ndarray] = {}
    for _ in range(600):
        user = int(rng.integers(0, 5))
        items = events[user][: int(rng.integers(0, 61))].copy()
        if len(items) and rng.random() < 0.3:
            items[int(rng.integers(0, len(items)))] += 1  # the history changed here
        h = events_hashes(items, page_size)
        expected = reference_reuse(cached[user], items, page_size) if user in cached else 0
        hit = kv.acquire(user, h, len(h))
        assert hit.total == expected
        done = int(rng.integers(hit.total, len(h) + 1))  # the whole history, or part of it (a failed step)
        kv.commit(user, done, h)
        kv.release(user)
        record = kv.users.get(user)
        if record is not None:
            cached[user] = items[:done]
            pages = -(-done // page_size)
            ends = np.minimum((np.arange(pages) + 1) * page_size, done) - 1
            assert np.array_equal(record.hash_buffer[:pages], h[ends])  # written in place, page by page
        else:
            cached.pop(user, None)
        kv.check_invariants()


def test_page_and_hash_buffers_grow_in_place_and_pages_are_released_on_eviction():
    kv = gpu_manager(pages=64, page_size=4)
    h = hashes(60)
    kv.acquire("a", h[:5], 5)
    kv.commit("a", 5, h)
    kv.release("a")
    record = kv.users["a"]
    page_buffer, hash_buffer = record.page_buffer, record.hash_buffer
    assert len(page_buffer) > record.num_pages == 2  # spare capacity for the next visit
    kv.acquire("a", h[:8], 8)  # one more page: appended to the same buffers
    kv.commit("a", 8, h)
    kv.release("a")
    assert record.page_buffer is page_buffer and record.hash_buffer is hash_buffer
    first_pages = record.pages.tolist()
    kv.acquire("a", h, 60)  # 15 pages: the buffers grow, keeping what they held
    assert record.page_buffer is not page_buffer and record.pages[:2].tolist() == first_pages
    kv.commit("a", 60, h)
    kv.release("a")
    assert np.array_equal(record.hash_buffer[:15], h[3::4])
    serve_b = hashes(240, 1)
    kv.acquire("b", serve_b, 240)  # 60 pages: "a" is evicted and its page buffer let go
    assert "a" not in kv.users and len(record.page_buffer) == 0 and record.num_pages == 0
    kv.check_invariants()


def test_page_pool_is_a_lifo_stack_of_page_ids():
    pool = PagePool(1, 6, 4, 1, 2, torch.float32, "cpu")
    first = np.empty(2, dtype=np.int32)
    pool.allocate(first)
    assert first.tolist() == [1, 0] and pool.num_free == 4
    pool.free(first[::-1])
    again = np.empty(3, dtype=np.int32)
    pool.allocate(again)
    assert again.tolist() == [2, 0, 1] and pool.free_page_ids() == [5, 4, 3]  # freed pages go first
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(np.empty(4, dtype=np.int32))
    pool.free(again)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(np.array([0], dtype=np.int32))


def test_page_table_accepts_numpy_lengths_and_rejects_pages_not_held():
    kv = gpu_manager()
    h = hashes(10)
    kv.acquire("a", h, 10)
    kv.commit("a", 10, h)
    kv.release("a")
    indptr, indices = kv.page_table(["a", "a"], np.array([10, 3]))
    assert indptr.tolist() == [0, 3, 4] and indices.tolist() == kv.users["a"].pages.tolist() + [kv.users["a"].pages[0]]
    assert indptr.dtype == indices.dtype == np.int32
    empty = kv.page_table([], [])
    assert empty[0].tolist() == [0] and empty[1].dtype == np.int32 and len(empty[1]) == 0
    with pytest.raises(ValueError, match="holds 3 pages"):
        kv.page_table(["a"], [13])


def test_lru_index_carries_values_in_order():
    lru = LRUIndex()
    lru.touch("a", 1)
    lru.touch("b", 2)
    lru.touch("a", 3)
    assert list(lru.items()) == [("b", 2), ("a", 3)]
    lru.remove("b")
    lru.remove("missing")
    assert list(lru) == ["a"] and lru["a"] == 3


def test_store_stops_polling_its_queue_once_every_segment_is_adopted():
    store = HostChunkStore(4, (1, 1, 2, 4, 1, 2), torch.float32, 2, pin=False)
    assert store.num_free == 4 and store.num_allocated == 4

    def fail():
        raise AssertionError("queue polled after every segment arrived")

    store._ready.get_nowait = fail
    assert store.adopt_ready_segments() == 0


class _Pending:
    """A CUDA event stand-in that has not happened until ``done`` is set."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_eviction_waits_for_chunk_copies_still_in_flight():
    """With copies to host still running (as on a GPU), their user's pages are being read: evicting it waits for
    those copies, then persists only what is not on host yet, and every copy completes into the right slot."""
    kv = manager(pages=6)
    events: list[_Pending] = []
    offload = kv.host.transfer.offload

    def slow_offload(pool, jobs):
        offload(pool, jobs)
        events.append(_Pending())
        return events[-1]  # done only when waited for or set

    kv.host.transfer.offload = slow_offload
    run(kv, "a", hashes(19))  # 2 full chunks queued and launched at end_step; they stay in flight
    kv.begin_step()
    assert kv.host.pending_chunks == 2 and kv.users["a"].host_tokens == 0 and kv.users["a"].readers == 1
    run(kv, "b", hashes(16, 1))  # evicts "a" once its copies are done: only its 3-token tail needs a copy
    assert events[0].done and kv.stats.tail_persisted_tokens == 3 and kv.stats.offloaded_tokens == 16 + 3 + 16
    assert not kv.users["a"].num_pages and kv.users["a"].host_tokens == 16 and kv.host.pending_chunks == 3
    kv.check_invariants()
    for event in events:
        event.done = True
    kv.begin_step()
    assert kv.users["a"].host_tokens == 19 and kv.users["b"].host_tokens == 16
    assert kv.host.pending_chunks == 0
    assert run(kv, "a", hashes(19)) == (0, 19)
    expected = torch.tensor([float(hash(("a", t)) % 1000) for t in range(19)])
    assert torch.equal(kv_of(kv, "a", 19), expected.view(1, 19, 1, 1, 1).expand(2, 19, 2, 1, 2))
    kv.check_invariants()


def test_copy_of_a_deleted_record_never_reaches_the_users_next_record():
    """A user dropped from both tiers while its tail copy is pending, then back in the same step with another
    history: when the old copy completes it must not be taken as the new record's host copy (it would
    later be onloaded as the new history's K/V)."""
    kv = manager(pages=6, host_chunks=2)

    def fill(user, start, n, value):
        for t in range(start, n):
            kv.kv_cache[:, int(kv.users[user].pages[t // PS]), :, t % PS] = value

    def serve(user, h, value=0.0):
        kv.begin_step()
        hit = kv.acquire(user, h, len(h))
        kv.launch_onloads()
        fill(user, hit.total, len(h), value)
        kv.commit(user, len(h), h)
        kv.release(user)
        kv.end_step()

    serve("x", hashes(6, 1), 1.0)
    serve("a", hashes(6, 2))
    serve("b", hashes(6, 3))
    serve("c", hashes(6, 4))  # evicts "x": its tail goes to host
    serve("x", hashes(7, 1), 1.0)  # "x" comes back from host and evicts "a" to host
    serve("b", hashes(6, 3))
    serve("c", hashes(6, 4))  # GPU LRU: x, b, c; host LRU: x, a; no free host slot
    kv.begin_step()
    assert kv.acquire("d", hashes(7, 5), 7) is not None  # evicts "x": its tail copy takes the slot of "a"
    assert kv.acquire("e", hashes(7, 6), 7) is not None  # evicts "b", whose tail copy takes the slot of "x"
    assert "x" not in kv.users  # no pages, no host copy: the record is gone, its tail copy still pending
    new = hashes(7, 9)  # "x" is back with a different history
    assert kv.acquire("x", new, 7) == (0, 0)
    kv.launch_onloads()
    fill("x", 0, 7, 2.0)
    for user, h in (("x", new), ("d", hashes(7, 5)), ("e", hashes(7, 6))):
        kv.commit(user, 7, h)
        kv.release(user)
    kv.end_step()
    kv.begin_step()  # the old tail copy completes
    assert kv.users["x"].host_tokens == 0
    serve("f", hashes(6, 7))  # evicts "x" (released first): now its own tail goes to host
    kv.begin_step()
    assert kv.acquire("x", hashes(8, 9), 8) == (0, 7)
    kv.launch_onloads()
    assert torch.equal(kv_of(kv, "x", 7), torch.full((2, 7, 2, 1, 2), 2.0))
    kv.check_invariants()
