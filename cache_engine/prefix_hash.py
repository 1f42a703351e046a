"""Hashes that let the cache check, page by page, that a user's cached prefix matches a request.

:func:`page_prefix_hashes` returns ``h[i]``, the hash of ``i``'s page's tokens up to and including ``i``, so
``h[k * page_size + r - 1]`` verifies a cached page ``k`` of ``r`` tokens in one comparison (docs/design.md section 5).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .records import LRUIndex

# Constants as 0-d uint64 arrays: a ufunc takes those faster than numpy scalars.
_C1, _C2, _K_ITEM, _K_ACTION, _K_TIME, _K_SLOT = (np.array(c, dtype=np.uint64) for c in (
    0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
    0x27D4EB2F165667C5))
_S30, _S27, _S31 = (np.array(c, dtype=np.uint64) for c in (30, 27, 31))
_INT64 = np.dtype(np.int64)


def _mix(x: np.ndarray) -> None:
    """splitmix64's finaliser, elementwise and in place on uint64 ``x`` (wrapping arithmetic)."""
    x ^= x >> _S30
    x *= _C1
    x ^= x >> _S27
    x *= _C2
    x ^= x >> _S31


@lru_cache(maxsize=8)
def _slot_keys(page_size: int) -> np.ndarray:
    """uint64 ``[page_size]``: what each slot of a page adds to its token (read only)."""
    keys = np.arange(page_size, dtype=np.uint64) * _K_SLOT
    keys.flags.writeable = False
    return keys


def _hash_pages(fields: np.ndarray, page_size: int, out: np.ndarray) -> None:
    """:func:`page_prefix_hashes` of whole pages: ``fields``, int64 ``[3, pages * page_size]`` (item_ids,
    action_ids, timestamps), hashed into ``out``, uint64 ``[pages * page_size]``."""
    item, action, time = fields.view(np.uint64).reshape(3, -1, page_size)  # the int64 bits, as uint64
    # Fields are absorbed one after another, each followed by a full mix.
    token = item * _K_ITEM
    token += _slot_keys(page_size)
    _mix(token)
    token ^= time * _K_TIME
    _mix(token)
    token ^= action * _K_ACTION
    _mix(token)
    np.add.accumulate(token, axis=1, out=out.reshape(-1, page_size))


