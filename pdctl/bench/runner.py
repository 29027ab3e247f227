"""Drive a workload at one or more load points and collect what client and servers saw.

A load point is an arrival process (Poisson at ``request_rate`` per second, or all at once
for ``inf``) capped by ``max_concurrency`` requests in flight (closed loop). Arrival times
are drawn from the seed, so two runs offer the same load. Warm-up requests run first and
are not measured. Optional: the servers' ``/metrics`` sampled every second (the server
view), and a weight reload every N seconds whose windows the report sets against the rest.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from pdctl.bench.client import RequestResult, send
from pdctl.bench.metrics import Slo, refit_stall, summarize, windows_split
from pdctl.bench.server_view import ServerView
from pdctl.bench.workloads import BenchRequest
from pdctl.errors import PdctlError


class BenchError(PdctlError):
    """The benchmark could not run (unreachable server, bad load parameters)."""


@dataclass(frozen=True)
class LoadPoint:
    """One load level: Poisson arrivals at ``request_rate`` per second (inf: all at once), at most
    ``max_concurrency`` in flight (None: no cap)."""

    request_rate: float = math.inf
    max_concurrency: int | None = None

    def label(self) -> str:
        """A short text for reports and progress: ``rate=... concurrency=...``."""
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        return f"rate={rate} concurrency={self.max_concurrency or 'unbounded'}"


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: the server, the requests, the load points, and what else to measure (server
    view, goodput SLO, weight reloads)."""

    url: str
    requests: tuple[BenchRequest, ...]
    points: tuple[LoadPoint, ...] = (LoadPoint(),)
    api: str = "generate"
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    warmup: int = 0
    seed: int = 0
    slo: Slo = field(default_factory=Slo)
    timeout_secs: float = 600.0
    metrics_urls: tuple[tuple[str, str], ...] = ()
    """(role, base URL) pairs whose /metrics make the server view."""
    reload_every_secs: float | None = None


Reloader = Callable[[int], Mapping[str, Any] | None]
"""Called with 1, 2, ... from a worker thread; loads weights and returns when done, with what it
knows of the update (``refit``, ``transfer_s``)."""
Progress = Callable[[str, int, int], None]
"""(point label, finished, total) after each request."""


def run_bench(config: BenchConfig, *, reloader: Reloader | None = None, progress: Progress | None = None) -> dict:
    """Run every load point in order; the JSON-ready report."""
    if not config.requests:
        raise BenchError("no requests to send (--num-prompts must be >= 1)")
    for point in config.points:
        if point.request_rate <= 0 or (point.max_concurrency is not None and point.max_concurrency < 1):
            raise BenchError(f"bad load point {point.label()}: rate must be > 0 and concurrency >= 1")
    if config.reload_every_secs is not None and reloader is None:
        raise BenchError("a weight reload needs a pdctl cluster (give NAME, not --url)")
    run = asyncio.run
    try:
        import uvloop  # the client must not be the bottleneck: uvloop's loop costs less per event

        run = uvloop.run
    except ImportError:
        pass
    return run(_run(config, reloader, progress or (lambda *_: None)))


async def _run(config: BenchConfig, reloader: Reloader | None, progress: Progress) -> dict:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        await _preflight(session, config.url)
        if config.api != "generate" and config.model is None:  # routers such as smg route by model id
            config = replace(config, model=await _served_model(session, config.url))
        if config.warmup:
            warm = [config.requests[i % len(config.requests)] for i in range(config.warmup)]
            await asyncio.gather(*(_send(session, config, r) for r in warm))
        runs = []
        for point in config.points:
            runs.append(await _run_point(session, config, point, reloader, progress))
    return {"url": config.url, "api": config.api, "num_prompts": len(config.requests), "runs": runs}


async def _preflight(session: aiohttp.ClientSession, url: str) -> None:
    """Any HTTP answer will do: this only tells an unreachable server from a failing one."""
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise BenchError(f"cannot reach {url}: {exc or type(exc).__name__}") from exc


