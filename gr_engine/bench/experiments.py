"""The benchmark's experiments (docs/design.md section 8), each built from :class:`~.runner.BenchRun`, and the
measurements ``benchmarks/`` scripts share (the copy peak, the host probes)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import msgspec
import numpy as np
import torch

from cache_engine import CacheConfig

from ..engine import GREngine, resolve_device
from ..models import GRModel
from ..outputs import RankOutput
from .flops import gemm_peak_tflops
from .runner import BenchRun, BenchSettings, cache_config, engine_config, unlimited_pages
from .simulate import Simulations
from .trace import Trace, fixed_length_trace, generate_trace


def run_benchmark(settings: BenchSettings, echo: Callable[[str], None] = print,
                  checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Run every experiment; returns the results as a JSON-able dict (:mod:`.report`). ``checkpoint(results_so_far)``
    is called after each part, so that a run cut short keeps what it measured."""
    checkpoint = checkpoint or (lambda partial: None)
    trace = generate_trace(settings.trace)
    settings.check_trace(trace)
    echo(f"trace: {trace.summary()}")
    result: dict = {"trace": trace.summary(), "settings": _settings_dict(settings), "modes": {}, "simulated": {}}
    main = {"gpu_only": cache_config(settings, "gpu_only"), "hierarchical": cache_config(settings, "hierarchical"),
            "hierarchical_no_tail_persistence": cache_config(settings, "hierarchical", persist_tails=False)}
    # (result key, cache field, its values, modes): Table 3 and Table 6
    sweeps = (("chunk_sweep", "chunk_tokens", settings.chunk_sweep, ("hierarchical",)),
              ("budget_sweep", "num_gpu_pages", settings.budget_sweep, ("gpu_only", "hierarchical")))
    device = resolve_device(settings.device)  # one model, shared by every engine (its weights are read-only)
    model = GRModel(settings.model).to(device=device, dtype=settings.model.torch_dtype).eval()
    t0 = time.perf_counter()
    arena = host_arena(settings)  # pinned once, shared by every hierarchical engine of the run
    result["host_arena_pin_s"] = time.perf_counter() - t0
    largest = max(settings.batch_sizes)
    for mode in settings.modes:
        pages = unlimited_pages(settings, trace) if mode == "unlimited" else settings.gpu_pages
        run = BenchRun(settings, trace, cache_config(settings, mode, num_gpu_pages=pages), largest, arena, model)
        entry = {"startup_s": run.startup_s, "gpu_pages": pages}
        if mode != "recompute":
            entry["warmup"] = run.warmup()
        entry.update(host_probes(device))  # this host's speed as the windows start
        reports = run.windows([(bs, False) for bs in settings.batch_sizes] + [(largest, True)])
        run.close()
        entry["batch_sizes"] = dict(zip(settings.batch_sizes, reports, strict=False))
        entry["breakdown_bs8"] = reports[-1]
        for bs, e in entry["batch_sizes"].items():
            echo(f"{mode:<12} bs={bs}: median {e['median_ms']:.2f} ms, mean {e['mean_ms']:.2f}, p99 {e['p99_ms']:.2f}, "
                 f"max {e['max_ms']:.2f}, hit {e['total_hit_ratio']:.1%}")
        result["modes"][mode] = entry
        checkpoint(result)
    if "recompute" in settings.modes:
        result["cold_first_visit"] = cold_first_visits(settings, model, "recompute")
        # The same first visits where the history is also hashed and its KV kept, as in any caching mode.
        result["cold_first_visit_caching"] = cold_first_visits(settings, model, "gpu_only")
        checkpoint(result)
    if settings.tables_only:
        result["peak_pinned_h2d_GBps"] = peak_h2d_GBps(settings.device)
        result["gemm_peak_tflops"] = gemm_peak_tflops(settings.device)
        result.update(host_probes(device))
        return result
    for key, name, values, modes in sweeps:  # their policy simulations are added below
        result[key] = {mode: {value: _window(settings, trace, cache_config(settings, mode, **{name: value}), arena,
                                             model) for value in values} for mode in modes}
        checkpoint(result)
    result["lengths"] = _length_scan(settings, model)
    checkpoint(result)
    result["score_drift"] = _score_drift(settings, model)
    result["peak_pinned_h2d_GBps"] = peak_h2d_GBps(settings.device)
    result["gemm_peak_tflops"] = gemm_peak_tflops(settings.device)  # what model FLOP utilisation is measured against
    result.update(host_probes(device))
    # After the measurements: the simulations' workers must not share the CPU with a measured engine.
    echo("simulating the cache policies over the whole trace")
    swept = [(entry, cache_config(settings, mode, **{name: value})) for key, name, _, modes in sweeps
             for mode in modes for value, entry in result[key][mode].items()]
    simulations = Simulations(trace, [*main.values(), *(cache for _, cache in swept)], settings.simulation_workers)
    result["simulated"] = {name: simulations.get(cache) for name, cache in main.items()}
    for entry, cache in swept:
        entry["simulated"] = simulations.get(cache)
    simulations.close()
    return result


