"""``hstu_triton``'s device tile plan (:mod:`attention_backends.hstu_triton_device_plan`) writes exactly the padded
host plan that :meth:`HSTUTritonBackend.graph_plan` would upload, for random steps of every kind (long histories
with few new rows, many new rows, candidates-only requests, spare request slots), tile shapes, head counts and
processor counts. CPU runs it in Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported)."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def backend(num_heads: int, num_sms: int, block_m: int, block_n: int):
    from attention_backends import AttentionSpec
    from attention_backends.hstu_triton import HSTUTritonBackend
    from attention_backends.hstu_triton_plan import TileConfig

    spec = AttentionSpec(kind="hstu", num_heads=num_heads, head_dim=32, page_size=16, dtype=torch.float32,
                         device_type=DEVICE, alpha=1.0, scaling_seqlen=100.0, time_bias_buckets=0)
    made = HSTUTritonBackend(spec, TileConfig(block_m, block_n, 4, 1))
    made.num_sms = num_sms
    return made


def random_step(rng: np.random.Generator, num_requests: int, kind: int) -> dict[str, np.ndarray]:
    """Host arrays of a step: kind 0 few new rows over long histories, 1 some candidates-only requests and
    no-candidate ones, 2 many new rows over short histories."""
    rows = rng.integers(1, [20, 120, 120][kind], num_requests)
    candidates = np.minimum(rng.integers(0, 50, num_requests), rows - 1) if kind != 2 else np.zeros(num_requests, int)
    history = rows - candidates
    if kind == 1:
        history = np.where(rng.random(num_requests) < 0.3, 0, history)
        rows = np.maximum(history + candidates, 1)
    cached = rng.integers(0, [20_000, 500, 3_000][kind], num_requests)
    return {"query_start_loc": np.concatenate([[0], np.cumsum(rows)]), "num_history_rows": history,
            "kv_seq_lens": cached + history}


def check(made, host: dict[str, np.ndarray], max_rows: int, max_requests: int) -> bool:
    """Device plan of the padded step == host plan; returns whether the key is planned on the device. The step's
    metadata is given as the three padded tensors the plan reads."""
    made.plan_on_device = False
    key, expected = made.graph_plan(host, max_rows, max_requests)
    made.plan_on_device = True
    device_key, writer = made.graph_plan(host, max_rows, max_requests)
    if not callable(writer):  # capacities too large for one program: the host plan is uploaded
        return False
    assert device_key[:3] == key[:3] and made.graph_plan_size(device_key) == len(expected)
    spare = max_requests - (len(host["query_start_loc"]) - 1)  # padded like the graph's static buffers
    padded = {"query_start_loc": np.concatenate([host["query_start_loc"], np.full(spare, host["query_start_loc"][-1])]),
              "num_history_rows": np.concatenate([host["num_history_rows"], np.zeros(spare, int)]),
              "kv_seq_lens": np.concatenate([host["kv_seq_lens"], np.zeros(spare, int)])}
    common = SimpleNamespace(**{k: torch.tensor(v, dtype=torch.int32, device=DEVICE) for k, v in padded.items()})
    plan = torch.full((len(expected),), 777, dtype=torch.int32, device=DEVICE)
    writer(common, plan)
    got = plan.cpu().numpy()
    assert np.array_equal(got, expected), np.flatnonzero(got != expected)[:10]
    return True


@pytest.mark.parametrize("seed", range(8))
def test_device_plan_equals_the_padded_host_plan(seed):
    rng = np.random.default_rng(seed)
    planned = 0
    for trial in range(8):
        max_requests = int(rng.choice([1, 3, 8]))
        made = backend(int(rng.choice([1, 2, 4])), int(rng.choice([4, 16, 132])), int(rng.choice([16, 32, 64])),
                       int(rng.choice([16, 32, 64])))
        host = random_step(rng, int(rng.integers(1, max_requests + 1)), (seed + trial) % 3)
        planned += check(made, host, int(host["query_start_loc"][-1]) + int(rng.integers(0, 64)), max_requests)
    assert planned >= 5  # most draws fit one program


def test_a_step_where_the_near_longest_count_decides():
    """Found by search: rounding ``3/4`` of the longest part down instead of up picks another plan here."""
    rows, seq_lens = np.array([22, 50, 196, 18]), np.array([377, 814, 2215, 1805])
    host = {"query_start_loc": np.concatenate([[0], np.cumsum(rows)]), "num_history_rows": rows,
            "kv_seq_lens": seq_lens}
    assert check(backend(2, 32, 32, 32), host, int(rows.sum()), 4)


def test_a_step_of_spare_slots_only_gives_the_empty_padded_plan():
    host = {"query_start_loc": np.zeros(1, int), "num_history_rows": np.zeros(0, int), "kv_seq_lens": np.zeros(0, int)}
    assert check(backend(2, 16, 32, 32), host, 64, 4)


def test_large_capacities_keep_the_host_plan():
    made = backend(1, 132, 16, 16)
    host = random_step(np.random.default_rng(0), 4, 0)
    key, plan = made.graph_plan(host, 8192, 256)
    assert isinstance(plan, np.ndarray) and not key[3]
