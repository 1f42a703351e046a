"""Configuration of the scheduler."""

from __future__ import annotations

import msgspec


class SchedulerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How much work one engine step may take.

    Attributes:
        max_num_seqs: most requests in one step (the batch size).
        max_num_batched_tokens: most tokens computed in one step: uncached history tokens plus
            candidates. A cold user's long history is encoded over several steps (chunked prefill) so
            it never stalls a batch; must exceed the model's ``max_candidates``.
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"scheduler.max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"scheduler.max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
