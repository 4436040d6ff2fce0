"""`GET /metrics`: Prometheus text exposition with SGLang's metric names (served with --enable-metrics).

Nothing is pushed into prometheus_client objects as requests run: a custom collector reads the
TokenizerManager counters and one fresh scheduler `get_load()` reply at scrape time. docs/metrics.md
lists every metric with its type and unit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.utils import floatToGoString
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from managers.generate_input import RequestError
from srt.entrypoints.http_errors import json_error

__all__ = ["SglangCollector", "register_metrics_routes"]

logger = logging.getLogger(__name__)

GET_LOAD_TIMEOUT_S = 10.0
LABELS = ["model_name"]


@dataclass
class Snapshot:
    """Everything one scrape exports, read once so the families are mutually consistent."""

    model_name: str
    load: Any       # managers.io_struct.GetLoadReqOutput
    metrics: Any    # managers.tokenizer_manager.TokenizerMetrics
    gen_throughput: float


class GenThroughput:
    """Generated tokens per second over the interval since the previous scrape.

    The first scrape measures from the server's start. Several scrapers share one interval, as
    SGLang's value is shared by everyone reading its last logging interval.
    """

    def __init__(self, start_time: float, start_tokens: float = 0.0) -> None:
        self._last: Tuple[float, float] = (start_time, start_tokens)

    def update(self, now: float, tokens: float) -> float:
        t0, n0 = self._last
        self._last = (now, tokens)
        return max(tokens - n0, 0.0) / (now - t0) if now > t0 else 0.0


class SglangCollector:
    """prometheus_client custom collector over the snapshot taken by the current scrape."""

    def __init__(self) -> None:
        self.snapshot: Optional[Snapshot] = None

    def describe(self) -> List[Metric]:
        return []  # no describe-time registration checks: names are fixed below

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        label = [snap.model_name]
        load, m, counters = snap.load, snap.metrics, snap.load.counters
        queried = float(counters.get("prefix_queried_tokens", 0))
        hit = float(counters.get("prefix_hit_tokens", 0))
        gauges = [
            ("sglang:num_running_reqs", "Requests in the running (decode) batch.", load.num_running_reqs),
            ("sglang:num_queue_reqs", "Requests in the waiting queue.", load.num_waiting_reqs),
            ("sglang:token_usage", "Fraction of the KV pool held by requests (evictable cache not counted).",
             load.token_usage),
            ("sglang:cache_hit_rate", "Prefix-cache hit tokens / queried prompt tokens since start.",
             hit / queried if queried else 0.0),
            ("sglang:gen_throughput", "Generated tokens per second since the previous scrape.",
             snap.gen_throughput),
            ("sglang:max_total_num_tokens", "Size of the KV pool in tokens.", load.max_total_num_tokens),
            ("sglang:num_retracted_reqs", "Requests retracted for lack of KV since start (monotonic).",
             counters.get("num_retractions", 0)),
        ]
        for name, doc, value in gauges:
            yield _family(GaugeMetricFamily(name, doc, labels=LABELS), label, value)
        counter_values = [
            ("sglang:prompt_tokens", "Prompt tokens of finished requests.", m.prompt_tokens),
            ("sglang:generation_tokens", "Generated tokens of finished requests.", m.generation_tokens),
            ("sglang:cached_tokens", "Prompt tokens of finished requests served from the prefix cache.",
             m.cached_tokens),
            ("sglang:num_requests", "Finished requests (each of n > 1 outputs counts once).", m.num_finished),
            ("sglang:num_aborted_requests", "Requests aborted: abort finishes and client disconnects.",
             m.num_aborted),
            ("sglang:prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.", queried),
            ("sglang:prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", hit),
        ]
        for name, doc, value in counter_values:
            # CounterMetricFamily takes the base name; the exposition appends `_total`.
            yield _family(CounterMetricFamily(name, doc, labels=LABELS), label, value)
        yield from _replica_families(snap.model_name, load.replicas)
        histograms = [
            ("sglang:time_to_first_token_seconds", "Time to first token of streamed requests.",
             m.time_to_first_token),
            ("sglang:inter_token_latency_seconds", "Time per output token between stream updates.",
             m.inter_token_latency),
            ("sglang:e2e_request_latency_seconds", "Arrival to finish of each request output.", m.e2e_latency),
        ]
        for name, doc, hist in histograms:
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            family.add_metric(label, _cumulative_buckets(hist), sum_value=hist.sum)
            yield family


REPLICA_GAUGES = (
    ("sglang:dp_num_requests", "Requests received by each data-parallel replica since start.", "num_requests"),
    ("sglang:dp_prefix_cache_queried_tokens", "Prompt tokens each replica looked up in its prefix cache.",
     "prefix_queried_tokens"),
    ("sglang:dp_prefix_cache_hit_tokens", "Prompt tokens each replica found in its prefix cache.", "prefix_hit_tokens"),
    ("sglang:dp_generated_tokens", "Tokens each replica generated since start.", "generated_tokens"),
)


def _replica_families(model_name: str, replicas: List[dict]) -> Iterator[Metric]:
    """With --dp-size > 1: the per-replica numbers (label dp_rank); the unlabeled families are totals."""
    if not replicas:
        return
    labels = LABELS + ["dp_rank"]
    running = GaugeMetricFamily("sglang:dp_num_running_reqs", "Running requests of each replica.", labels=labels)
    usage = GaugeMetricFamily("sglang:dp_token_usage", "KV pool fraction held on each replica.", labels=labels)
    for r in replicas:
        key = [model_name, str(r["dp_rank"])]
        running.add_metric(key, float(r["num_running_reqs"]))
        usage.add_metric(key, float(r["token_usage"]))
    yield running
    yield usage
    for name, doc, counter in REPLICA_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=labels)
        for r in replicas:
            family.add_metric([model_name, str(r["dp_rank"])], float(r["counters"].get(counter, 0)))
        yield family


def _family(family: Metric, label: List[str], value: float) -> Metric:
    family.add_metric(label, float(value))
    return family


def _cumulative_buckets(hist: Any) -> List[Tuple[str, float]]:
    """LatencyHistogram keeps per-bucket counts; Prometheus wants cumulative `le` counts with +Inf last."""
    out, running = [], 0
    bounds = [floatToGoString(b) for b in hist.buckets] + ["+Inf"]
    for bound, count in zip(bounds, hist.counts):
        running += count
        out.append((bound, float(running)))
    return out


async def metrics_handler(request: web.Request) -> web.Response:
    """One scheduler load report, then the exposition; 503 when the scheduler cannot answer."""
    state = request.app["state"]
    if not getattr(state.server_args, "enable_metrics", False):
        return json_error(404, "Metrics are disabled: start the server with --enable-metrics to serve "
                               "/metrics.", code="metrics_disabled")
    if state.dead_reason is not None or state.shutting_down:
        return json_error(503, f"The server is not serving: {state.dead_reason or 'shutting down'}.",
                          code="service_unavailable")
    tm = state.tokenizer_manager
    try:
        load = await asyncio.wait_for(tm.get_load(), GET_LOAD_TIMEOUT_S)
    except asyncio.TimeoutError:
        return json_error(503, f"The scheduler did not report its load within {GET_LOAD_TIMEOUT_S:.0f} s.",
                          code="service_unavailable")
    except RequestError as exc:
        return json_error(503, str(exc), code="service_unavailable")
    exporter: _Exporter = request.app[_EXPORTER]
    tokens = float(load.counters.get("generated_tokens", 0))
    if exporter.throughput is None:
        exporter.throughput = GenThroughput(state.started_time)
    rate = exporter.throughput.update(time.time(), tokens)
    exporter.collector.snapshot = Snapshot(state.model_name, load, tm.metrics, rate)
    try:
        body = generate_latest(exporter.registry)
    finally:
        exporter.collector.snapshot = None
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


class _Exporter:
    """One private registry per app (never the global REGISTRY: several servers may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = SglangCollector()
        self.registry.register(self.collector)
        self.throughput: Optional[GenThroughput] = None  # created at the first scrape


_EXPORTER = web.AppKey("metrics_exporter", _Exporter)


def register_metrics_routes(app: web.Application) -> None:
    """Add `GET /metrics`; it reads `app["state"]` at request time (404 without --enable-metrics)."""
    app[_EXPORTER] = _Exporter()
    app.router.add_get("/metrics", metrics_handler)
