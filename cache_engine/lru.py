"""An O(1) least-recently-used index (a hash map over a doubly linked list)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator


class LRUIndex:
    """Keys ordered from least to most recently used; every operation is O(1).

    ``collections.OrderedDict`` is exactly a hash map threaded by a doubly linked list, so it is used
    as the storage; this class only names the operations an eviction policy needs.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable) -> None:
        """Insert ``key`` or mark it most recently used."""
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        """Drop ``key`` if present."""
        self._order.pop(key, None)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Hashable]:
        """Keys from least to most recently used."""
        return iter(self._order)
