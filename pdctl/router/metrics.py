"""Router Prometheus metrics (prometheus-client), one registry per router."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdctl.router.workers import Worker, WorkerRegistry


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdctl_router_requests", "Requests", ["route", "status"], registry=r)
        self.latency = Histogram(
            "pdctl_router_request_duration_seconds",
            "Request latency",
            ["route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )
        self.selection = Counter("pdctl_router_worker_selection", "Worker picks", ["worker", "role"], registry=r)
        self.retries = Counter("pdctl_router_retries", "Retried requests", ["reason"], registry=r)
        self.in_flight = Gauge("pdctl_router_in_flight_requests", "Requests in flight", registry=r)
        self.queued = Gauge("pdctl_router_queued_requests", "Requests waiting for a slot", registry=r)
        self.body_bytes = Gauge(
            "pdctl_router_request_body_bytes",
            "Bytes of request bodies the router holds (being read, or waiting for their answer)",
            registry=r,
        )
        self.worker_health = Gauge("pdctl_router_worker_healthy", "1 if healthy", ["worker", "role"], registry=r)
        self.worker_load = Gauge("pdctl_router_worker_load", "Requests in flight", ["worker", "role"], registry=r)

        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, cached: labels() costs microseconds on the hot path."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def selected(self, prefill: Worker, decode: Worker) -> None:
        self.child(self.selection, prefill.url, "prefill").inc()
        self.child(self.selection, decode.url, "decode").inc()

    def retried(self, reason: str) -> None:
        self.child(self.retries, reason).inc()

    def render(self, workers: WorkerRegistry) -> bytes:
        for w in workers.workers.values():
            self.worker_health.labels(w.url, w.role).set(1 if w.healthy else 0)
            self.worker_load.labels(w.url, w.role).set(w.load)
        return generate_latest(self.registry)
