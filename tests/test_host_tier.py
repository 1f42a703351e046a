"""Hierarchical mode: offload, tail persistence, onload, host LRU, admission control, locking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cache_engine import CacheConfig, KVCacheManager, page_prefix_hashes

PS, CHUNK = 4, 8  # tokens per page, tokens per chunk (2 pages)


def manager(pages=12, host_chunks=8, max_pending=64, persist_tails=True) -> KVCacheManager:
    slot_bytes = 2 * CHUNK * 2 * 1 * 2 * 4  # layers * tokens * (K, V) * heads * dim * float32
    config = CacheConfig(mode="hierarchical", page_size=PS, num_gpu_pages=pages, chunk_tokens=CHUNK,
                         host_budget_bytes=host_chunks * slot_bytes, host_segment_bytes=3 * slot_bytes,
                         max_pending_offloads=max_pending, persist_tails=persist_tails)
    return KVCacheManager(config, num_layers=2, num_heads=1, head_dim=2, dtype=torch.float32, device="cpu")


def hashes(n, seed=0):
    rng = np.random.default_rng(seed)
    return page_prefix_hashes(rng.integers(0, 50, n), np.zeros(n, int), np.arange(n), PS)


def kv_of(kv: KVCacheManager, user, n) -> torch.Tensor:
    """The user's cached K/V of its first n tokens, [L, n, 2, H, D] (reading its pages)."""
    pages = kv.users[user].pages
    data = kv.kv_cache[:, pages].permute(0, 1, 3, 2, 4, 5).reshape(2, -1, 2, 1, 2)
    return data[:, :n].clone()


