"""Synthetic returning-user traffic for the demo, examples and tests (no downloads).

Each user's history grows by ``new_events`` per visit after ``first_history`` on the first, so a caching engine only
encodes the new events; users' visits interleave at random, each user's in order. ``rewrite_prob`` occasionally changes
an old event (e.g. a deleted interaction), which a correct cache must detect instead of serving stale KV.
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .request import RankRequest


def synthetic_requests(
    model: ModelConfig,
    num_users: int,
    visits_per_user: int,
    *,
    first_history: tuple[int, int] = (16, 256),
    new_events: tuple[int, int] = (1, 16),
    num_candidates: tuple[int, int] = (1, 16),
    rewrite_prob: float = 0.0,
    seed: int = 0,
) -> list[RankRequest]:
    """Build an interleaved stream of ranking requests from returning users.

    Args:
        model: the model config (vocabulary sizes and limits are respected).
        num_users: distinct users.
        visits_per_user: requests per user.
        first_history: inclusive range of the first visit's history length.
        new_events: inclusive range of events added between two visits.
        num_candidates: inclusive range of candidates per request (capped at ``model.max_candidates``).
        rewrite_prob: probability that a visit changes one earlier event of the user's history.
        seed: random seed; the same arguments give the same stream.

    Returns:
        ``num_users * visits_per_user`` requests with ids ``"u{user}-v{visit}"``; histories never
        exceed ``model.max_history_len``.
    """
    rng = np.random.default_rng(seed)
    per_user: list[list[RankRequest]] = []
    for user in range(num_users):
        cuts = [int(rng.integers(first_history[0], first_history[1] + 1))]
        for _ in range(visits_per_user - 1):
            cuts.append(cuts[-1] + int(rng.integers(new_events[0], new_events[1] + 1)))
        cuts = [min(c, model.max_history_len) for c in cuts]
        total = cuts[-1]
        items = rng.integers(0, model.num_items, total)
        actions = rng.integers(0, model.num_actions, total)
        times = np.cumsum(rng.integers(1, 600, total)) + 1_700_000_000
        visits = []
        for visit, cut in enumerate(cuts):
            if visit and cut and rng.random() < rewrite_prob:
                items[rng.integers(0, cut)] = rng.integers(0, model.num_items)
            most = min(num_candidates[1], model.max_candidates)
            c = int(rng.integers(min(num_candidates[0], most), most + 1))
            visits.append(RankRequest(
                request_id=f"u{user}-v{visit}", user_id=user, item_ids=items[:cut].tolist(),
                action_ids=actions[:cut].tolist(), timestamps=times[:cut].tolist(),
                candidate_item_ids=rng.integers(0, model.num_items, c).tolist(),
            ))
        per_user.append(visits)
    order = rng.permutation(np.repeat(np.arange(num_users), visits_per_user))
    visits_left = [iter(visits) for visits in per_user]
    return [next(visits_left[user]) for user in order]
