"""Model FLOPs of a step and the GEMM peak they are measured against (the bench's model FLOP utilisation).

FLOPs count the layers' linear maps (2 per multiply-add) and attention's two products (``q k^T`` and ``p v``) over
the (query, key) pairs each row attends: causal, counted once. A request with ``p`` cached history tokens, ``m`` new
history rows and ``c`` candidates computes ``m + c`` rows; new history row ``j`` attends ``p + j + 1`` keys and each
candidate the whole history plus itself. Embeddings, norms, activations and the ranking head are left out (the head
is under 1% of a step of the bench's model).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..config import ModelConfig


def attended_pairs(cached: np.ndarray, history: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """(query, key) pairs per request: int64 ``[B]`` from int ``cached``, ``history`` (whole history lengths) and
    ``candidates``, each ``[B]``."""
    p, n, c = (np.asarray(a, dtype=np.int64) for a in (cached, history, candidates))
    m = n - p
    return m * p + m * (m + 1) // 2 + c * (n + 1)


def step_flops(model: ModelConfig, cached: np.ndarray, history: np.ndarray, candidates: np.ndarray) -> float:
    """Model FLOPs of computing these requests (as :func:`attended_pairs`' arguments) through every layer."""
    p, n, c = (np.asarray(a, dtype=np.int64) for a in (cached, history, candidates))
    rows = float((n - p + c).sum())
    width, d = model.num_heads * model.head_dim, model.d_model
    if model.architecture == "hstu":
        linear = 2 * d * 4 * width + 2 * (3 * width if model.concat_ua else width) * d  # uvqk, output
    else:
        linear = 2 * d * 3 * width + 2 * width * d + 2 * 2 * d * 4 * d  # qkv, proj, the two FFN maps
    attention = 4 * width * float(attended_pairs(p, n, c).sum())
    return model.num_layers * (rows * linear + attention)


def gemm_peak_tflops(device: str, size: int = 8192, rounds: int = 10) -> float | None:
    """The bf16 GEMM rate (TFLOP/s, median of ``rounds`` ``[size, size] @ [size, size]`` products timed with CUDA
    events, after one unmeasured); ``None`` off CUDA."""
    if not device.startswith("cuda"):
        return None
    generator = torch.Generator(device=device).manual_seed(int(time.time()))
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=generator) for _ in range(2))
    torch.matmul(a, b)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * size**3 / float(np.median(times)) / 1e12