def run(kv: KVCacheManager, user, h, fill=True):
    """One step of one request: acquire, write distinct K/V for the new tokens, commit, release."""
    kv.begin_step()
    hit = kv.acquire(user, h, len(h))
    assert hit is not None
    kv.launch_onloads()
    record = kv.users[user]
    for t in range(hit.total, len(h)):  # stand-in for the model's append: value = f(user, token)
        page, entry = record.pages[t // PS], t % PS
        kv.kv_cache[:, page, :, entry] = float(hash((user, t)) % 1000)
    kv.commit(user, len(h), h)
    kv.release(user)
    kv.end_step()
    return hit


def test_evicted_user_comes_back_from_host_with_identical_kv():
    kv = manager(pages=6)
    h = hashes(19)  # 5 pages: 2 full chunks + a 3-token tail
    run(kv, "a", h)
    before = kv_of(kv, "a", 19)
    run(kv, "b", hashes(16, 1))  # needs 4 pages: "a" is evicted, its tail persisted first
    assert not kv.users["a"].num_pages
    kv.begin_step()
    assert kv.users["a"].host_tokens == 19 and kv.stats.tail_persisted_tokens == 3
    hit = run(kv, "a", h)
    assert hit == (0, 19)
    assert torch.equal(kv_of(kv, "a", 19), before)
    kv.check_invariants()


def record_transfer_order(kv: KVCacheManager) -> list[str]:
    """Wrap the transfer engine's onload and offload: each call with jobs appends its name to the list returned."""
    order: list[str] = []
    for name in ("onload", "offload"):
        original = getattr(kv.host.transfer, name)

        def recording(kv_pool, jobs, _name=name, _original=original):
            if jobs:
                order.append(_name)
            return _original(kv_pool, jobs)
        setattr(kv.host.transfer, name, recording)
    return order


def test_an_evicted_users_tail_is_copied_before_the_onload_that_reuses_its_pages():
    """A prefetch that evicts a user whose tail is not on host launches the tail's copy first, then its onload
    (whose pages may be the evicted user's); both users come back intact."""
    kv = manager(pages=4)
    hb, ha = hashes(16, 1), hashes(11)
    run(kv, "b", hb)  # the whole pool, two whole chunks (copied at the end of the step)
    b_kv = kv_of(kv, "b", 16)
    run(kv, "a", ha)  # evicts "b" (all on host), takes 3 pages
    a_kv = kv_of(kv, "a", 11)
    order = record_transfer_order(kv)
    kv.prefetch(["b"])  # 4 pages: "a" is evicted, its tail page to be copied, and "b" needs that page too
    assert not kv.users["a"].num_pages and order == ["offload", "onload"]
    kv.end_step()
    assert run(kv, "b", hb) == (0, 16) and torch.equal(kv_of(kv, "b", 16), b_kv)
    assert run(kv, "a", ha) == (0, 11) and torch.equal(kv_of(kv, "a", 11), a_kv)
    kv.host.poll(wait=True)
    kv.check_invariants()


def evict_everyone(kv: KVCacheManager, seed: int = 9) -> None:
    """One request that needs the whole pool: every other user leaves the GPU (their KV stays on host)."""
    run(kv, "x", hashes(kv.pool.num_pages * PS, seed))


def user_only_on_host(kv: KVCacheManager, user: str = "a", n: int = 19) -> tuple[np.ndarray, torch.Tensor]:
    """Serve ``user`` a history of ``n`` tokens, then push it off the GPU; returns its hashes and its K/V as served,
    and begins the next step."""
    h = hashes(n)
    run(kv, user, h)
    before = kv_of(kv, user, n)
    evict_everyone(kv)
    kv.begin_step()
    return h, before


def test_prefetch_loads_a_returning_user_before_its_request_is_acquired():
    """``prefetch``: a user only on host gets pages and its onload before its request arrives at acquire; the
    acquire counts those tokens as host hits and the K/V equals what was written; users unknown or already on the
    GPU are skipped."""
    kv = manager(pages=12, host_chunks=16)
    h, before = user_only_on_host(kv)
    assert not kv.users["a"].num_pages and kv.users["a"].host_tokens == 19
    kv.prefetch(["a", "nobody", "x", ["unhashable"]])
    record = kv.users["a"]
    assert record.num_pages == 5 and record.locked and record.prefetched == 19
    assert not kv.users["x"].prefetched and kv.stats.onloaded_tokens == 19
    kv.check_invariants()
    hit = kv.acquire("a", h, 19)
    assert hit == (0, 19) and not record.prefetched
    assert kv.launch_onloads() is not None
    kv.commit("a", 19, h)
    kv.release("a")
    kv.end_step()
    assert torch.equal(kv_of(kv, "a", 19), before)
    assert run(kv, "a", h) == (19, 0)  # on the GPU now
    kv.check_invariants()


def test_prefetch_evicts_users_outside_the_call_first():
    """Every user of the call becomes the most recently used before the prefetch makes room, also those beyond
    ``count`` (not loaded): the pool's least recently used user "a", whose request is in the call too, keeps its
    pages; "b" is evicted instead."""
    kv = manager(pages=12, host_chunks=16)
    c = hashes(16, 3)
    run(kv, "c", c)
    evict_everyone(kv)  # "c" only on host now; "x" holds the whole pool
    run(kv, "a", hashes(16, 1))  # evicts "x"; then "b": the pool is full with "a" (4 pages), "b" (8 pages)
    run(kv, "b", hashes(32, 2))
    assert kv.pool.num_free == 0 and list(kv._lru) == ["a", "b"]
    kv.begin_step()
    kv.prefetch(["c", "a"], count=1)  # loads "c" (4 pages), touches "a" too
    assert kv.users["a"].num_pages == 4 and not kv.users["b"].num_pages and kv.users["c"].prefetched == 16
    kv.check_invariants()


def test_prefetched_user_whose_history_changed_keeps_only_the_verified_prefix():
    """The prefetch loads the user's whole host copy; the request's history differs after 8 tokens and is shorter:
    the acquire keeps the verified prefix only, gives back the surplus pages, and the K/V of the prefix is right."""
    kv = manager(pages=12, host_chunks=16)
    h, before = user_only_on_host(kv)
    kv.prefetch(["a"])
    changed = hashes(14, seed=5)
    changed[:8] = h[:8]  # the first two pages (8 tokens) agree
    hit = kv.acquire("a", changed, 14)
    assert hit == (0, 8) and kv.users["a"].num_pages == 4
    kv.launch_onloads()
    kv.check_invariants()
    assert torch.equal(kv_of(kv, "a", 8), before[:, :8])


def test_prefetched_users_no_request_acquired_are_handed_back_at_the_end_of_the_step():
    """A prefetched record whose request did not come is unlocked into the LRU at the end of the step; its tokens
    still count as host hits when the request comes later, and not once its pages are gone."""
    kv = manager(pages=12, host_chunks=16)
    h, _ = user_only_on_host(kv)
    kv.prefetch(["a"])
    kv.launch_onloads()
    kv.end_step()
    record = kv.users["a"]
    assert not record.locked and record.prefetched == 19 and record.num_pages == 5
    kv.check_invariants()
    assert run(kv, "a", h) == (0, 19)  # loaded from host one step earlier: host hits
    assert run(kv, "a", h) == (19, 0)  # then GPU hits
    kv.begin_step()
    kv.prefetch(["a"])  # on the GPU already: nothing to do
    kv.end_step()
    evict_everyone(kv)
    kv.begin_step()
    kv.prefetch(["a"])
    kv.end_step()  # handed back again, then evicted with its pages: its prefetch no longer counts
    evict_everyone(kv, seed=10)
    assert not kv.users["a"].num_pages and not kv.users["a"].prefetched
    assert run(kv, "a", h) == (0, 19)  # loaded by its own acquire
    kv.check_invariants()


def test_without_tail_persistence_the_tail_is_lost():
    kv = manager(pages=6, persist_tails=False)
    h = hashes(19)
    run(kv, "a", h)
    run(kv, "a", h)  # a second step lets the full chunks' offload complete
    run(kv, "b", hashes(16, 1))
    kv.begin_step()
    assert kv.users["a"].host_tokens == 16 and kv.stats.lost_tokens == 3
    assert run(kv, "a", h) == (0, 16)
    kv.check_invariants()


def test_user_returning_while_its_offload_is_in_flight():
    kv = manager(pages=6)
    h = hashes(16)
    run(kv, "a", h)  # end_step launched the offload of both chunks; it completes at the next poll
    assert kv.users["a"].host_tokens == 0 and kv.users["a"].readers == 1
    # Before any poll, "a" returns with two more events: served from its GPU pages.
    hit = kv.acquire("a", hashes(18), 18)
    assert hit == (16, 0)
    kv.commit("a", 18, hashes(18))
    kv.release("a")
    kv.begin_step()
    assert kv.users["a"].host_tokens == 16 and kv.users["a"].readers == 0
    kv.check_invariants()


def test_user_returning_before_its_eviction_copy_finished_waits_for_it():
    """A user evicted from the GPU has its tail copied to host at the next launch; a request of that user acquired
    before the copy finished (here: before it was issued) waits for the copy and reuses its whole history, K/V
    identical, counted in ``unfinished_copy_tokens`` (and only then: once the copy finished, nothing to wait for)."""
    for wait in (False, True):
        kv = manager(pages=6)
        h = hashes(19)
        run(kv, "a", h)
        run(kv, "a", h)  # a second step lets the two full chunks' copy finish: 16 tokens on host
        served = kv_of(kv, "a", 19)
        kv.begin_step()
        hit = kv.acquire("b", hashes(24, 1), 24)  # the whole pool: "a" leaves the GPU, its 3-token tail is copied
        assert hit is not None and not kv.users["a"].num_pages
        kv.commit("b", 24, hashes(24, 1))
        kv.release("b")
        if wait:  # the next step: the tail's copy was issued and has finished
            kv.end_step()
            kv.begin_step()
        assert kv.acquire("a", h, 19) == (0, 19)  # without the wait: decided, not issued
        assert kv.stats.unfinished_copy_tokens == (0 if wait else 3)
        kv.launch_onloads()
        assert torch.equal(kv_of(kv, "a", 19), served)
        kv.check_invariants()


def test_lru_skips_users_whose_pages_are_being_read():
    kv = manager(pages=6)
    run(kv, "a", hashes(8))  # one full chunk: its offload is launched at end_step
    assert kv.users["a"].readers == 1  # until the gather completes (next poll)
    assert kv.acquire("b", hashes(4, 1), 4) is not None  # no poll in between: "a" still a reader
    kv.commit("b", 4, hashes(4, 1))
    kv.release("b")
    hit = kv.acquire("c", hashes(16, 2), 16)  # needs 4 pages, 3 free: someone must go
    assert hit is not None
    assert kv.users["a"].num_pages and not kv.users["b"].num_pages  # oldest "a" was skipped, "b" evicted
    kv.check_invariants()


def test_admission_control_defers_then_retries():
    kv = manager(pages=12, max_pending=1)
    h = hashes(32)  # 4 full chunks
    run(kv, "a", h)
    assert kv.host.pending_chunks == 1 and kv.stats.deferred_offloads == 3
    for _ in range(4):
        kv.begin_step()
        kv.end_step()
    kv.begin_step()
    assert kv.users["a"].host_tokens == 32 and kv.host.pending_chunks == 0
    kv.check_invariants()


def test_host_lru_drops_least_recent_user_when_full():
    kv = manager(pages=12, host_chunks=4)
    for i, user in enumerate("abc"):
        run(kv, user, hashes(16, i))  # 2 chunks each: the third does not fit on host
        kv.begin_step()
    assert kv.stats.host_evicted_users == 1 and kv.users["a"].host_tokens == 0
    assert kv.users["b"].host_tokens == 16 and kv.users["c"].host_tokens == 16
    kv.check_invariants()


def test_changed_history_discards_host_copy_beyond_the_change():
    kv = manager(pages=6)
    items = np.arange(19) % 50
    run(kv, "a", page_prefix_hashes(items, np.zeros(19, int), np.arange(19), PS))
    run(kv, "b", hashes(20, 1))  # evicts "a" to host
    kv.begin_step()
    assert kv.users["a"].host_tokens == 19
    items[10] += 1  # an event of the second chunk (page 2) changed
    assert run(kv, "a", page_prefix_hashes(items, np.zeros(19, int), np.arange(19), PS)) == (0, 8)
    assert kv.stats.truncated_tokens == 11
    kv.check_invariants()


def test_slot_freed_during_onload_is_reused_only_after_it():
    kv = manager(pages=5, host_chunks=2)
    run(kv, "a", hashes(16))  # 2 chunks: the whole host pool
    run(kv, "b", hashes(7, 1))  # evicts "a" to host ("b" has no full chunk to offload)
    kv.begin_step()
    assert kv.users["a"].host_tokens == 16 and kv.host.store.num_free == 0
    assert kv.acquire("a", hashes(16), 16) == (0, 16)
    kv.launch_onloads()  # the onload of a's two slots is in flight until the next poll
    kv.commit("a", 16, hashes(16))
    kv.release("a")
    # "c" needs a slot: "a" is the least recent host user and is dropped, but its slots are still
    # being read, so they are freed only after the onload completes: the offload must wait.
    kv.acquire("c", hashes(8, 2), 8)
    kv.commit("c", 8, hashes(8, 2))
    kv.release("c")
    kv.end_step()
    assert kv.stats.host_evicted_users == 1 and kv.host.store.num_free == 0
    assert kv.host.pending_chunks == 0 and kv.stats.deferred_offloads == 1
    kv.begin_step()  # the onload completes: a's slots are free now
    assert kv.host.store.num_free == 2
    kv.end_step()  # the retried offload of "c" takes one
    kv.begin_step()
    assert kv.users["c"].host_tokens == 8
    kv.check_invariants()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_run_keeps_kv_consistent(seed):
    """Random visits under tiny budgets: every reused token's K/V equals what was written for it."""
    rng = np.random.default_rng(seed)
    kv = manager(pages=10, host_chunks=6, max_pending=2)
    lengths: dict[str, int] = {}
    for _ in range(400):
        user = f"u{rng.integers(0, 6)}"
        n = min(36, lengths.get(user, 0) + int(rng.integers(0, 9)))
        h = hashes(n, seed=int(user[1:]))
        hit = run(kv, user, h)
        assert hit.total <= lengths.get(user, 0)
        lengths[user] = n
        if n == 0:
            continue
        expected = torch.tensor([float(hash((user, t)) % 1000) for t in range(n)])
        got = kv_of(kv, user, n)
        assert torch.equal(got, expected.view(1, n, 1, 1, 1).expand_as(got)), "stale or foreign KV served"
        kv.check_invariants()
    assert kv.stats.onloaded_tokens > 0 and kv.stats.host_evicted_users > 0 and kv.stats.evicted_users > 0


def fp8_round_trip(fill) -> tuple[torch.Tensor, torch.Tensor]:
    """User "a" (19 tokens: two whole chunks and a tail of 3, whose last page holds 3 of its PS = 4 rows) with K/V
    written by ``fill(kv_cache, pages)``, evicted by user "b" to FP8 host chunks, its tail too, then served from
    host again: its K/V before and after, ``[L, 19, 2, H, D]``."""
    slot_bytes = 2 * CHUNK * 2 * 1 * 2 * 1  # FP8: one byte a value
    config = CacheConfig(mode="hierarchical", page_size=PS, num_gpu_pages=6, chunk_tokens=CHUNK,
                         host_budget_bytes=8 * slot_bytes, host_segment_bytes=3 * slot_bytes,
                         host_dtype="float8_e4m3fn")
    kv = KVCacheManager(config, num_layers=2, num_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    assert kv.host.store.dtype == torch.float8_e4m3fn and kv.host.store.num_slots == 8
    h = hashes(19)
    kv.begin_step()
    kv.acquire("a", h, 19)
    fill(kv.kv_cache, kv.users["a"].pages)
    before = kv_of(kv, "a", 19)
    kv.commit("a", 19, h)
    kv.release("a")
    kv.end_step()
    run(kv, "b", hashes(16, 1))  # evicts "a": its tail goes to host too
    kv.begin_step()
    assert run(kv, "a", h) == (0, 19)
    after = kv_of(kv, "a", 19)
    kv.check_invariants()
    return before, after


def test_fp8_host_chunks_round_trip_within_e4m3_precision():
    def fill(kv_cache, pages):  # K small, V large: scales are per K/V
        kv_cache[:, pages] = torch.randn(2, len(pages), 2, PS, 1, 2) * torch.tensor([1.0, 30.0]).view(1, 1, 2, 1, 1, 1)

    before, after = fp8_round_trip(fill)
    amax = before.abs().amax(dim=(1, 4), keepdim=True)  # per layer, K/V, head (as the scales)
    err = ((after - before).abs() / amax).max()
    assert 0 < err <= 2**-4  # e4m3 keeps 3 mantissa bits: relative error <= 1/16 of the block's max


def test_fp8_tail_copies_do_not_depend_on_what_its_last_page_held_before():
    """A tail's last page holds rows past the user's tokens (what the page's previous owner wrote): they do not
    enter the tail's FP8 scales, so the user's history comes back from host the same either way."""
    values = torch.randn(2, 5, 2, PS, 1, 2, generator=torch.Generator().manual_seed(5))

    def fill(stale):
        def write(kv_cache, pages):
            kv_cache[:, pages] = values
            kv_cache[:, pages[-1], :, 19 % PS:] = stale
        return write

    (_, clean), (_, stale) = fp8_round_trip(fill(0.0)), fp8_round_trip(fill(1e4))
    assert torch.equal(clean, stale)


def test_engines_can_share_a_preallocated_host_arena():
    """Successive engines reuse one host memory arena (pinning is slow); results stay exact."""
    from gr_engine import GREngine
    from tests.conftest import tiny_config, with_cache
    from tests.test_engine_differential import max_diff, stream

    config = with_cache(tiny_config(host_chunks=400), mode="hierarchical", num_gpu_pages=100)
    requests = stream(config, num_users=10, visits=6, seed=2)
    expected = GREngine(with_cache(config, mode="recompute")).rank(requests, use_tqdm=False)
    arena = torch.empty(config.cache.host_budget_bytes // 2, dtype=torch.uint8)  # room for 200 chunks
    for _ in range(2):
        engine = GREngine(config, host_memory=arena)
        assert engine.kv.host.store.num_slots == 200 and engine.kv.host.store.num_free == 200
        assert max_diff(engine.rank(requests, use_tqdm=False), expected) <= 1e-5
        assert engine.stats.host_hit_tokens > 0
        engine.close()


class _Event:
    """A stand-in for a CUDA event: ``query()`` says whether the work before it is done."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class _PendingCopy(_Event):
    """A copy to host that finishes only when waited for (``synchronize``)."""

    def synchronize(self) -> None:
        self.done = True


def test_returning_user_waits_for_its_copy_in_flight_and_is_not_prefetched_meanwhile(monkeypatch):
    kv = manager(pages=6)
    h = hashes(19)
    run(kv, "a", h)
    run(kv, "a", h)  # 16 tokens on host
    served = kv_of(kv, "a", 19)
    offload, copies = kv.host.transfer.offload, []

    def slow_offload(*args):  # the copy is done (the CPU copies at once), but reports done only once waited for
        offload(*args)
        copies.append(_PendingCopy(False))
        return copies[-1]

    monkeypatch.setattr(kv.host.transfer, "offload", slow_offload)
    run(kv, "b", hashes(24, 1))  # "a" leaves the GPU; end_step issues its tail's copy
    kv.begin_step()  # the copy has not finished: "a" has 16 tokens on host, 3 in flight
    assert kv.users["a"].host_tokens == 16 and not copies[-1].done
    kv.prefetch(["a"])  # skipped: its acquire waits for the copy instead
    assert not kv.users["a"].num_pages
    assert kv.acquire("a", h, 19) == (0, 19) and copies[-1].done
    assert kv.stats.unfinished_copy_tokens == 3
    kv.launch_onloads()
    assert torch.equal(kv_of(kv, "a", 19), served)
    kv.check_invariants()


@pytest.mark.parametrize("done", [False, True])
def test_a_finished_prefetch_leaves_nothing_to_wait_for(monkeypatch, done):
    """The step after a prefetch waits for the prefetch's per-layer events while its onload runs (a step replayed
    from CUDA graphs then replays one graph per layer), and for nothing once the last layer's event reports done
    (events are recorded in layer order on one stream)."""
    kv = manager()
    events = [_Event(done), _Event(done)]
    monkeypatch.setattr(kv.host, "launch", lambda: [None, None])
    kv._prefetch_events = events
    assert kv.launch_onloads() == ([None, None] if done else events)
    monkeypatch.setattr(kv.host, "launch", lambda: events)  # the step's own onload, just launched
    assert kv.launch_onloads() == ([None, None] if done else events)


def test_staging_pages_are_validated_and_warming_transfers_is_a_no_op_off_cuda():
    """``cache.staging_pages`` must be positive; on CPU there are no onload kernels or staging buffer to prepare
    (also without a host tier)."""
    with pytest.raises(ValueError, match="staging_pages"):
        CacheConfig(staging_pages=0)
    for mode in ("hierarchical", "gpu_only"):
        kv = KVCacheManager(CacheConfig(mode=mode, page_size=4, num_gpu_pages=12, chunk_tokens=8,
                                        host_budget_bytes=1 << 20, staging_pages=4), 1, 1, 4,
                            torch.float32, torch.device("cpu"))
        kv.warm_transfers()
        assert kv.host is None or kv.host.transfer._launcher is None
