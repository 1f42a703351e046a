"""Consistent-hash routing of users to replicas: every request of a user goes to the replica that holds its KV cache.

Positions on the ring are 64-bit unsigned integers, ``stable_hash(x) = int.from_bytes(blake2b(str(x).encode("utf-8"),
digest_size=8).digest(), "big")``, the same in every process and Python version (never Python's salted ``hash()``).
Virtual node ``i`` of replica ``r`` sits at ``stable_hash(f"{r}#{i}")`` and user ``u`` at ``stable_hash(u)`` (so the
int ``5`` and the str ``"5"`` are the same user); a user belongs to the replica of the first virtual node at or after
its position, wrapping past the top. Adding a replica therefore moves to it only the users it now owns (about 1/N of
them); removing one sends only its users on, each to the next replica on the ring.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")
UserId = int | str
Indexed = list[tuple[int, T]]  # (position in the batch, request or result) pairs

#: Virtual nodes per replica: the smallest count of the sweep 50, 100, 200, 400, 600, 800, 1600 whose load imbalance
#: (max / mean requests per replica) on ``benchmarks/scale_out.py``'s KuaiRand-like trace, 1,000 users per replica, is
#: at most 1.10 at 2, 4 and 8 replicas: 1.07, 1.07, 1.06 (400: 1.12 at 8; 600: 1.12 at 4). At 16 replicas it is 1.10,
#: mostly the trace's heavy-tailed users per replica, not the ring (the ring's own hash-space share: 1.05).
DEFAULT_VIRTUAL_NODES = 800


def stable_hash(key: object) -> int:
    """The ring position of ``key`` (an int in ``[0, 2**64)``): 8-byte blake2b of ``str(key)`` in UTF-8, big-endian."""
    return int.from_bytes(hashlib.blake2b(str(key).encode("utf-8"), digest_size=8).digest(), "big")


def _user_of(request: Any) -> UserId:
    return request.user_id


class HashRing:
    """Replicas (ints or strs, by ``str``: distinct strings needed) on a consistent-hash ring of ``virtual_nodes``
    points each. Raises ``ValueError`` for fewer than one virtual node, a duplicate replica or an unknown one."""

    def __init__(self, replicas: Iterable[Hashable] = (), virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be at least 1, got {virtual_nodes}")
        self.virtual_nodes = virtual_nodes
        self._replicas: list[Hashable] = []
        self._points: list[tuple[int, str]] = []  # (position, str(replica)), sorted; ties broken by the name
        self._by_name: dict[str, Hashable] = {}
        for replica in replicas:
            self._insert(replica)
        self._rebuild()

    @property
    def replicas(self) -> list[Hashable]:
        """The replicas, in the order they were added."""
        return list(self._replicas)

    def __len__(self) -> int:
        return len(self._replicas)

    def __contains__(self, replica: object) -> bool:
        return replica in self._replicas

    def add(self, replica: Hashable) -> None:
        """Put ``replica`` on the ring: it takes over the users whose next virtual node is now one of its own."""
        self._insert(replica)
        self._rebuild()

    def remove(self, replica: Hashable) -> None:
        """Take ``replica`` off the ring (it died or was removed): its users go on to their next replica."""
        if replica not in self._replicas:
            raise ValueError(f"replica {replica!r} is not on the ring")
        self._replicas.remove(replica)
        del self._by_name[str(replica)]
        self._points = [p for p in self._points if p[1] != str(replica)]
        self._rebuild()

    def route(self, user: UserId) -> Hashable:
        """The replica of ``user``. Raises ``LookupError`` on an empty ring."""
        return self._owners[self._slot(stable_hash(user))]

    def route_many(self, users: Iterable[UserId]) -> list[Hashable]:
        """:meth:`route` of each of ``users``, with one vectorised search of the ring (about 1 us per user)."""
        if not self._replicas:
            raise LookupError("no replica on the ring")
        positions = np.fromiter((stable_hash(u) for u in users), dtype=np.uint64)
        slots = np.searchsorted(self._positions, positions, side="left") % len(self._positions)
        owners = self._owners
        return [owners[s] for s in slots.tolist()]

    def preference(self, user: UserId, count: int | None = None) -> list[Hashable]:
        """The first ``count`` (default all) distinct replicas after ``user``'s position, in ring order: ``[0]`` is
        :meth:`route`, ``[1]`` where the user goes if that one is removed, and so on."""
        count = len(self._replicas) if count is None else min(count, len(self._replicas))
        start, found = self._slot(stable_hash(user)), []
        for k in range(len(self._owners)):
            owner = self._owners[(start + k) % len(self._owners)]
            if owner not in found:
                found.append(owner)
                if len(found) == count:
                    break
        return found

    def split(self, requests: Sequence[T], user_of: Callable[[T], UserId] = _user_of) -> dict[Hashable, Indexed[T]]:
        """The requests of a batch by replica: ``{replica: [(index in requests, request), ...]}``, each list in input
        order, only replicas with requests. ``user_of`` gives a request's user (default: its ``user_id``)."""
        parts: dict[Hashable, list[tuple[int, T]]] = {}
        for index, (request, replica) in enumerate(zip(requests, self.route_many(user_of(r) for r in requests))):
            parts.setdefault(replica, []).append((index, request))
        return parts

    @staticmethod
    def merge(parts: Mapping[Hashable, Iterable[tuple[int, T]]]) -> list[T]:
        """Inverse of :meth:`split` for the replicas' answers (``(index, result)`` pairs): the results in input order.
        Raises ``ValueError`` unless the indices are exactly ``0 .. n - 1``, each once."""
        pairs = [pair for part in parts.values() for pair in part]
        merged: list[Any] = [None] * len(pairs)
        seen = np.zeros(len(pairs), dtype=bool)
        for index, result in pairs:
            if not 0 <= index < len(pairs) or seen[index]:
                raise ValueError(f"index {index} is out of range or repeated in merge")
            seen[index] = True
            merged[index] = result
        return merged

    def _insert(self, replica: Hashable) -> None:
        name = str(replica)
        if name in self._by_name:
            raise ValueError(f"replica {replica!r} is already on the ring")
        self._replicas.append(replica)
        self._by_name[name] = replica
        self._points += [(stable_hash(f"{name}#{i}"), name) for i in range(self.virtual_nodes)]

    def _rebuild(self) -> None:
        self._points.sort()
        self._positions = np.array([p for p, _ in self._points], dtype=np.uint64)
        self._owners = [self._by_name[name] for _, name in self._points]
        self._position_list = [p for p, _ in self._points]

    def _slot(self, position: int) -> int:
        if not self._owners:
            raise LookupError("no replica on the ring")
        return bisect.bisect_left(self._position_list, position) % len(self._owners)
