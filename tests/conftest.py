"""Shared fixtures: tiny float32 configs that run in milliseconds on CPU."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gr_engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_config(mode: str = "gpu_only", num_gpu_pages: int = 256, page_size: int = 4,
                max_num_seqs: int = 4, max_num_batched_tokens: int = 96, **model: object) -> EngineConfig:
    """A 2-layer, 16-wide model with small pages so that page boundaries are crossed constantly."""
    model_fields = dict(num_items=200, num_actions=8, d_model=16, num_layers=2, num_heads=2, head_dim=8,
                        max_history_len=256, max_candidates=12, num_tasks=3, ranking_hidden=16, seed=1)
    model_fields.update(model)
    return EngineConfig(
        model=ModelConfig(**model_fields),
        cache=CacheConfig(mode=mode, page_size=page_size, num_gpu_pages=num_gpu_pages),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
    )


def with_cache(config: EngineConfig, **cache: object) -> EngineConfig:
    return msgspec.structs.replace(config, cache=msgspec.structs.replace(config.cache, **cache))


@pytest.fixture
def config() -> EngineConfig:
    return tiny_config()
