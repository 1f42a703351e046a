"""Configuration of the scheduler."""

from __future__ import annotations

import msgspec


class SchedulerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How much work one engine step may take.

    Attributes:
        max_num_seqs: most requests in one step (the batch size).
        max_num_batched_tokens: most uncached history tokens plus candidates in one step; must exceed the
            model's ``max_candidates``.
        max_chunk_tokens: most history tokens one request encodes in one step (chunked prefill: a cold user's
            long history leaves room for others). ``None``: half of ``max_num_batched_tokens``.
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 8192
    max_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_chunk_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"scheduler.{name} must be positive, got {value}")

    @property
    def chunk_tokens(self) -> int:
        """The effective ``max_chunk_tokens``."""
        if self.max_chunk_tokens is not None:
            return self.max_chunk_tokens
        return max(1, self.max_num_batched_tokens // 2)
