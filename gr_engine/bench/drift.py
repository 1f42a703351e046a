"""How far cached scores move from recomputed ones, per host chunk dtype (the price of FP8 host chunks).

Unlike the timed windows, this serves real K/V: users with ``length``-event histories visit several times with
a few new events each, on a GPU budget of one batch's histories, so every returning user was evicted to the
host tier in between and is served from host chunks. The same requests through a ``recompute`` engine give
the reference scores.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ..config import EngineConfig
from ..engine import GREngine
from ..models import GRModel
from ..outputs import RankOutput
from .trace import Trace


def score_drift(config: EngineConfig, trace: Trace, host_dtypes: tuple[str, ...], model: GRModel | None = None) -> dict:
    """Serve every request of ``trace`` (warm-up first, then in order, batches of
    ``config.scheduler.max_num_seqs``) with ``config`` (a hierarchical cache) for each host dtype, and with
    recompute (all with ``model``, or each with its own from ``config.model``).

    Returns:
        Per host dtype: ``max_abs`` and ``mean_abs`` score differences (logits) over the requests served from
        host chunks, ``score_std`` (the reference scores' spread, for scale), ``max_rel`` (``max_abs /
        score_std``), ``host_hit_ratio`` (history tokens loaded from host over all history tokens) and
        ``requests_from_host``.
    """
    requests = [trace.rank_request(i) for i in range(len(trace.requests))]
    reference = [np.asarray(o.scores, dtype=np.float64) for o in _serve(config, "recompute", None, requests, model)]
    spread = float(np.std(np.concatenate([r.ravel() for r in reference])))
    out: dict = {}
    for host_dtype in host_dtypes:
        outputs = _serve(config, "hierarchical", host_dtype, requests, model)
        from_host = [i for i, o in enumerate(outputs) if o.num_host_cached_tokens]
        diffs = np.concatenate([np.abs(np.asarray(outputs[i].scores) - reference[i]).ravel() for i in from_host]
                               or [np.zeros(0)])
        history = sum(len(r.item_ids) for r in requests)
        out[host_dtype] = {
            "max_abs": float(diffs.max(initial=0.0)), "mean_abs": float(diffs.mean()) if len(diffs) else 0.0,
            "score_std": spread, "max_rel": float(diffs.max(initial=0.0)) / spread if spread else None,
            "host_hit_ratio": sum(o.num_host_cached_tokens for o in outputs) / max(history, 1),
            "requests_from_host": len(from_host),
        }
    return out


def _serve(config: EngineConfig, mode: str, host_dtype: str | None, requests: list,
           model: GRModel | None) -> list[RankOutput]:
    cache = msgspec.structs.replace(config.cache, mode=mode, **({"host_dtype": host_dtype} if host_dtype else {}))
    batch = config.scheduler.max_num_seqs
    with GREngine(msgspec.structs.replace(config, cache=cache), model=model) as engine:
        outputs: list[RankOutput] = []
        for start in range(0, len(requests), batch):
            outputs += engine.rank(requests[start:start + batch], use_tqdm=False)
    failed = [o.error for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"drift request failed: {failed[0]}")
    return outputs
