"""Hashes that let the cache check, page by page, that a user's cached prefix matches a request.

For a history of ``n`` events, :func:`page_prefix_hashes` returns ``h[i]``: the hash of the tokens of
``i``'s page from the page start up to and including ``i``. So ``h[k * page_size + r - 1]`` identifies
the first ``r`` tokens of page ``k`` and a cached page holding ``r`` tokens is verified by one
comparison, with no per-token Python work.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_K_ITEM = np.uint64(0x9E3779B97F4A7C15)
_K_ACTION = np.uint64(0xC2B2AE3D27D4EB4F)
_K_TIME = np.uint64(0x165667B19E3779F9)
_K_SLOT = np.uint64(0x27D4EB2F165667C5)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _C1
    x = x ^ (x >> np.uint64(27))
    x = x * _C2
    return x ^ (x >> np.uint64(31))


def page_prefix_hashes(
    item_ids: np.ndarray, action_ids: np.ndarray, timestamps: np.ndarray, page_size: int
) -> np.ndarray:
    """Within-page cumulative token hashes.

    Args:
        item_ids, action_ids, timestamps: int ``[n]`` history events.
        page_size: tokens per page.

    Returns:
        uint64 ``[n]``: entry ``i`` hashes the tokens from ``i``'s page start through ``i``.
    """
    n = len(item_ids)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    slot = (np.arange(n, dtype=np.uint64) % np.uint64(page_size)) * _K_SLOT
    with np.errstate(over="ignore"):
        # Fields are absorbed one after another, each followed by a full mix.
        token = _mix(np.asarray(item_ids).astype(np.uint64) * _K_ITEM + slot)
        token = _mix(token ^ (np.asarray(timestamps).astype(np.uint64) * _K_TIME))
        token = _mix(token ^ (np.asarray(action_ids).astype(np.uint64) * _K_ACTION))
        num_pages = -(-n // page_size)
        padded = np.zeros(num_pages * page_size, dtype=np.uint64)
        padded[:n] = token
        return np.cumsum(padded.reshape(num_pages, page_size), axis=1, dtype=np.uint64).reshape(-1)[:n]


Fields = tuple[np.ndarray, np.ndarray, np.ndarray]  # item_ids, action_ids, timestamps: int ``[n]`` each


@dataclass(eq=False)
class _History:
    """A user's last history as the hasher keeps it: ``fields`` buffers whose first ``length`` entries hold it,
    its hashes (``uint64 [length]``, never written after creation), whether the buffers are the hasher's own
    (then a longer next history may be written into them in place) and a ``version`` bumped by every such write."""

    fields: Fields
    length: int
    hashes: np.ndarray
    owned: bool
    version: int = 0


@dataclass(frozen=True, eq=False)
class PrefixMatch:
    """What a request shares with its user's last kept history (:meth:`IncrementalHasher.match`).

    Attributes:
        length: leading events (a whole number of pages) equal to that history's, so already hashed and, in
            the engine, already validated; 0 when nothing is shared.
        hashes: uint64 ``[length]``, their :func:`page_prefix_hashes`.
    """

    length: int
    hashes: np.ndarray
    source: _History | None = None
    version: int = 0


_NO_MATCH = PrefixMatch(0, np.zeros(0, dtype=np.uint64))


class IncrementalHasher:
    """:func:`page_prefix_hashes` that reuses each user's previous result.

    A returning user's history usually extends the previous request's. The previous request's events are
    kept (for the ``max_users`` most recent users); if the new history starts with them (an exact comparison,
    cheaper than hashing), only the pages from the last page boundary on are hashed again. :meth:`many`
    hashes the new parts of several requests in one vectorised pass. A kept history that the next one extends
    is extended in place (its buffers have room to grow), so only the new events are copied.

    Args:
        page_size: tokens per page.
        max_users: users whose last history is kept (least recently used dropped first).
    """

    def __init__(self, page_size: int, max_users: int = 4096) -> None:
        self.page_size = page_size
        self.max_users = max_users
        self._last: OrderedDict[Hashable, _History] = OrderedDict()

    def __contains__(self, user_id: Hashable) -> bool:
        """Whether the user's last history is kept (its next request hashes only what is new)."""
        return user_id in self._last

    def __call__(self, user_id: Hashable, item_ids: np.ndarray, action_ids: np.ndarray,
                 timestamps: np.ndarray) -> np.ndarray:
        """uint64 ``[n]``, equal to ``page_prefix_hashes(item_ids, action_ids, timestamps, page_size)``."""
        return self.many([(user_id, item_ids, action_ids, timestamps)])[0]

    def match(self, user_id: Hashable, item_ids: np.ndarray, action_ids: np.ndarray,
              timestamps: np.ndarray) -> PrefixMatch:
        """How much of this history (int64 arrays ``[n]``) equals the user's last kept one, in whole pages."""
        kept = self._last.get(user_id)
        if kept is None:
            return _NO_MATCH
        common = min(kept.length, len(item_ids)) // self.page_size * self.page_size
        new = (item_ids, action_ids, timestamps)
        if common and all(np.array_equal(old[:common], f[:common]) for old, f in zip(kept.fields, new, strict=True)):
            return PrefixMatch(common, kept.hashes[:common], kept, kept.version)
        return _NO_MATCH

    def many(self, requests: list[tuple[Hashable, np.ndarray, np.ndarray, np.ndarray]],
             matches: list[PrefixMatch] | None = None) -> list[np.ndarray]:
        """:meth:`__call__` of each ``(user_id, item_ids, action_ids, timestamps)``, in order. ``matches``: each
        request's :meth:`match`, taken earlier (e.g. to validate only the unmatched events); without them a
        user recurring in ``requests`` reuses its earlier request's result."""
        results: list[np.ndarray] = []
        pending: list[tuple[Hashable, Fields, PrefixMatch]] = []
        for k, (user_id, *fields) in enumerate(requests):
            if matches is None and any(user == user_id for user, _, _ in pending):
                results += self._finish(pending)  # its previous request must be hashed and kept first
                pending = []
            match = matches[k] if matches is not None else self.match(user_id, *fields)
            pending.append((user_id, tuple(fields), match))
        return results + self._finish(pending)

    def remember(self, user_id: Hashable, item_ids: np.ndarray, action_ids: np.ndarray, timestamps: np.ndarray,
                 hashes: np.ndarray) -> None:
        """Take ``hashes`` (:func:`page_prefix_hashes` of these events, computed elsewhere) as the user's last
        request, without copying: the arrays must not change afterwards (e.g. a benchmark's fast-forward), and
        the engine takes them as validated events."""
        self._keep(user_id, _History((item_ids, action_ids, timestamps), len(item_ids), hashes, owned=False))

    def _finish(self, pending: list[tuple[Hashable, Fields, PrefixMatch]]) -> list[np.ndarray]:
        """Hash the unmatched tails of ``pending`` in one call (each tail starts on a page boundary and is
        padded to whole pages, so pages never mix requests) and keep each user's history."""
        if not pending:
            return []
        ps = self.page_size
        tails = [[f[match.length:] for f in fields] for _, fields, match in pending]
        padded = [-(-len(t[0]) // ps) * ps for t in tails]
        joined = [np.zeros(sum(padded), dtype=np.int64) for _ in range(3)]
        at = 0
        for tail, size in zip(tails, padded, strict=True):
            for column, field in zip(joined, tail, strict=True):
                column[at:at + len(field)] = field
            at += size
        hashed = page_prefix_hashes(*joined, ps)
        results, at = [], 0
        for (user_id, fields, match), tail, size in zip(pending, tails, padded, strict=True):
            hashes = np.concatenate([match.hashes, hashed[at:at + len(tail[0])]])
            at += size
            self._store(user_id, fields, match, hashes)
            results.append(hashes)
        return results

    def _store(self, user_id: Hashable, fields: Fields, match: PrefixMatch, hashes: np.ndarray) -> None:
        """Keep ``fields`` as the user's last history: written after the matched prefix into the buffers it was
        matched against when those are ours, unchanged since and large enough; otherwise copied to new ones."""
        n, kept, source = len(fields[0]), self._last.get(user_id), match.source
        if (source is not None and kept is source and source.owned and source.version == match.version
                and len(source.fields[0]) >= n):
            for buffer, field in zip(source.fields, fields, strict=True):
                buffer[match.length:n] = field[match.length:]
            source.length, source.hashes, source.version = n, hashes, source.version + 1
            self._keep(user_id, source)
            return
        capacity = n + n // 4 + 64  # room for the next visits' events
        buffers = tuple(np.empty(capacity, dtype=np.int64) for _ in range(3))
        for buffer, field in zip(buffers, fields, strict=True):
            buffer[:n] = field
        self._keep(user_id, _History(buffers, n, hashes, owned=True))

    def _keep(self, user_id: Hashable, history: _History) -> None:
        self._last[user_id] = history
        self._last.move_to_end(user_id)
        if len(self._last) > self.max_users:
            self._last.popitem(last=False)