async def _served_model(session: aiohttp.ClientSession, url: str) -> str | None:
    """The first model id of ``/v1/models``, or None when the server lists none."""
    try:
        async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            body = await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("id"):
        return str(data[0]["id"])
    return None


def _send(session: aiohttp.ClientSession, config: BenchConfig, req: BenchRequest):
    return send(session, config.url, config.api, req, model=config.model, timeout_secs=config.timeout_secs)


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of ``n`` requests is sent (Poisson, or all at 0)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _run_point(
    session: aiohttp.ClientSession,
    config: BenchConfig,
    point: LoadPoint,
    reloader: Reloader | None,
    progress: Progress,
) -> dict[str, Any]:
    label = point.label()
    total = len(config.requests)
    gate = asyncio.Semaphore(point.max_concurrency) if point.max_concurrency else None
    finished = 0

    async def one(req: BenchRequest) -> RequestResult:
        nonlocal finished
        if gate is None:
            result = await _send(session, config, req)
        else:
            async with gate:
                result = await _send(session, config, req)
        finished += 1
        progress(label, finished, total)
        return result

    view = ServerView(session, config.metrics_urls)
    reload = _Reloads(reloader, config.reload_every_secs) if reloader and config.reload_every_secs else None
    await view.start()
    if reload:
        reload.start()
    started = time.monotonic()
    tasks = []
    try:
        for req, offset in zip(config.requests, arrival_offsets(total, point.request_rate, config.seed), strict=True):
            delay = started + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(req)))
        results = list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        if reload:
            await asyncio.to_thread(reload.stop)
        server = await view.stop()
    run: dict[str, Any] = {
        "request_rate": point.request_rate if not math.isinf(point.request_rate) else "inf",
        "max_concurrency": point.max_concurrency,
        **summarize(results, config.slo),
        "requests": [_request_row(r, started) for r in results],
    }
    if server:
        run["server"] = server
    if reload:
        run["weight_reloads"] = reload.report(started)
        run["push_windows"] = windows_split(results, reload.windows)
        run["refit_stall"] = refit_stall(results, reload.windows, reload.updates)
    return run


def _request_row(r: RequestResult, t0: float) -> dict[str, Any]:
    """Per-request figures for plots and later analysis (no prompt text)."""
    return {
        "start_s": round(r.start - t0, 6),
        "ok": r.ok,
        "error": r.error,
        "ttft_ms": round(r.ttft * 1000, 3),
        "e2e_ms": round(r.e2e * 1000, 3),
        "input_len": r.input_len,
        "output_tokens": r.output_tokens,
        "weight_version": r.weight_version,
        **({"detail": r.detail} if r.detail else {}),
    }


class _Reloads:
    """Calls the reloader every ``every`` seconds on a thread; records each call's window."""

    def __init__(self, reloader: Reloader, every: float):
        self.reloader = reloader
        self.every = every
        self.windows: list[tuple[float, float]] = []
        self.updates: list[Mapping[str, Any]] = []
        """What the reloader said of each update that returned."""
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-reload", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        n = 0
        while not self._stop.wait(self.every):
            n += 1
            began = time.monotonic()
            try:
                self.updates.append(self.reloader(n) or {})
            except Exception as exc:  # reported, and the run goes on
                self.errors.append(f"reload {n}: {exc}")
            self.windows.append((began, time.monotonic()))

    def report(self, t0: float) -> dict[str, Any]:
        return {
            "count": len(self.windows),
            "windows_s": [[round(a - t0, 3), round(b - t0, 3)] for a, b in self.windows],
            "errors": self.errors,
        }


def parse_points(rates: Sequence[float], concurrencies: Sequence[int | None]) -> tuple[LoadPoint, ...]:
    """Every rate with every concurrency, rates outermost (a sweep is over one of them)."""
    return tuple(LoadPoint(r, c) for r in rates for c in concurrencies)
