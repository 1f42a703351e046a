"""Hashes that let the cache check, page by page, that a user's cached prefix matches a request.

For a history of ``n`` events, :func:`page_prefix_hashes` returns ``h[i]``: the hash of the tokens of
``i``'s page from the page start up to and including ``i``. So ``h[k * page_size + r - 1]`` identifies
the first ``r`` tokens of page ``k`` and a cached page holding ``r`` tokens is verified by one
comparison, with no per-token Python work.
"""

from __future__ import annotations

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
