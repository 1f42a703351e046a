"""Shared fixtures: tiny float32 configs that run in milliseconds on CPU."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gr_engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from gr_engine.serving.config import ServingConfig

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_config(mode: str = "gpu_only", num_gpu_pages: int = 256, page_size: int = 4,
                max_num_seqs: int = 4, max_num_batched_tokens: int = 96, chunk_pages: int = 4,
                host_chunks: int = 64, **model: object) -> EngineConfig:
    """A 2-layer, 16-wide model with small pages and chunks so that page and chunk boundaries are
    crossed constantly. ``host_chunks`` sizes the host pool (``hierarchical`` mode). Admission by queue wait is off
    (``serving.max_queue_ms=0``): on a CI core a burst of tests' requests queues longer than any online bound; the
    tests of that bound set it themselves."""
    model_fields = dict(num_items=200, num_actions=8, d_model=16, num_layers=2, num_heads=2, head_dim=8,
                        max_history_len=256, max_candidates=12, num_tasks=3, ranking_hidden=16, seed=1)
    model_fields.update(model)
    m = ModelConfig(**model_fields)
    chunk_bytes = m.num_layers * 2 * page_size * chunk_pages * m.num_heads * m.head_dim * 4
    return EngineConfig(
        model=m,
        cache=CacheConfig(mode=mode, page_size=page_size, num_gpu_pages=num_gpu_pages,
                          chunk_tokens=page_size * chunk_pages, host_budget_bytes=host_chunks * chunk_bytes,
                          host_segment_bytes=8 * chunk_bytes),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        serving=ServingConfig(max_queue_ms=0),
    )


def with_cache(config: EngineConfig, **cache: object) -> EngineConfig:
    return msgspec.structs.replace(config, cache=msgspec.structs.replace(config.cache, **cache))


@pytest.fixture
def config() -> EngineConfig:
    return tiny_config()
