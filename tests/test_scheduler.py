"""Scheduler rules: batch and token bounds, per-user order, chunked prefill, waiting for pages."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from cache_engine import CacheConfig, KVCacheManager, page_prefix_hashes
from scheduler import RequestState, RequestStatus, Scheduler, SchedulerConfig

_seq = itertools.count()


def request(user, n, candidates=4, retrieval=False) -> RequestState:
    items = np.arange(n) % 97
    h = page_prefix_hashes(items, np.zeros(n, int), np.arange(n), 4)
    return RequestState(seq_id=next(_seq), user_id=user, num_history=n, num_candidates=0 if retrieval else candidates,
                        reuse_limit=n - 1 if retrieval else n, token_hashes=h)


def make(max_num_seqs=4, budget=64, pages=64, mode="gpu_only", chunk=None) -> Scheduler:
    kv = KVCacheManager(CacheConfig(mode=mode, page_size=4, num_gpu_pages=pages), 1, 1, 2, torch.float32, "cpu")
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_chunk_tokens=chunk)
    return Scheduler(config, kv)


def run_step(s: Scheduler):
    plan = s.schedule()
    finished = s.complete(plan.chunks)
    return plan, finished


def test_batch_and_token_bounds():
    s = make(max_num_seqs=3, budget=64)
    for u in range(10):
        s.add(request(u, 10, candidates=5))
    plan, _ = run_step(s)
    assert len(plan.chunks) == 3
    assert sum(c.num_tokens for c in plan.chunks) <= 64
    while s.num_unfinished:
        plan, _ = run_step(s)
        assert len(plan.chunks) <= 3 and sum(c.num_tokens for c in plan.chunks) <= 64


def test_one_request_per_user_per_step_in_arrival_order():
    s = make(max_num_seqs=8, budget=1000)
    reqs = [request("a", 5), request("a", 8), request("b", 5), request("a", 9)]
    for r in reqs:
        s.add(r)
    order = []
    while s.num_unfinished:
        plan, finished = run_step(s)
        users = [c.request.user_id for c in plan.chunks]
        assert len(users) == len(set(users))
        order += [r.seq_id for r in finished if r.user_id == "a"]
    assert order == [reqs[0].seq_id, reqs[1].seq_id, reqs[3].seq_id]
    # The second visit of "a" reused the first visit's 5 cached tokens.
    assert reqs[1].num_reused == 5 and reqs[3].num_reused == 8


def test_cold_long_history_is_chunked_without_stalling_others():
    s = make(max_num_seqs=4, budget=40, pages=128)
    cold = request("cold", 150, candidates=6)
    s.add(cold)
    small = [request(f"s{i}", 3, candidates=2) for i in range(6)]
    for r in small:
        s.add(r)
    steps, served_small_while_cold_ran = 0, 0
    spans = []
    while s.num_unfinished:
        plan, finished = run_step(s)
        steps += 1
        for c in plan.chunks:
            if c.request is cold:
                spans.append((c.start, c.end, c.final))
        if cold.status == RequestStatus.RUNNING:
            served_small_while_cold_ran += sum(r in small for r in finished)
    # Chunks cover the history contiguously; only the last one carries the candidates.
    assert spans[0][0] == 0 and spans[-1][1] == 150 and spans[-1][2]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)) and not any(f for *_, f in spans[:-1])
    assert len(spans) >= 8 and max(e - b for b, e, _ in spans) <= 20  # half the step budget
    assert served_small_while_cold_ran == len(small)
    assert all(r.status == RequestStatus.FINISHED for r in [cold, *small])


def test_candidates_wait_for_room_in_a_later_step():
    s = make(max_num_seqs=4, budget=20, chunk=20)
    r = request("u", 18, candidates=10)  # 18 + 10 > 20: history first, candidates next step
    s.add(r)
    plan, _ = run_step(s)
    assert (plan.chunks[0].end, plan.chunks[0].final) == (18, False)
    plan, finished = run_step(s)
    assert plan.chunks[0].num_history_rows == 0 and plan.chunks[0].final and finished == [r]


def test_first_come_first_served_across_users():
    s = make(max_num_seqs=2, budget=1000)
    reqs = [request(u, 4) for u in "abcdef"]
    for r in reqs:
        s.add(r)
    finished = []
    while s.num_unfinished:
        finished += run_step(s)[1]
    assert [r.user_id for r in finished] == list("abcdef")


def test_waits_for_pages_then_proceeds():
    s = make(max_num_seqs=4, budget=24, pages=10)  # 40 tokens of pages
    big = request("big", 36)  # 9 pages, prefilled over two steps
    other = request("other", 8)  # 2 pages: must wait until big releases
    s.add(big)
    s.add(other)
    plan, _ = run_step(s)
    assert [c.request.user_id for c in plan.chunks] == ["big"]
    assert other.status == RequestStatus.WAITING
    while s.num_unfinished:
        run_step(s)
    assert other.status == RequestStatus.FINISHED


def test_request_that_can_never_fit_fails_alone():
    s = make(max_num_seqs=4, budget=100, pages=6, mode="unlimited")
    s.add(request("a", 16))  # 4 pages, kept forever in unlimited mode
    run_step(s)
    s.add(request("b", 12))  # 3 pages, only 2 free and nothing may be evicted
    s.add(request("c", 4))
    plan = s.schedule()
    assert [r.user_id for r, _ in plan.failed] == ["b"] and "unlimited mode ran out" in plan.failed[0][1]
    assert [c.request.user_id for c in plan.chunks] == ["c"]


def test_retrieval_request_always_computes_its_last_event():
    s = make()
    s.add(request("u", 12))
    run_step(s)
    r = request("u", 12, retrieval=True)
    s.add(r)
    plan, finished = run_step(s)
    assert r.num_reused == 11 and plan.chunks[0].num_history_rows == 1 and finished == [r]


def test_an_admission_does_not_evict_a_user_admitted_later_in_the_same_step():
    """c's acquire needs more pages than are free: it evicts the least recently used user, but not "a", whose
    request comes after c's in this step (its cached history is reused); b goes instead."""
    s = make(max_num_seqs=4, budget=1000, pages=6)
    for user in ("a", "b"):
        s.add(request(user, 8))
        run_step(s)  # a, then b: "a" is the least recently used
    c, a = request("c", 12), request("a", 8)
    s.add(c)
    s.add(a)
    plan, _ = run_step(s)
    assert [chunk.request.user_id for chunk in plan.chunks] == ["c", "a"]
    assert a.num_gpu_hits == 8 and not s.kv.users.get("b", None)


