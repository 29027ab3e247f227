"""Router Prometheus metrics (prometheus-client), one registry per router.

What every request updates (requests by route and status, latency, worker picks) is kept in
plain integers and floats that a collector reads at scrape time: prometheus-client's own
metrics take a lock per update and walk a histogram's buckets in Python, several microseconds
per request on the router's hot path. The rest are prometheus-client metrics.
"""

from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pdctl.roles import Role
from pdctl.router import errors
from pdctl.router.workers import Worker, WorkerRegistry

if TYPE_CHECKING:
    from pdctl.router.pair_room import PairRoom


def _short_reader(room: PairRoom, role: Role) -> Callable[[], float]:
    return lambda: float(role in room.short())


class RouterMetrics:
    """The router's Prometheus metrics, in a registry of their own (``registry``). The per-request counts live in
    ``hot`` and are read only at scrape time."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._children: dict[tuple, object] = {}
        self.hot = HotCounters()
        r.register(self.hot)
        ProcessCollector(registry=r)  # process_start_time_seconds (restarts), CPU, memory: read at scrape
        self.retries = Counter("pdctl_router_retries", "Retried requests", ["reason"], registry=r)
        for reason in RETRY_REASONS:  # a series at 0 from the start: rate() and dashboards see "none yet"
            self.child(self.retries, reason)
        self.in_flight = Gauge("pdctl_router_in_flight_requests", "Requests in flight", registry=r)
        self.queued = Gauge("pdctl_router_queued_requests", "Requests waiting for a slot", registry=r)
        self.waiting_for_workers = 0
        """Requests waiting for a worker to come into rotation (their role had none)."""
        Gauge(
            "pdctl_router_requests_waiting_for_workers",
            "Requests waiting for a worker to come into rotation (their role had none: --worker-wait-secs)",
            registry=r,
        ).set_function(lambda: self.waiting_for_workers)
        self.body_bytes = Gauge(
            "pdctl_router_request_body_bytes",
            "Bytes of request bodies the router holds (being read, or waiting for their answer)",
            registry=r,
        )
        self.fleet = FleetCollector()
        r.register(self.fleet)
        self.weight_updates = Counter(
            "pdctl_router_weight_updates",
            "Weight transactions ended, by outcome (complete, failed, abandoned: its lease ran out)",
            ["outcome"],
            registry=r,
        )
        self.refit_phase = Histogram(
            "pdctl_router_weight_update_phase_seconds",
            "Seconds per phase of a weight transaction (probe, hold, pause, transfer, ... as its trainer reported)",
            ["phase"],
            buckets=REFIT_BUCKETS,
            registry=r,
        )
        self.refit_held = Histogram(
            "pdctl_router_weight_update_held_seconds",
            "How long a weight transaction held the router (new requests waited at its gate)",
            buckets=REFIT_BUCKETS,
            registry=r,
        )

    def watch_room(self, room: PairRoom) -> None:
        """Late pairing's queue, read at scrape time: ``pdctl_router_pd_waiting_for_room`` (requests
        waiting) and ``pdctl_router_pd_room_short{role}`` (1 while no engine of the role has room)."""
        Gauge(
            "pdctl_router_pd_waiting_for_room",
            "PD requests waiting in the router for a prefill or decode with room (late pairing: --pd-prefill-room)",
            registry=self.registry,
        ).set_function(lambda: room.waiting)
        short = Gauge(
            "pdctl_router_pd_room_short",
            "1 while no engine of the role in rotation has room for another request (late pairing)",
            ["role"],
            registry=self.registry,
        )
        for role in (Role.PREFILL, Role.DECODE):
            short.labels(str(role)).set_function(_short_reader(room, role))

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, cached: labels() costs microseconds on the hot path."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def selected(self, prefill: Worker, decode: Worker) -> None:
        """Count one pick of each of ``prefill`` and ``decode`` (``pdctl_router_worker_selection``)."""
        picks = self.hot.picks
        picks[prefill] += 1
        picks[decode] += 1

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
        """Count one retry for ``reason`` (one of ``RETRY_REASONS``, or any other label)."""
        self.child(self.retries, reason).inc()

    def weight_update_ended(self, outcome: str, phases: dict[str, float], held_secs: float | None) -> None:
        """A weight transaction ended: ``phases`` as its trainer timed them, ``held_secs`` the
        router's own hold (None for a transaction that never held it)."""
        self.weight_updates.labels(outcome).inc()
        for phase, secs in phases.items():
            self.refit_phase.labels(phase).observe(secs)
        if held_secs is not None:
            self.refit_held.observe(held_secs)

    def render(self, workers: WorkerRegistry) -> bytes:
        """Every metric in the Prometheus text format, with the per-worker series read from ``workers`` now."""
        self.fleet.workers = workers
        return generate_latest(self.registry)


