"""After ``GREngine.warmup()`` nothing compiles or captures while serving (skipped without CUDA).

Each case runs in a fresh process with an empty Triton cache (``TRITON_CACHE_DIR``), so that every kernel the
engine needs is compiled by that process: by warm-up, or, if warm-up missed one, by a step (which the test catches).
The same stream without warm-up must compile kernels while serving: the count is not blind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict

import msgspec
import pytest

from gr_engine import GenerateParams, GREngine
from gr_engine.synthetic import synthetic_requests
from tests.conftest import requires_cuda, tiny_config, with_cache

pytestmark = [pytest.mark.gpu, requires_cuda]

CASES = {  # name -> (cache changes, model changes)
    "hierarchical_fp8": ({"mode": "hierarchical", "num_gpu_pages": 400, "host_dtype": "float8_e4m3fn"}, {}),
    "hierarchical": ({"mode": "hierarchical", "num_gpu_pages": 400}, {}),
    "gpu_only": ({"mode": "gpu_only", "num_gpu_pages": 400}, {}),
    "recompute": ({"mode": "recompute"}, {}),
    "time_bias": ({"mode": "hierarchical", "num_gpu_pages": 400}, {"time_bias_buckets": 16}),
}


def case_config(name: str):
    cache, model = CASES[name]
    config = tiny_config(page_size=16, max_num_seqs=8, max_num_batched_tokens=4096, chunk_pages=4,
                         host_chunks=600, d_model=64, num_heads=2, head_dim=64, dtype="bfloat16",
                         max_history_len=4096, max_candidates=100, **model)
    config = msgspec.structs.replace(config, device="cuda", cuda_graph_max_rows=1024, attention_backend="hstu_triton")
    return with_cache(config, **cache)


def child(name: str, warm: bool) -> None:
    """Serve a stream (short and long histories, 1-100 candidates, returning users, evictions to host memory) and
    print the stall counts after warm-up and after the stream as JSON."""
    config = case_config(name)
    requests = synthetic_requests(config.model, 40, 6, first_history=(1, 3000), new_events=(0, 600),
                                  num_candidates=(1, 100), rewrite_prob=0.05, seed=3)
    engine = GREngine(config)
    if engine.kv.host is not None:
        engine.kv.host.store.wait_until_allocated()
    if warm:
        engine.warmup(use_tqdm=False)
    before = engine.stalls()
    for start in range(0, len(requests), 8):
        outputs = engine.rank(requests[start:start + 8], use_tqdm=False)
        assert all(o.error is None for o in outputs), [o.error for o in outputs if o.error]
    engine.generate(requests[:4], GenerateParams(top_k=5), use_tqdm=False)
    engine.close()
    print(json.dumps({"before": asdict(before), "after": asdict(engine.stalls()),
                      "host_hits": engine.stats.host_hit_tokens, "last_kernels": list(engine._compiles.last_names)}))


def run_child(name: str, warm: bool, tmp_path) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / f"triton-{name}-{warm}"))
    code = f"from tests.test_gpu_warmup import child; child({name!r}, {warm})"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_nothing_compiles_or_captures_after_warmup(name, tmp_path):
    counts = run_child(name, True, tmp_path)
    assert counts["before"]["kernel_compilations"] > 0  # warm-up compiled (a fresh cache)
    assert counts["after"] == counts["before"], (counts["after"], counts["before"], counts["last_kernels"][-4:])
    if CASES[name][0]["mode"] == "hierarchical":
        assert counts["host_hits"] > 0  # onloads ran


def test_without_warmup_steps_compile(tmp_path):
    """The count sees compilations inside steps (so the test above can fail)."""
    counts = run_child("hierarchical", False, tmp_path)
    assert counts["before"]["kernel_compilations"] == 0
    assert counts["after"]["kernel_compilations"] > 0 and counts["after"]["graph_captures"] > 0
