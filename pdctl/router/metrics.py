"""Router Prometheus metrics (prometheus-client), one registry per router.

What every request updates (requests by route and status, latency, worker picks) is kept in
plain integers and floats that a collector reads at scrape time: prometheus-client's own
metrics take a lock per update and walk a histogram's buckets in Python, several microseconds
per request on the router's hot path. The rest are prometheus-client metrics.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pdctl.router.workers import Worker, WorkerRegistry


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.hot = HotCounters()
        r.register(self.hot)
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
        picks = self.hot.picks
        picks[prefill.url, "prefill"] += 1
        picks[decode.url, "decode"] += 1

    def answered(self, route: str, status: int, seconds: float) -> None:
        """A request ended with ``status`` after ``seconds``."""
        hot = self.hot
        hot.requests[route, status] += 1
        latency = hot.latency.get(route)
        if latency is None:
            latency = hot.latency[route] = [0.0] * (len(LATENCY_BUCKETS) + 2)  # buckets, +Inf, then the sum
        latency[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        latency[-1] += seconds

    def retried(self, reason: str) -> None:
        self.child(self.retries, reason).inc()

    def render(self, workers: WorkerRegistry) -> bytes:
        for w in workers.workers.values():
            self.worker_health.labels(w.url, w.role).set(1 if w.healthy else 0)
            self.worker_load.labels(w.url, w.role).set(w.load)
        return generate_latest(self.registry)


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class HotCounters(Collector):
    """The request path's counters, as Prometheus metrics at scrape time."""

    def __init__(self) -> None:
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.latency: dict[str, list[float]] = {}
        """Per route: a count per bucket (``le`` each of LATENCY_BUCKETS, then +Inf), then the sum."""
        self.picks: collections.Counter[tuple[str, str]] = collections.Counter()

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("pdctl_router_requests", "Requests", labels=["route", "status"])
        for (route, status), n in sorted(self.requests.items()):
            requests.add_metric([route, str(status)], n)
        yield requests
        latency = HistogramMetricFamily("pdctl_router_request_duration_seconds", "Request latency", labels=["route"])
        for route, counts in sorted(self.latency.items()):
            cumulative, running = [], 0.0
            for bound, count in zip([*map(floatToGoString, LATENCY_BUCKETS), "+Inf"], counts[:-1], strict=True):
                running += count
                cumulative.append((bound, running))
            latency.add_metric([route], cumulative, sum_value=counts[-1])
        yield latency
        picks = CounterMetricFamily("pdctl_router_worker_selection", "Worker picks", labels=["worker", "role"])
        for (url, role), n in sorted(self.picks.items()):
            picks.add_metric([url, role], n)
        yield picks
