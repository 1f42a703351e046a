"""Capturing every step graph before serving (:meth:`GREngine.warmup <gr_engine.GREngine.warmup>`).

:class:`~.step_graphs.StepGraphs` captures a graph the first time a step of a new (bucket, launch shape) arrives,
and for each new shape the backend may compile kernels too (``hstu_triton``'s device tile plan is compiled per
bucket): that step then takes seconds instead of milliseconds. A server calls :func:`capture_all` at start-up
instead, like vLLM's start-up capture.

Each bucket is probed with synthetic steps whose rows fill the bucket and whose longest request has 1, 2, 4, ...
rows (the backend's launch shape depends on that length; each new key the backend's ``graph_plan`` returns gets
its graphs): every row a history row of a request with nothing cached, written into ``pages`` (pages nobody holds,
whose contents are then undefined, as free pages' are). Each key is replayed twice on CUDA, once with nothing to
wait for (the whole forward as one graph) and once waiting for completed per-layer events (one graph per layer, as
a step that loads KV from host replays).
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from .step_graphs import HeadFn, SegmentsFn, StepGraphs


def synthetic_step(rows: int, longest: int, pages: np.ndarray,
                   page_size: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
    """A step of ``rows`` history rows in requests of at most ``longest`` rows each (the first ones exactly
    ``longest``), nothing cached, written into the first of ``pages`` (int32); ``None`` when ``pages`` are too few.
    Returns the layout and the token arrays :meth:`StepGraphs.stage` takes (tokens all zero: any valid ids)."""
    count = -(-rows // longest)
    hist = np.full(count, longest, dtype=np.int64)
    hist[-1] = rows - longest * (count - 1)
    per_request = -(-hist // page_size)
    if per_request.sum() > len(pages):
        return None
    indptr = np.concatenate([[0], np.cumsum(per_request)])
    zeros = np.zeros(count, dtype=np.int64)
    layout = {"history_start": zeros, "num_history_rows": hist, "num_candidate_rows": zeros, "kv_indptr": indptr,
              "kv_indices": pages[: indptr[-1]]}
    tokens = {name: np.zeros(rows, dtype=np.int64) for name in ("item_ids", "action_ids")}
    return layout, tokens


def capture_all(graphs: StepGraphs, segments: SegmentsFn, head: HeadFn, pages: np.ndarray, num_layers: int,
                use_tqdm: bool = True) -> int:
    """Replay (so capture, on CUDA) a synthetic step of every bucket and launch shape of ``graphs``.

    Args:
        graphs, segments, head: as for :meth:`StepGraphs.replay`.
        pages: int32 ``[P]`` page ids of the pool nobody holds; they are written (a bucket needing more pages
            than ``P`` is skipped).
        num_layers: the model's layers (one event each for the per-layer replays).
        use_tqdm: show a progress bar over the buckets.

    Returns:
        How many distinct (bucket, launch shape) keys were replayed.
    """
    cuda = graphs.device.type == "cuda"
    done_event = None
    if cuda:
        done_event = torch.cuda.Event()
        done_event.record()
    waits = [[None] * num_layers] + ([[done_event] * num_layers] if cuda else [])
    keys = set()
    for bucket in tqdm(graphs.buckets, desc="Capturing step graphs", disable=not use_tqdm):
        longest = 1
        while longest <= bucket:
            step = synthetic_step(bucket, longest, pages, graphs.page_size)
            longest *= 2
            if step is None or not graphs.fits(bucket, len(step[0]["num_history_rows"]), bucket,
                                               len(step[0]["kv_indices"])):
                continue
            layout, tokens = step
            staged = graphs.stage(layout, tokens)
            key = (bucket, staged.plan_key)
            if key in keys or not graphs.enabled:  # (after a failed capture steps run eagerly: nothing to capture)
                continue
            keys.add(key)
            for i, layer_ready in enumerate(waits):
                graphs.replay(staged if i == 0 else graphs.stage(layout, tokens), segments, head, layer_ready)
    if cuda:
        torch.cuda.synchronize(graphs.device)
    return len(keys)
