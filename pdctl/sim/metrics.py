"""Prometheus metrics with SGLang's ``sglang:`` names, one registry per server (prometheus-client)."""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdctl.sim.engine import Request

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class SimMetrics:
    """One engine's Prometheus metrics under SGLang's ``sglang:`` names, labelled with the served model name, in a
    registry of its own (several sims may share a process). Thread-safe: the scheduler thread and the HTTP handlers
    both record."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self._running = Gauge("sglang:num_running_reqs", "Running requests", labels, registry=r)
        self._queued = Gauge("sglang:num_queue_reqs", "Queued requests", labels, registry=r)
        self._prealloc = Gauge(
            "sglang:num_decode_prealloc_queue_reqs", "Decode requests waiting for a KV slot", labels, registry=r
        )
        self._transfer = Gauge(
            "sglang:num_decode_transfer_queue_reqs", "Decode requests whose KV is in transfer", labels, registry=r
        )
        self._bootstrap = Gauge(
            "sglang:num_prefill_prealloc_queue_reqs",
            "Prefill requests waiting for their decode's handshake (the bootstrap queue)",
            labels,
            registry=r,
        )
        self._usage = Gauge("sglang:token_usage", "KV token usage", labels, registry=r)
        self._throughput = Gauge("sglang:gen_throughput", "Generation tokens/s", labels, registry=r)
        self._prompt = Counter("sglang:prompt_tokens", "Prompt tokens", labels, registry=r)
        self._cached = Counter(
            "sglang:cached_tokens",
            "Prompt tokens found in the prefix cache, by source (SGLang's cache_source: device only here)",
            [*labels, "cache_source"],
            registry=r,
        )
        self._generated = Counter("sglang:generation_tokens", "Generated tokens", labels, registry=r)
        self._requests = Counter("sglang:num_requests", "Requests", labels, registry=r)
        self._ttft = Histogram(
            "sglang:time_to_first_token_seconds", "TTFT", labels, buckets=_LATENCY_BUCKETS, registry=r
        )
        self._itl = Histogram("sglang:inter_token_latency_seconds", "ITL", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self._e2e = Histogram("sglang:e2e_request_latency_seconds", "E2E", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self._transfer_failed = Counter(
            "sglang:num_transfer_failed_reqs", "KV transfers that failed", labels, registry=r
        )
        self._kv_ms = Histogram(
            "sglang:kv_transfer_latency_ms",
            "KV transfer latency",
            labels,
            registry=r,
            buckets=(1, 5, 10, 50, 100, 500, 1000, 5000),
        )
        self._kv_speed = Gauge("sglang:kv_transfer_speed_gb_s", "Last KV transfer speed", labels, registry=r)
        self.model_name = model_name
        self._cached.labels(model_name, "device")  # a series at 0 from the start: rates over it need no first sight
        self._lock = threading.Lock()
        self._window: collections.deque[tuple[float, int]] = collections.deque()

    def requests_started(self, n: int) -> None:
        """Count ``n`` more requests (``sglang:num_requests``)."""
        self._requests.labels(self.model_name).inc(n)

    def observe_finished(self, req: Request) -> None:
        """Called on the scheduler thread when a request ends."""
        now = time.monotonic()
        m = self.model_name
        n = len(req.output_ids)
        self._prompt.labels(m).inc(len(req.input_ids))
        self._cached.labels(m, "device").inc(req.cached_tokens)
        self._generated.labels(m).inc(n)
        self._e2e.labels(m).observe(now - req.created)
        if req.first_token_at is not None:
            self._ttft.labels(m).observe(req.first_token_at - req.created)
            if n > 1:
                self._itl.labels(m).observe((now - req.first_token_at) / (n - 1))
        with self._lock:  # one append and the expired head dropped: O(1) each (a 20,000-prompt batch
            # aborted at once finishes 20,000 requests in one pass; a rebuilt list made that quadratic)
            window = self._window
            if n:
                window.append((now, n))
            while window and now - window[0][0] >= 10:
                window.popleft()

    def last_gen_throughput(self) -> float:
        """Output tokens per second over the requests that finished in the last 10 seconds (the span counted as at least
        one second); 0.0 when none did."""
        with self._lock:
            if not self._window:
                return 0.0
            span = max(time.monotonic() - self._window[0][0], 1.0)
            return sum(k for _, k in self._window) / span

    def transfer_failed(self) -> None:
        """Count one failed KV transfer (``sglang:num_transfer_failed_reqs``)."""
        self._transfer_failed.labels(self.model_name).inc()

    def kv_transferred(self, secs: float, nbytes: int) -> None:
        """Record one KV transfer of ``nbytes`` that took ``secs``: its latency, and its speed in GB/s when ``secs`` is
        positive."""
        self._kv_ms.labels(self.model_name).observe(secs * 1000)
        if secs > 0:
            self._kv_speed.labels(self.model_name).set(nbytes / secs / 1e9)

    def render(self, stats: dict[str, int]) -> bytes:
        """The Prometheus text exposition of every metric, after setting the gauges from ``stats`` (the engine's
        ``stats()``: running, queued and KV token counts)."""
        m = self.model_name
        self._running.labels(m).set(stats["num_running_reqs"])
        self._queued.labels(m).set(stats["num_queue_reqs"])
        self._prealloc.labels(m).set(stats.get("num_decode_prealloc_queue_reqs", 0))
        total = stats["kv_total_tokens"]
        self._usage.labels(m).set(stats["kv_used_tokens"] / total if total else 0.0)
        self._transfer.labels(m).set(stats.get("num_decode_transfer_queue_reqs", 0))
        self._bootstrap.labels(m).set(stats.get("num_prefill_prealloc_queue_reqs", 0))
        self._throughput.labels(m).set(self.last_gen_throughput())
        return generate_latest(self.registry)
