"""An O(1) least-recently-used index (a hash map over a doubly linked list)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any


class LRUIndex(OrderedDict[Hashable, Any]):
    """Keys ordered from least to most recently used (iteration order); every operation is O(1).

    ``collections.OrderedDict`` is exactly a hash map threaded by a doubly linked list, so this class is
    one: membership, ``len``, lookup and iteration (least recently used first) are the dict's own C code,
    and it only adds the two operations an eviction policy names. A key may carry a value (e.g. the user's
    record, so that a policy walking the order needs no second lookup).
    """

    def touch(self, key: Hashable, value: Any = None) -> None:
        """Insert ``key`` (with ``value``) or mark it most recently used (and set its value)."""
        self[key] = value
        self.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        """Drop ``key`` if present."""
        self.pop(key, None)