def test_next_users_are_the_heaps_smallest_in_order():
    """The users a pass may admit, read off the heap's top levels, are heapq.nsmallest's, in order."""
    import heapq
    import random

    rng = random.Random(0)
    s = make()
    for size in (0, 1, 2, 7, 40, 300):
        seqs = rng.sample(range(10_000), size)
        s._ready = [(seq, f"u{seq}") for seq in seqs]
        heapq.heapify(s._ready)
        for count in (1, 4, 16, size + 3):
            assert s._next_users(count) == [user for _, user in heapq.nsmallest(count, s._ready)]


def test_unfinished_count_follows_every_queue_change():
    """``num_unfinished`` is kept as a count (a backlog of any size costs O(1) per step): under random adds, steps,
    failures, retries alone and aborts it always equals the requests waiting in the per-user queues plus those
    running, and every request ends finished or failed."""
    rng = np.random.default_rng(3)
    s = make(max_num_seqs=3, budget=40, pages=12)
    added = []
    for _ in range(300):
        action = rng.random()
        if action < 0.45:
            added.append(request(int(rng.integers(0, 6)), int(rng.integers(1, 70)), candidates=int(rng.integers(0, 5))))
            s.add(added[-1])
        elif action < 0.85:
            plan = s.schedule()
            s.complete(plan.chunks)
        elif s.running:
            victim = s.running[int(rng.integers(0, len(s.running)))]
            s.retry_alone(victim) if rng.random() < 0.5 else s.abort(victim)
        waiting = sum(len(q) for q in s._queues.values())
        assert s.num_unfinished == waiting + len(s.running)
    while s.num_unfinished:
        s.complete(s.schedule().chunks)
    assert all(r.status in (RequestStatus.FINISHED, RequestStatus.FAILED) for r in added)
    assert s.num_unfinished == 0 and not s._queues
