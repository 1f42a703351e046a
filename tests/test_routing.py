"""The consistent-hash router (gr_engine/routing.py): stable positions, ~1/N movement on add/remove, split/merge."""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gr_engine.routing import HashRing

USERS = range(20_000)


def blake(key: str) -> int:
    """The position definition, recomputed here from hashlib alone."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


def reference_route(replicas: list[str], virtual_nodes: int, user: int | str) -> str:
    points = sorted((blake(f"{r}#{i}"), r) for r in replicas for i in range(virtual_nodes))
    slot = bisect.bisect_left([p for p, _ in points], blake(str(user))) % len(points)
    return points[slot][1]


@dataclass
class Req:
    user_id: int | str
    payload: int = 0


def test_positions_are_blake2b_and_a_fixed_mapping():
    # Fixed values of the definition (computed once with hashlib): a change of hash would move every deployed user.
    assert blake("0") == 0x842B7D9D43CDDF75 and blake("alice") == 0x4DEAEC0CCE54DA89
    expected = {0: "c", 1: "a", 42: "b", 10**12: "a", "alice": "b", "user-7": "a", "": "b"}
    ring = HashRing(["a", "b", "c"], virtual_nodes=7)
    assert {u: ring.route(u) for u in expected} == expected
    assert all(reference_route(["a", "b", "c"], 7, u) == r for u, r in expected.items())


def test_int_and_str_ids_are_the_same_user():
    ring = HashRing(range(5), virtual_nodes=16)
    assert all(ring.route(u) == ring.route(str(u)) for u in range(200))


def test_every_user_maps_to_one_known_replica_and_route_many_agrees():
    ring = HashRing([f"r{i}" for i in range(8)], virtual_nodes=50)
    routed = ring.route_many(USERS)
    assert set(routed) == set(ring.replicas)
    assert routed[:500] == [ring.route(u) for u in range(500)]


def test_deterministic_across_rings():
    one = HashRing(["x", "y", "z"], virtual_nodes=32).route_many(USERS)
    other = HashRing(["z", "x", "y"], virtual_nodes=32).route_many(USERS)  # insertion order does not matter
    assert one == other


@pytest.mark.parametrize("n", [2, 4, 8])
def test_add_moves_only_to_the_new_replica_about_one_in_n_plus_one(n):
    ring = HashRing([f"r{i}" for i in range(n)], virtual_nodes=200)
    before = ring.route_many(USERS)
    ring.add("new")
    after = ring.route_many(USERS)
    moved = [b for b, a in zip(before, after) if a != b]
    assert all(a == "new" for b, a in zip(before, after) if a != b)
    share = len(moved) / len(USERS)
    # 200 virtual nodes: the new replica's arc share is within ~ +-30 % of 1 / (n + 1) (7 sigma of the arc spread).
    assert 0.6 / (n + 1) < share < 1.4 / (n + 1)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_remove_moves_only_the_removed_replicas_users_to_their_next_replica(n):
    ring = HashRing([f"r{i}" for i in range(n)], virtual_nodes=200)
    before = ring.route_many(USERS)
    second = [ring.preference(u, 2) for u in range(2000)]
    ring.remove("r1")
    after = ring.route_many(USERS)
    assert all(b == a for b, a in zip(before, after) if b != "r1")
    assert "r1" not in after
    assert all(after[u] == second[u][1] for u in range(2000) if before[u] == "r1")
    share = sum(b == "r1" for b in before) / len(USERS)
    assert 0.6 / n < share < 1.4 / n


def test_preference_lists_distinct_replicas_starting_with_route():
    ring = HashRing(range(6), virtual_nodes=10)
    for user in range(100):
        pref = ring.preference(user)
        assert pref[0] == ring.route(user) and sorted(pref) == list(range(6))


def test_split_and_merge_round_trip_in_order():
    ring = HashRing(["a", "b", "c", "d"], virtual_nodes=20)
    batch = [Req(u, i) for i, u in enumerate([5, 9, 5, "bob", 77, 3, 9, 1000])]
    parts = ring.split(batch)
    for replica, pairs in parts.items():
        assert [i for i, _ in pairs] == sorted(i for i, _ in pairs)
        assert all(ring.route(r.user_id) == replica and batch[i] is r for i, r in pairs)
    assert sum(len(p) for p in parts.values()) == len(batch)
    results = {rep: [(i, r.payload * 10) for i, r in reversed(pairs)] for rep, pairs in parts.items()}
    assert HashRing.merge(results) == [r.payload * 10 for r in batch]


def test_split_with_a_user_key_and_merge_rejects_bad_indices():
    ring = HashRing(["a", "b"], virtual_nodes=20)
    parts = ring.split([3, 4, 3], user_of=lambda u: u)
    assert HashRing.merge(parts) == [3, 4, 3]
    with pytest.raises(ValueError):
        HashRing.merge({"a": [(0, "x"), (0, "y")]})
    with pytest.raises(ValueError):
        HashRing.merge({"a": [(2, "x")]})


def test_errors():
    with pytest.raises(ValueError):
        HashRing(["a"], virtual_nodes=0)
    with pytest.raises(ValueError):
        HashRing(["a", "a"])
    ring = HashRing(["a"], virtual_nodes=4)
    with pytest.raises(ValueError):
        ring.remove("b")
    ring.remove("a")
    with pytest.raises(LookupError):
        ring.route(1)
    with pytest.raises(LookupError):
        ring.route_many([1])


@settings(max_examples=30, deadline=None)
@given(replicas=st.sets(st.integers(0, 50), min_size=1, max_size=6),
       users=st.lists(st.one_of(st.integers(-10**15, 10**15), st.text(max_size=8)), max_size=40),
       virtual_nodes=st.integers(1, 12))
def test_property_route_matches_reference_and_split_merge_round_trips(replicas, users, virtual_nodes):
    names = [str(r) for r in replicas]
    ring = HashRing(names, virtual_nodes=virtual_nodes)
    assert ring.route_many(users) == [reference_route(names, virtual_nodes, u) for u in users]
    parts = ring.split(users, user_of=lambda u: u)
    assert HashRing.merge(parts) == users