def host_arena(settings: BenchSettings) -> torch.Tensor | None:
    """Pinned host memory for the host chunk pools (CUDA only; on CPU each engine allocates its own)."""
    if not settings.device.startswith("cuda") or "hierarchical" not in settings.modes:
        return None
    return torch.empty(settings.host_budget_bytes, dtype=torch.uint8, pin_memory=True)


def _window(settings: BenchSettings, trace: Trace, cache: CacheConfig, arena: torch.Tensor | None = None,
            model: GRModel | None = None) -> dict:
    """One engine with ``cache`` over ``trace``: warm-up, then the windows at the largest batch size."""
    bs = max(settings.batch_sizes)
    run = BenchRun(settings, trace, cache, bs, arena, model)
    run.warmup()
    report, = run.windows([(bs, False)])
    run.close()
    return report


def _length_scan(settings: BenchSettings, model: GRModel) -> dict:
    """Latency against history length (``new_events`` per visit), recompute vs unlimited: per length one batch of
    users (:func:`~.trace.fixed_length_trace`); after the warm-up one batch of visits primes, the rest are measured."""
    bs = max(settings.batch_sizes)
    out: dict = {}
    for mode in ("recompute", "unlimited"):
        out[mode] = {}
        for length in settings.lengths:
            trace = fixed_length_trace(settings.trace, length, bs, settings.new_events)
            scan = dataclasses.replace(settings, batch_sizes=(bs,), window_requests=len(trace.steady) - bs,
                                       window_strata=1, prime_batches=1)
            pages = bs * 2 * (-(-(length + 8 * settings.new_events) // settings.page_size))
            out[mode][length] = _window(scan, trace, cache_config(settings, mode, num_gpu_pages=pages), model=model)
    return out


def cold_first_visits(settings: BenchSettings, model: GRModel, mode: str) -> dict:
    """End-to-end latency of a cold first visit: users with ``cold_history``-event histories (and the trace's
    candidates), each visit ranked alone (BS=1) by a warmed-up engine in cache ``mode`` with none of them cached
    (every history token is computed), from ``rank``'s call to its scores on the host; two visits unmeasured, then
    ``cold_visits``.

    Returns ``mode``, ``history`` (events), ``visits``, ``latency_ms`` (each visit's) and its ``median_ms``,
    ``mean_ms``, ``p99_ms`` and ``max_ms``."""
    trace = fixed_length_trace(settings.trace, settings.cold_history, settings.cold_visits + 2, settings.new_events)
    requests = [trace.rank_request(i) for i in range(settings.cold_visits + 2)]  # the first visits
    latency = []
    with GREngine(engine_config(settings, cache_config(settings, mode), 1), model=model) as engine:
        engine.warmup(use_tqdm=False)
        for i, request in enumerate(requests):
            t0 = time.perf_counter()
            output, = engine.rank([request], use_tqdm=False)
            elapsed_ms = (time.perf_counter() - t0) * 1e3
            if output.error:
                raise RuntimeError(f"cold visit failed: {output.error}")
            if i >= 2:
                latency.append(elapsed_ms)
    values = np.asarray(latency)
    return {"mode": mode, "history": settings.cold_history, "visits": len(latency), "latency_ms": latency,
            "median_ms": float(np.median(values)), "mean_ms": float(values.mean()),
            "p99_ms": float(np.percentile(values, 99)), "max_ms": float(values.max())}


def _score_drift(settings: BenchSettings, model: GRModel) -> dict:
    """How far scores served from host chunks move from recomputed ones, per host dtype (``kv``, ``float8_e4m3fn``).
    Real K/V: two batches of users with ``drift_history``-event histories on a GPU budget of one batch, so every
    returning user is served from host chunks; a ``recompute`` engine gives the reference scores.

    Returns per host dtype: ``max_abs`` and ``mean_abs`` score differences (logits) over the requests served from
    host, ``score_std`` (the reference spread), ``max_rel`` (``max_abs / score_std``), ``host_hit_ratio`` (history
    tokens loaded from host over all) and ``requests_from_host``."""
    bs = max(settings.batch_sizes)
    trace = fixed_length_trace(settings.trace, settings.drift_history, 2 * bs, settings.new_events)
    pages = bs * (-(-(settings.drift_history + 8 * settings.new_events) // settings.page_size) + 1)
    chunks = 2 * bs * -(-(settings.drift_history + 8 * settings.new_events) // settings.chunk_tokens)
    token_bytes = 2 * settings.model.num_layers * settings.model.num_heads * settings.model.head_dim * 4
    requests = [trace.rank_request(i) for i in range(len(trace.requests))]
    history = sum(len(r.item_ids) for r in requests)

    def serve(mode: str, **changes: object) -> list[RankOutput]:
        cache = cache_config(settings, mode, num_gpu_pages=pages,
                             host_budget_bytes=2 * chunks * settings.chunk_tokens * token_bytes, **changes)
        with GREngine(engine_config(settings, cache, bs), model=model) as engine:
            outputs = [o for start in range(0, len(requests), bs)
                       for o in engine.rank(requests[start:start + bs], use_tqdm=False)]
        if failed := [o.error for o in outputs if o.error]:
            raise RuntimeError(f"drift request failed: {failed[0]}")
        return outputs

    reference = [np.asarray(o.scores, dtype=np.float64) for o in serve("recompute")]
    spread = float(np.std(np.concatenate([r.ravel() for r in reference])))
    out: dict = {}
    for host_dtype in ("kv", "float8_e4m3fn"):
        outputs = serve("hierarchical", host_dtype=host_dtype)
        from_host = [i for i, o in enumerate(outputs) if o.num_host_cached_tokens]
        diffs = np.concatenate([np.abs(np.asarray(outputs[i].scores) - reference[i]).ravel() for i in from_host]
                               or [np.zeros(0)])
        worst = float(diffs.max(initial=0.0))
        out[host_dtype] = {"max_abs": worst, "mean_abs": float(diffs.mean()) if len(diffs) else 0.0,
                           "score_std": spread, "max_rel": worst / spread if spread else None,
                           "host_hit_ratio": sum(o.num_host_cached_tokens for o in outputs) / max(history, 1),
                           "requests_from_host": len(from_host)}
    return out


def peak_h2d_GBps(device: str) -> float | None:
    """The pinned host-to-device copy rate (GB/s, median of 5 copies of 256 MiB); ``None`` off CUDA."""
    if not device.startswith("cuda"):
        return None
    host = torch.empty(2**28, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device=device)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return host.numel() / float(np.median(times)) / 1e9


def host_python_loop_us(rounds: int = 200) -> float:
    """Median microseconds of ``sum(range(1000))`` over ``rounds`` rounds (:data:`~.report.HOST_PROBES`)."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sum(range(1000))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def host_torch_op_us(device: torch.device, rounds: int = 50, calls: int = 20) -> float:
    """Median microseconds of one ``add_`` on 1,024 floats on ``device`` (on CUDA an asynchronous kernel launch; the
    device synchronised between rounds of ``calls``; :data:`~.report.HOST_PROBES`)."""
    small = torch.zeros(1024, device=device)
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            small.add_(1)
        times.append((time.perf_counter() - t0) / calls)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return float(np.median(times)) * 1e6


def host_probes(device: torch.device) -> dict[str, float]:
    """This host's speed now: both probes of :data:`~.report.HOST_PROBES`, keyed by function name."""
    return {"host_python_loop_us": host_python_loop_us(), "host_torch_op_us": host_torch_op_us(device)}


def _settings_dict(settings: BenchSettings) -> dict:
    """``settings`` as JSON-able values, its model and trace last."""
    out = msgspec.to_builtins(settings)
    return {k: v for k, v in out.items() if k not in ("model", "trace")} | {k: out[k] for k in ("model", "trace")}
