"""Prometheus metrics of a served engine (``GET /metrics``), all named ``gr_engine_*``.

Request counters and histograms are observed by each API server's client as outputs arrive; the engine's own
counters, gauges and step histogram are the core's latest report (:class:`~.protocol.CoreStats`), read when scraped.
With several API-server processes (``PROMETHEUS_MULTIPROC_DIR`` set before ``prometheus_client`` is imported, as
``gr-engine serve --api-servers N`` does), the request figures live in that folder and every scrape, whichever
server answers it, reports their sums over all servers; the core's figures are not summed (there is one core).
Behind a :class:`~.router.ReplicaRouter` (``gr-engine serve --replicas N``) each replica's core figures carry a
``replica`` label, and the router's own counters are added.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from ..outputs import GenerateOutput, RankOutput
from .client import AsyncGREngine
from .protocol import STEP_BUCKETS, CoreStats
from .router import ReplicaRouter

_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServingMetrics:
    """The metrics of one API server's :class:`~.client.AsyncGREngine` or :class:`~.router.ReplicaRouter` (it
    registers itself as its observer).

    Args:
        engine: the client (or router) whose outputs and core reports are counted.
        server: the API server's index (``0`` .. ``N - 1``), the ``server`` label of ``http_bodies_total``.

    Metrics: ``requests_total`` (finished, by ``outcome``: ``ok`` or an error kind), ``request_errors_total``
    (by ``kind``, including ``overloaded`` and ``bad_request``, which never reach the engine),
    ``request_latency_seconds`` and ``request_queue_seconds`` (histograms), ``http_bodies_total`` (request bodies
    answered, by ``server``); from the core: ``step_seconds`` (histogram), ``requests_running`` and
    ``requests_waiting`` (gauges), ``queue_wait_seconds`` (the queue-wait estimate admission uses),
    ``computed_tokens_total``, ``gpu_hit_tokens_total``, ``host_hit_tokens_total``, ``gpu_pages_used``,
    ``gpu_pages_free``, ``host_bytes_used``, ``onloaded_bytes_total``, ``offloaded_bytes_total``,
    ``finished_requests_total``, ``history_tokens_total``, the cache's counters (``evicted_users_total``,
    ``evicted_tokens_total``, ``truncated_tokens_total``, ``prefetched_tokens_total``, ``host_evicted_users_total``,
    ``onloaded_tokens_total``, ``offloaded_tokens_total``, ``tail_persisted_tokens_total``, ``lost_tokens_total``,
    ``deferred_offloads_total``, ``unfinished_copy_tokens_total``), ``kernel_compilations_total``,
    ``kernel_cache_loads_total``, ``graph_captures_total`` (behind a router: each replica's, labelled ``replica``,
    plus ``router_requests_total{replica}``, ``router_reroutes_total``, ``router_retries_total`` and
    ``router_restarts_total``).
    """

    def __init__(self, engine: AsyncGREngine | ReplicaRouter, server: int = 0) -> None:
        self.engine, self.server = engine, server
        own = CollectorRegistry(auto_describe=True)
        self.requests = Counter("gr_engine_requests", "Requests answered, by outcome (ok or the error kind).",
                                ["outcome"], registry=own)
        self.errors = Counter("gr_engine_request_errors", "Requests refused or failed, by kind.", ["kind"],
                              registry=own)
        self.latency = Histogram("gr_engine_request_latency_seconds", "Seconds from submission to answer.",
                                 buckets=_LATENCY_BUCKETS, registry=own)
        self.queue = Histogram("gr_engine_request_queue_seconds",
                               "Seconds a request spent in the engine core outside the steps that served it.",
                               buckets=_LATENCY_BUCKETS, registry=own)
        self.bodies = Counter("gr_engine_http_bodies", "HTTP request bodies answered (any status), by API server.",
                              ["server"], registry=own)
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory:  # every server's figures from the shared folder (this server's own are written there too)
            self.registry = CollectorRegistry()
            MultiProcessCollector(self.registry, path=directory)
        else:
            self.registry = own
        self.registry.register(_CoreCollector(engine))
        if isinstance(engine, ReplicaRouter):
            self.registry.register(_RouterCollector(engine))
        engine.observers.append(self.observe_output)

    def observe_output(self, output: RankOutput | GenerateOutput, error_kind: str | None, queue_s: float) -> None:
        """Count one answered request."""
        outcome = "ok" if output.error is None else (error_kind or "engine")
        self.requests.labels(outcome).inc()
        if output.error is not None:
            self.errors.labels(outcome).inc()
        self.latency.observe(output.latency_s)
        self.queue.observe(queue_s)

    def count_refused(self, kind: str, requests: int = 1) -> None:
        """Count requests refused before reaching the engine (``overloaded``, ``bad_request``, ``unavailable``)."""
        self.errors.labels(kind).inc(requests)

    def count_body(self) -> None:
        """Count one answered HTTP request body."""
        self.bodies.labels(str(self.server)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


#: The core's figures: (metric family, name after ``gr_engine_``, :class:`~.protocol.CoreStats` field, help text).
_CORE_FIGURES = [
    (GaugeMetricFamily, "requests_running", "running", "Requests admitted to engine steps."),
    (GaugeMetricFamily, "requests_waiting", "waiting", "Requests queued in the engine core."),
    (GaugeMetricFamily, "queue_wait_seconds", "queue_wait_s",
     "The engine core's estimate of how long a request arriving now waits before a step takes it."),
    (GaugeMetricFamily, "gpu_pages_used", "gpu_pages_used", "KV pages of the GPU pool in use."),
    (GaugeMetricFamily, "gpu_pages_free", "gpu_pages_free", "KV pages of the GPU pool free."),
    (GaugeMetricFamily, "host_bytes_used", "host_bytes_used", "Bytes of host chunk slots holding history."),
    (CounterMetricFamily, "computed_tokens", "computed_tokens", "Tokens computed (history, candidates)."),
    (CounterMetricFamily, "gpu_hit_tokens", "gpu_hit_tokens", "History tokens reused from GPU pages."),
    (CounterMetricFamily, "host_hit_tokens", "host_hit_tokens", "History tokens loaded from host chunks."),
    (CounterMetricFamily, "onloaded_bytes", "onloaded_bytes", "Bytes copied from host to GPU."),
    (CounterMetricFamily, "offloaded_bytes", "offloaded_bytes", "Bytes copied from GPU to host."),
    (CounterMetricFamily, "finished_requests", "finished_requests",
     "Requests the engine core finished without error."),
    (CounterMetricFamily, "history_tokens", "history_tokens",
     "History tokens of the requests finished (reused from GPU or host, or computed)."),
    (CounterMetricFamily, "evicted_users", "evicted_users", "Users whose GPU pages were reclaimed (GPU LRU eviction)."),
    (CounterMetricFamily, "evicted_tokens", "evicted_tokens", "Cached tokens the evicted users held on the GPU."),
    (CounterMetricFamily, "truncated_tokens", "truncated_tokens",
     "Cached tokens dropped because a request's history no longer matched them."),
    (CounterMetricFamily, "prefetched_tokens", "prefetched_tokens",
     "History tokens loaded from host as the user's request arrived (prefetch)."),
    (CounterMetricFamily, "host_evicted_users", "host_evicted_users",
     "Users whose host copy was dropped to free host slots (host LRU eviction)."),
    (CounterMetricFamily, "onloaded_tokens", "onloaded_tokens", "History tokens copied from host to GPU."),
    (CounterMetricFamily, "offloaded_tokens", "offloaded_tokens", "History tokens copied from GPU to host."),
    (CounterMetricFamily, "tail_persisted_tokens", "tail_persisted_tokens",
     "Tokens of partial chunks copied to host as their user was evicted from the GPU."),
    (CounterMetricFamily, "lost_tokens", "lost_tokens",
     "Tokens of users evicted from the GPU that could not be kept on host (no free slot, or tails not persisted)."),
    (CounterMetricFamily, "deferred_offloads", "deferred_offloads",
     "Chunk-steps that full chunks waited for an offload slot (max_pending_offloads)."),
    (CounterMetricFamily, "unfinished_copy_tokens", "unfinished_copy_tokens",
     "History tokens a request waited for: the user's copy to host, begun as it left the GPU, had not finished."),
    (CounterMetricFamily, "kernel_compilations", "kernel_compilations",
     "Triton kernels compiled by the engine core (none after warm-up)."),
    (CounterMetricFamily, "kernel_cache_loads", "kernel_cache_loads",
     "Triton kernels loaded from the disk cache by the engine core (none after warm-up)."),
    (CounterMetricFamily, "graph_captures", "graph_captures",
     "CUDA graphs captured by the engine core (none after warm-up)."),
]


class _CoreCollector:
    """The latest counters, gauges and step histogram of the core, read at scrape time; behind a
    :class:`~.router.ReplicaRouter`, those of each replica's core, labelled ``replica``."""

    def __init__(self, engine: AsyncGREngine | ReplicaRouter) -> None:
        self.engine = engine

    def describe(self) -> list:
        return []

    def _sources(self) -> tuple[list[str], list[tuple[list[str], CoreStats]]]:
        """The label names, and each core's label values and latest stats (cores not yet reporting left out)."""
        if isinstance(self.engine, ReplicaRouter):
            return ["replica"], [([str(i)], e.stats) for i, e in self.engine.engines.items() if e.stats is not None]
        return [], [([], self.engine.stats)] if self.engine.stats is not None else []

    def collect(self):
        labels, sources = self._sources()
        if not sources:
            return
        for family, name, field, text in _CORE_FIGURES:
            metric = family(f"gr_engine_{name}", text, labels=labels)
            for values, stats in sources:
                metric.add_metric(values, getattr(stats, field))
            yield metric
        steps = HistogramMetricFamily("gr_engine_step_seconds", "Wall seconds of each engine step.", labels=labels)
        for values, stats in sources:
            buckets = [(repr(bound), count) for bound, count in zip(STEP_BUCKETS, stats.step_buckets, strict=True)]
            steps.add_metric(values, [*buckets, ("+Inf", stats.steps)], sum_value=stats.step_seconds)
        yield steps


class _RouterCollector:
    """A :class:`~.router.ReplicaRouter`'s own counters (:class:`~.replicas.RouterCounts`), read at scrape time."""

    def __init__(self, router: ReplicaRouter) -> None:
        self.router = router

    def describe(self) -> list:
        return []

    def collect(self):
        counts = self.router.counts
        requests = CounterMetricFamily("gr_engine_router_requests", "Requests the router sent to each replica "
                                       "(first sends and retries).", labels=["replica"])
        for replica, count in counts.requests.items():
            requests.add_metric([str(replica)], count)
        yield requests
        yield CounterMetricFamily("gr_engine_router_reroutes", "Requests sent to a replica other than their "
                                  "user's home (it was dead or off the ring).", value=counts.reroutes)
        yield CounterMetricFamily("gr_engine_router_retries", "Requests whose replica died before answering, sent "
                                  "again to their user's next replica.", value=counts.retries)
        yield CounterMetricFamily("gr_engine_router_restarts", "Dead replicas whose engine core was started again.",
                                  value=counts.restarts)
