"""The host side of a step's results (gr_engine/step_results.py): the reusable logits buffers and the split of a
step's logits into its requests' results."""

import numpy as np
import torch

from gr_engine.step_results import PinnedBuffers, ScoreFetch


def test_buffers_are_reused_and_grow_only_when_none_fits() -> None:
    pool = PinnedBuffers(width=3, pin=False)
    first = pool.take(10)
    assert first.shape == (64, 3) and first.dtype == torch.float32
    second = pool.take(100)  # the first is still out: a new one, room for 100 rows
    assert second.shape == (128, 3)
    pool.give_back(first)
    pool.give_back(second)
    assert pool.take(50) is first  # the smallest that fits
    assert pool.take(100) is second
    assert pool.num_free == 0
    assert pool.take(5) is not first
    pool.give_back(first)
    pool.give_back(second)
    assert pool.take(100) is second  # not the first in the pool: taken out by position
    assert pool.num_free == 1


def test_fetch_splits_logits_by_chunk_and_returns_its_buffer() -> None:
    """Through a (CPU) buffer as the CUDA path uses it: each chunk gets its rows, as a copy that later writes into
    the reused buffer leave unchanged."""
    pool = PinnedBuffers(width=2, pin=False)
    logits = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    fetch = ScoreFetch(counts=[2, 0, 4])
    fetch.buffers, fetch.buffer = pool, pool.take(6)  # as copy_logits does on CUDA
    fetch.logits = fetch.buffer[:6]
    fetch.logits.copy_(logits)
    results = fetch.wait()
    assert pool.num_free == 1
    np.testing.assert_array_equal(results[0].logits, logits[:2].numpy())
    assert results[1].logits.shape == (0, 2)
    np.testing.assert_array_equal(results[2].logits, logits[2:].numpy())
    pool.take(6).fill_(-1.0)  # the next step reuses the buffer
    np.testing.assert_array_equal(results[2].logits, logits[2:].numpy())


def test_cpu_logits_are_kept_as_they_are() -> None:
    logits = torch.ones(3, 2)
    fetch = ScoreFetch(counts=[3])
    fetch.copy_logits(logits, PinnedBuffers(width=2, pin=False))
    assert fetch.logits is logits and fetch.buffers is None
    assert fetch.wait()[0].logits.shape == (3, 2)
