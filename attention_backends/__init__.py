"""Attention over the paged KV cache: the backend interface, a registry, and implementations."""

from .base import (
    AttentionBackend,
    AttentionKind,
    AttentionSpec,
    BackendSupport,
    GraphReplayable,
    NewRowsReadable,
    PagedBatchMetadata,
    PlanWriter,
)
from .registry import ENTRY_POINT_GROUP, BackendRegistry

__all__ = ["ENTRY_POINT_GROUP", "AttentionBackend", "AttentionKind", "AttentionSpec", "BackendRegistry",
           "BackendSupport", "GraphReplayable", "NewRowsReadable", "PagedBatchMetadata", "PlanWriter"]
