"""Prometheus metrics of one API replica, plus job counts read from the shared store.

Counters and histograms are per replica (label `replica`), so a scrape through the load-balanced
HTTP port sees one replica at a time; with several replicas, sum over `replica` or scrape Ray's
own metrics endpoint. Job counts by status come from the store and are the same everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from operators.core.chain import StepRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
logger = logging.getLogger("ray.serve")


class JobCountCollector(Collector):
    def __init__(self, count_by_status: Callable[[], dict[str, int]]) -> None:
        self._count_by_status = count_by_status

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "memstream_jobs", "Jobs in the store by status", labels=["status"]
        )
        try:
            counts = self._count_by_status()
        except Exception:  # a scrape must not fail because the store is briefly unreachable
            logger.warning("job counts unavailable for /metrics", exc_info=True)
            counts = {}
        for status in ("queued", "running", "succeeded", "failed", "cancelled"):
            family.add_metric([status], counts.get(status, 0))
        yield family


class ServingMetrics:
    def __init__(self, replica: str, count_jobs: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        labels = {"labelnames": ["replica"], "registry": self.registry}
        self.replica = replica
        self.http_requests = Counter(
            "memstream_http_requests",
            "HTTP requests by route and status",
            labelnames=["replica", "method", "route", "status"],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            "memstream_http_request_duration_seconds",
            "HTTP request latency until the response starts",
            labelnames=["replica", "route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.answers = Counter(
            "memstream_answers",
            "Questions answered, by mode (sync or job) and chain status",
            labelnames=["replica", "mode", "status"],
            registry=self.registry,
        )
        self.steps = Counter(
            "memstream_chain_steps",
            "Model calls of memory chains",
            labelnames=["replica", "kind"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "memstream_tokens",
            "Tokens of model calls",
            labelnames=["replica", "kind"],
            registry=self.registry,
        )
        self.step_latency = Histogram(
            "memstream_step_latency_seconds",
            "Latency of one model call",
            buckets=LATENCY_BUCKETS,
            **labels,
        )
        self.input_bytes = Counter("memstream_input_bytes", "Bytes of documents read", **labels)
        self.jobs_running_here = Gauge(
            "memstream_jobs_running_in_replica", "Jobs this replica is running", **labels
        )
        self.registry.register(JobCountCollector(count_jobs))

    def observe_step(self, record: StepRecord) -> None:
        self.steps.labels(self.replica, record.kind).inc()
        self.tokens.labels(self.replica, "prompt").inc(record.prompt_tokens)
        self.tokens.labels(self.replica, "completion").inc(record.completion_tokens)
        self.step_latency.labels(self.replica).observe(record.latency_s)

    def observe_answer(self, mode: str, status: str) -> None:
        self.answers.labels(self.replica, mode, status).inc()

    def observe_http(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(self.replica, method, route, str(status)).inc()
        self.http_latency.labels(self.replica, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
