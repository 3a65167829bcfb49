"""The control plane's own Prometheus metrics (`GET /metrics`): requests by route and
status, their latency, jobs by status read from the store at scrape time, and training
sessions' operations (Tinker's API): each one's latency and tokens by operation, so
tokens/s is `rate(pstar_session_tokens_total[1m])`. Training metrics of jobs come from
the workers through Ray's metrics (`ray_pstar_*`), tagged by job."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from service.store import Store
from service.store.status import JobStatus


class _JobsCollector:
    def __init__(self, store: Store, tenant: str | None) -> None:
        self.store, self.tenant = store, tenant

    def collect(self):
        g = GaugeMetricFamily("pstar_jobs", "fine-tuning jobs by status", labels=["status"])
        try:
            counts = self.store.jobs.count_by_status(self.tenant)
        except Exception:  # a scrape must not fail because the store is down; /readyz says so
            counts = {}
        for status in JobStatus:
            g.add_metric([status], counts.get(status, 0))
        yield g


class ApiMetrics:
    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pstar_http_requests",
            "HTTP requests by method, route and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "pstar_http_request_seconds",
            "HTTP request latency",
            ["method", "route"],
            buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
            registry=self.registry,
        )
        self.session_ops = Histogram(
            "pstar_session_operation_seconds",
            "training sessions' operations (forward_backward, optim_step, sample, ...): "
            "time from start to result",
            ["op"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=self.registry,
        )
        self.session_tokens = Counter(
            "pstar_session_tokens",
            "tokens through training sessions' operations (prompt and target tokens of "
            "forward/forward_backward, sampled tokens of sample)",
            ["op"],
            registry=self.registry,
        )
        self.store = store

    def session_op(self, op: str, seconds: float, tokens: int) -> None:
        self.session_ops.labels(op).observe(seconds)
        if tokens:
            self.session_tokens.labels(op).inc(tokens)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)

    def render(self, tenant: str | None) -> bytes:
        """The request metrics (routes, not tenants) and the jobs of `tenant` (of every
        tenant with None) by status."""
        jobs = CollectorRegistry()
        jobs.register(_JobsCollector(self.store, tenant))
        return generate_latest(self.registry) + generate_latest(jobs)
