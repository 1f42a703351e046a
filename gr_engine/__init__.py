"""gr-engine: a serving engine for generative recommendation (HSTU) models.

Each user's KV cache persists across visits in a paged pool, so a returning user's long history is
never re-encoded. Start with :class:`GREngine` and :class:`EngineConfig`.
"""

from .config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, load_config
from .engine import GREngine
from .metrics import EngineStats, StepMetrics
from .models import GRModel
from .outputs import GenerateOutput, RankOutput, StepTimings
from .request import GenerateParams, GenerateRequest, RankRequest
from .validation import RequestError

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "EngineStats",
    "GREngine",
    "GRModel",
    "GenerateOutput",
    "GenerateParams",
    "GenerateRequest",
    "ModelConfig",
    "RankOutput",
    "RankRequest",
    "RequestError",
    "SchedulerConfig",
    "StepMetrics",
    "StepTimings",
    "load_config",
]
