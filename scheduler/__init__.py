"""Batching: which requests run in the next engine step."""

from .config import SchedulerConfig
from .request_state import RequestState, RequestStatus, ScheduledChunk, SchedulerOutput
from .scheduler import KVAllocator, Scheduler

__all__ = ["KVAllocator", "RequestState", "RequestStatus", "ScheduledChunk", "Scheduler", "SchedulerConfig",
           "SchedulerOutput"]