def page_prefix_hashes(
    item_ids: np.ndarray, action_ids: np.ndarray, timestamps: np.ndarray, page_size: int
) -> np.ndarray:
    """Within-page cumulative token hashes of the history events ``item_ids``, ``action_ids``, ``timestamps`` (int
    ``[n]`` each): uint64 ``[n]``, entry ``i`` hashing the tokens from ``i``'s page start through ``i``."""
    n = len(item_ids)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    width = -(-n // page_size) * page_size  # padded to whole pages
    fields, hashes = np.zeros((3, width), dtype=np.int64), np.empty(width, dtype=np.uint64)
    fields[0, :n], fields[1, :n], fields[2, :n] = item_ids, action_ids, timestamps
    _hash_pages(fields, page_size, hashes)
    return hashes[:n]


Fields = tuple[np.ndarray, np.ndarray, np.ndarray]  # item_ids, action_ids, timestamps: int ``[n]`` each


@dataclass(eq=False)
class _History:
    """A user's last history as the hasher keeps it, with room for the next visits' events.

    Attributes:
        buffer: the kept data (compared by ``bytearray.startswith``): int64 ``[4, capacity]`` rows item_ids,
            action_ids, timestamps and the hashes' uint64 bits; the history is the first ``length`` of each row.
        rows, hash_row: ``buffer`` as a numpy int64 ``[4, capacity]`` array (written through it), and ``rows[3]``
            as uint64; ``capacity`` events fit, ``row_bytes`` (``8 * capacity``) per row.
        length: events in the history.
        handed_out: leading hashes given out as views (``>= length``): never written again.
        version: bumped by every write to the events.
    """

    buffer: bytearray
    rows: np.ndarray
    hash_row: np.ndarray
    capacity: int
    row_bytes: int
    length: int
    handed_out: int
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
_NO_TAIL = np.zeros((4, 0), dtype=_INT64)


class IncrementalHasher:
    """:func:`page_prefix_hashes` that reuses each user's previous result.

    The previous request's events are kept (for the ``max_users`` most recent users); if the new history starts with
    them (an exact byte comparison, cheaper than hashing), only the pages from the last page boundary on are hashed.
    :meth:`many` hashes the new parts of several requests in one vectorised pass. A kept history is extended in place,
    so only new events and hashes are copied; the hashes returned are views of its buffer, never written once handed
    out.

    Args:
        page_size: tokens per page.
        max_users: users whose last history is kept (least recently used dropped first).
    """

    def __init__(self, page_size: int, max_users: int = 4096) -> None:
        self.page_size = page_size
        self.max_users = max_users
        self._last = LRUIndex()  # user -> its _History, least recently used first
        self._padding = np.zeros(page_size, dtype=np.int64)

    def __contains__(self, user_id: Hashable) -> bool:
        """Whether ``user_id``'s last history is kept."""
        return user_id in self._last

    def __call__(self, user_id: Hashable, item_ids: np.ndarray, action_ids: np.ndarray,
                 timestamps: np.ndarray) -> np.ndarray:
        """uint64 ``[n]``, equal to ``page_prefix_hashes(item_ids, action_ids, timestamps, page_size)``."""
        return self.many([(user_id, item_ids, action_ids, timestamps)])[0]

    def match(self, user_id: Hashable, item_ids: np.ndarray, action_ids: np.ndarray,
              timestamps: np.ndarray) -> PrefixMatch:
        """How much of this history (int arrays ``[n]``) equals the user's last kept one, in whole pages, compared as
        int64 bytes with one ``bytearray.startswith`` per field."""
        kept = self._last.get(user_id)
        if kept is None:
            return _NO_MATCH
        common = min(kept.length, len(item_ids)) // self.page_size * self.page_size
        startswith, row = kept.buffer.startswith, kept.row_bytes
        if (common and startswith(np.ascontiguousarray(item_ids[:common], dtype=_INT64))
                and startswith(np.ascontiguousarray(action_ids[:common], dtype=_INT64), row)
                and startswith(np.ascontiguousarray(timestamps[:common], dtype=_INT64), 2 * row)):
            return PrefixMatch(common, kept.hash_row[:common], kept, kept.version)
        return _NO_MATCH

    def many(self, requests: list[tuple[Hashable, np.ndarray, np.ndarray, np.ndarray]],
             matches: list[PrefixMatch] | None = None) -> list[np.ndarray]:
        """:meth:`__call__` of each ``(user_id, item_ids, action_ids, timestamps)``, in order. ``matches``: each
        request's :meth:`match`, taken earlier; without them a user recurring in ``requests`` reuses its earlier
        request's result."""
        results: list[np.ndarray] = []
        pending: list[tuple[Hashable, Fields, PrefixMatch]] = []
        for k, (user_id, item_ids, action_ids, timestamps) in enumerate(requests):
            if matches is None and any(user == user_id for user, _, _ in pending):
                results += self._finish(pending)  # its previous request must be hashed and kept first
                pending = []
            match = matches[k] if matches is not None else self.match(user_id, item_ids, action_ids, timestamps)
            pending.append((user_id, (item_ids, action_ids, timestamps), match))
        return results + self._finish(pending)

    def remember(self, user_id: Hashable, item_ids: np.ndarray, action_ids: np.ndarray, timestamps: np.ndarray,
                 hashes: np.ndarray) -> None:
        """Keep copies of these events and their ``hashes`` (:func:`page_prefix_hashes`, computed elsewhere) as the
        user's last, validated, request."""
        self._keep(user_id, self._copy((item_ids, action_ids, timestamps), hashes, _NO_TAIL))

    def _finish(self, pending: list[tuple[Hashable, Fields, PrefixMatch]]) -> list[np.ndarray]:
        """Hash the unmatched tails of ``pending`` in one call (each tail starts on a page boundary and is
        padded to whole pages, so pages never mix requests) and keep each user's history."""
        if not pending:
            return []
        ps, padding, width = self.page_size, self._padding, 0
        items: list[np.ndarray] = []  # each request's tail, then its padding; then the same for actions, times
        actions: list[np.ndarray] = []
        times: list[np.ndarray] = []
        for _, (item_ids, action_ids, timestamps), match in pending:
            start = match.length
            pad = padding[:(start - len(item_ids)) % ps]
            width += len(item_ids) - start + len(pad)
            items += (item_ids[start:], pad)
            actions += (action_ids[start:], pad)
            times += (timestamps[start:], pad)
        joined = np.empty((4, width), dtype=_INT64)  # the tails' events, then their hashes' bits
        np.concatenate(items + actions + times, out=joined[:3].reshape(-1), casting="unsafe")
        _hash_pages(joined[:3], ps, joined[3].view(np.uint64))
        results, at = [], 0
        for user_id, fields, match in pending:
            tail = len(fields[0]) - match.length
            results.append(self._store(user_id, fields, match, joined[:, at:at + tail]))
            at += tail + -tail % ps
        return results

    def _store(self, user_id: Hashable, fields: Fields, match: PrefixMatch, tail: np.ndarray) -> np.ndarray:
        """Keep ``fields`` (``n`` events) as the user's last history and return its hashes (uint64 ``[n]``).

        ``tail``: int64 ``[4, n - match.length]``, the events after the matched prefix and their hashes' bits, are
        written after the prefix into the buffer it was matched against if that is unchanged since, large enough,
        and any hashes handed out past the prefix equal ``tail``'s; otherwise the history is copied to a new buffer."""
        n, start, source = len(fields[0]), match.length, match.source
        if (source is not None and self._last.get(user_id) is source and source.version == match.version
                and source.capacity >= n):
            out = min(source.handed_out, n)
            if source.buffer.startswith(tail[3, :out - start], 3 * source.row_bytes + start * _INT64.itemsize):
                source.rows[:, start:n] = tail  # over handed-out hashes, only the same bits
                source.length, source.handed_out, source.version = n, max(source.handed_out, n), source.version + 1
                self._last.touch(user_id, source)
                return source.hash_row[:n]
        history = self._copy(fields, match.hashes, tail)
        self._keep(user_id, history)
        return history.hash_row[:n]

    @staticmethod
    def _copy(fields: Fields, head: np.ndarray, tail: np.ndarray) -> _History:
        """A new kept history: ``fields`` (``n`` events), their hashes (uint64 ``head`` for the events before
        ``tail``, int64 ``[4, k]``: the last ``k`` events and their hashes' bits), with room for more events."""
        n = len(fields[0])
        start, capacity = n - tail.shape[1], n + n // 4 + 64
        buffer = bytearray(4 * capacity * _INT64.itemsize)
        rows = np.frombuffer(buffer, dtype=_INT64).reshape(4, capacity)
        rows[:, start:n] = tail
        if start:
            for row, field in zip(rows, fields):
                row[:start] = field[:start]
            rows[3, :start] = head.view(_INT64)
        return _History(buffer, rows, rows[3].view(np.uint64), capacity, capacity * _INT64.itemsize, n, n)

    def _keep(self, user_id: Hashable, history: _History) -> None:
        self._last.touch(user_id, history)
        if len(self._last) > self.max_users:
            self._last.popitem(last=False)
