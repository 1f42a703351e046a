"""What users send: ranking and retrieval requests, and retrieval parameters.

History fields are parallel sequences, one entry per event, oldest first. Besides lists of ints they
may be 1-D integer numpy arrays (no copy is made when validating those: an int64 array is read in place, so it must
not change until its request's output is returned; the engine hashes the history at intake and reads it again when
it computes it, and a change in between would cache KV under the old values' hashes).
"""

from __future__ import annotations

import msgspec

_INT64_MAX = 2**63 - 1


class GenerateRequest(msgspec.Struct, kw_only=True):
    """A user's history; ``GREngine.generate`` retrieves the items they are likely to engage with next.

    Attributes:
        request_id: caller's id, echoed on the output; unique among in-flight requests.
        user_id: whose history this is; a returning user's cached KV is found by this key (a string, or an int that
            fits in 64 bits, signed or unsigned).
        item_ids: ``[n]`` item of each history event (``0 <= id < model.num_items``).
        action_ids: ``[n]`` action of each event (``0 <= id < model.num_actions``).
        timestamps: ``[n]`` event times (any integer unit, non-decreasing).
    """

    request_id: str
    user_id: int | str
    item_ids: list[int]
    action_ids: list[int]
    timestamps: list[int]


class RankRequest(GenerateRequest, kw_only=True):
    """A user's history plus candidates; ``GREngine.rank`` scores every candidate for every task.

    Attributes:
        candidate_item_ids: ``[c]`` items to score, ``1 <= c <= model.max_candidates``.
    """

    candidate_item_ids: list[int]


class GenerateParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Retrieval settings for ``GREngine.generate``.

    Attributes:
        top_k: how many items to return.
        exclude_history: never return items already in the user's history.
    """

    top_k: int = 10
    exclude_history: bool = True

    def __post_init__(self) -> None:
        if self.top_k <= 0:
            raise ValueError(f"top_k must be positive, got {self.top_k}")
        if self.top_k > _INT64_MAX:
            raise ValueError(f"top_k must be at most {_INT64_MAX}, got {self.top_k}")