RETRY_REASONS = (
    "busy",
    errors.PREFILL_FAILED,
    errors.DECODE_FAILED,
    errors.WORKER_FAILED,
    errors.CONTINUATION_FAILED,
    errors.INTERRUPTED,
    errors.HANDED_OFF,
    "stream_resumed",
)
"""The reasons dispatch counts retries under (pdctl.router.dispatch)."""
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
REFIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class FleetCollector(Collector):
    """Each worker's state as the router sees it, read at scrape time: a worker that left the
    registry, or a version it no longer holds, leaves no stale series behind."""

    def __init__(self) -> None:
        self.workers: WorkerRegistry | None = None

    def collect(self) -> Iterator[Metric]:
        """The per-worker series (health, load, circuit, restarts, weight version) of every worker registered now; none
        before ``workers`` is set."""
        labels = ["worker", "worker_type"]  # not "role": a scrape's target label (pdctl metrics) is
        healthy = GaugeMetricFamily("pdctl_router_worker_healthy", "1 if the worker is in rotation", labels=labels)
        load = GaugeMetricFamily("pdctl_router_worker_load", "Requests the router has in flight on it", labels=labels)
        circuit = GaugeMetricFamily(
            "pdctl_router_worker_circuit_open", "1 while its circuit breaker is open", labels=labels
        )
        opens = CounterMetricFamily(
            "pdctl_router_worker_circuit_opens", "Times its circuit breaker opened", labels=labels
        )
        restarts = CounterMetricFamily(
            "pdctl_router_worker_restarts",
            "Times its process went away (refused connections) and a new one passed its health check",
            labels=labels,
        )
        version = GaugeMetricFamily(
            "pdctl_router_worker_weight_version",
            "1 for the weight version the worker holds (label version; empty when unknown)",
            labels=[*labels, "version"],
        )
        now = time.monotonic()
        for w in self.workers.workers.values() if self.workers is not None else ():
            key = [w.url, str(w.role)]
            healthy.add_metric(key, 1 if w.healthy else 0)
            load.add_metric(key, w.load)
            circuit.add_metric(key, 1 if w.cb_open_until > now else 0)
            opens.add_metric(key, w.cb_opens)
            restarts.add_metric(key, w.restarts)
            version.add_metric([*key, w.weight_version or ""], 1)
        yield from (healthy, load, circuit, opens, restarts, version)


class HotCounters(Collector):
    """The request path's counters, as Prometheus metrics at scrape time."""

    def __init__(self) -> None:
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.latency: dict[str, list[float]] = {}
        """Per route: a count per bucket (``le`` each of LATENCY_BUCKETS, then +Inf), then the sum."""
        self.picks: collections.Counter[Worker] = collections.Counter()
        """Per worker object (a counter per pick, no key to build); labelled by URL and role at scrape."""

    def collect(self) -> Iterator[Metric]:
        """The request counts, latency histograms and worker picks, as Prometheus metric families."""
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
        picks = CounterMetricFamily("pdctl_router_worker_selection", "Worker picks", labels=["worker", "worker_type"])
        by_labels: collections.Counter[tuple[str, str]] = collections.Counter()
        for worker, n in list(self.picks.items()):  # (a worker removed and added again is one series)
            by_labels[worker.url, str(worker.role)] += n
        for (url, role), n in sorted(by_labels.items()):
            picks.add_metric([url, role], n)
        yield picks
