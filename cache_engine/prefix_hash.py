"""Hashes that let the cache check, page by page, that a user's cached prefix matches a request.

For a history of ``n`` events, :func:`page_prefix_hashes` returns ``h[i]``: the hash of the tokens of
``i``'s page from the page start up to and including ``i``. So ``h[k * page_size + r - 1]`` identifies
the first ``r`` tokens of page ``k`` and a cached page holding ``r`` tokens is verified by one
comparison, with no per-token Python work.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

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


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two int arrays hold the same values (a byte comparison when the dtypes match: a few times
    faster than :func:`numpy.array_equal`, which builds a boolean array first)."""
    if a.dtype == b.dtype and len(a) == len(b):
        return a.tobytes() == b.tobytes()
    return bool(np.array_equal(a, b))


class IncrementalHasher:
    """:func:`page_prefix_hashes` that reuses each user's previous result.

    A returning user's history usually extends the previous request's. The previous request's events are
    kept (for the ``max_users`` most recent users); if the new history starts with them (an exact array
    comparison, cheaper than hashing), only the pages from the last page boundary on are hashed again.
    :meth:`many` hashes the new parts of several requests in one vectorised pass.

    Args:
        page_size: tokens per page.
        max_users: users whose last history is kept (least recently used dropped first).
    """

    def __init__(self, page_size: int, max_users: int = 4096) -> None:
        self.page_size = page_size
        self.max_users = max_users
        self._last: OrderedDict[Hashable, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def __contains__(self, user_id: Hashable) -> bool:
        """Whether the user's last history is kept (its next request hashes only what is new)."""
        return user_id in self._last

    def __call__(self, user_id: Hashable, item_ids: np.ndarray, action_ids: np.ndarray,
                 timestamps: np.ndarray) -> np.ndarray:
        """uint64 ``[n]``, equal to ``page_prefix_hashes(item_ids, action_ids, timestamps, page_size)``."""
        return self.many([(user_id, item_ids, action_ids, timestamps)])[0]

    def many(self, requests: list[tuple[Hashable, np.ndarray, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """:meth:`__call__` of each ``(user_id, item_ids, action_ids, timestamps)``, in order (a user may recur:
        its later request reuses the earlier one's result)."""
        results: list[np.ndarray] = []
        pending: list[tuple[Hashable, tuple[np.ndarray, ...], np.ndarray]] = []  # user, fields, reused hashes
        for user_id, *fields in requests:
            if any(user == user_id for user, _, _ in pending):
                results += self._finish(pending)  # its previous request must be hashed and kept first
                pending = []
            previous = self._last.pop(user_id, None)
            reuse = 0
            if previous is not None:
                common = min(len(previous[0]), len(fields[0])) // self.page_size * self.page_size
                if all(_same(old[:common], new[:common]) for old, new in zip(previous, fields)):
                    reuse = common
            pending.append((user_id, tuple(fields), previous[3][:reuse] if reuse else np.zeros(0, np.uint64)))
        return results + self._finish(pending)

    def remember(self, user_id: Hashable, item_ids: np.ndarray, action_ids: np.ndarray, timestamps: np.ndarray,
                 hashes: np.ndarray) -> None:
        """Take ``hashes`` (:func:`page_prefix_hashes` of these events, computed elsewhere) as the user's last
        request, without copying: the arrays must not change afterwards (e.g. a benchmark's fast-forward)."""
        self._last.pop(user_id, None)
        self._last[user_id] = (item_ids, action_ids, timestamps, hashes)
        if len(self._last) > self.max_users:
            self._last.popitem(last=False)

    def _finish(self, pending: list[tuple[Hashable, tuple[np.ndarray, ...], np.ndarray]]) -> list[np.ndarray]:
        """Hash the un-reused tails of ``pending`` in one call (each tail starts on a page boundary and is
        padded to whole pages, so pages never mix requests) and remember each user's history."""
        if not pending:
            return []
        ps = self.page_size
        tails = [[f[len(reused):] for f in fields] for _, fields, reused in pending]
        padded = [-(-len(t[0]) // ps) * ps for t in tails]
        joined = [np.zeros(sum(padded), dtype=np.int64) for _ in range(3)]
        at = 0
        for tail, size in zip(tails, padded, strict=True):
            for column, field in zip(joined, tail, strict=True):
                column[at:at + len(field)] = field
            at += size
        hashed = page_prefix_hashes(*joined, ps)
        results, at = [], 0
        for (user_id, fields, reused), tail, size in zip(pending, tails, padded, strict=True):
            hashes = np.concatenate([reused, hashed[at:at + len(tail[0])]])
            at += size
            self._last[user_id] = (*(np.array(f, copy=True) for f in fields), hashes)
            if len(self._last) > self.max_users:
                self._last.popitem(last=False)
            results.append(hashes)
        return results
