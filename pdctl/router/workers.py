"""Workers, their health, load, circuit breaker and weight version; the registry owns them.

A worker is routable when it is healthy, its circuit is not open, and (for PD) it is on
the weight version being paired. The health loop runs in app startup and is cancelled in
cleanup; it logs only when a worker's state changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import aiohttp

from pdctl.roles import Role, engine_role
from pdctl.router.config import RouterConfig
from pdctl.sglang import Endpoint

log = logging.getLogger("pdctl.router")


@dataclass(eq=False)
class Worker:
    url: str
    role: Role
    bootstrap_port: int | None = None
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    healthy: bool = False
    """A worker enters rotation at its first passed health check (then thresholds apply)."""
    activated: bool = False
    load: int = 0
    weight_version: str | None = None
    registered_at: float = field(default_factory=time.monotonic)
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # circuit breaker
    cb_failures: int = 0
    cb_successes: int = 0
    cb_open_until: float = 0.0
    cb_half_open: bool = False
    cb_window_start: float = 0.0
    quarantined: str | None = None
    """Why the worker is out of rotation for its weights (a weight push it did not complete)."""

    @functools.cached_property
    def bootstrap_host(self) -> str:
        """The prefill's host as the decode reaches it: the URL's host, IPv6 in brackets."""
        host = urlsplit(self.url).hostname or ""
        return f"[{host}]" if ":" in host else host

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "url": self.url,
            "worker_type": self.role,
            "is_healthy": self.healthy,
            "activated": self.activated,
            "load": self.load,
            "bootstrap_port": self.bootstrap_port,
            "weight_version": self.weight_version,
            "circuit_open": self.cb_open_until > time.monotonic(),
            "quarantined": self.quarantined,
            "connection_mode": "HTTP",
        }


class LoadGuard:
    """``with LoadGuard(worker):`` counts one request in ``worker.load`` until the block ends,
    however it ends (smg's WorkerLoadGuard). A class rather than a @contextmanager: it is entered
    two or three times per request, and a generator-based one costs about twice as much."""

    __slots__ = ("worker",)

    def __init__(self, worker: Worker):
        self.worker = worker

    def __enter__(self) -> None:
        self.worker.load += 1

    def __exit__(self, *exc: object) -> None:
        self.worker.load -= 1


class WorkerRegistry:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.workers: dict[str, Worker] = {}
        self._task: asyncio.Task | None = None
        self.on_change: list = []
        self.quarantine: dict[str, str] = {}
        """URL -> reason: workers whose weights a push left partial or stale (kept for workers re-added later)."""

    # -- membership --------------------------------------------------------------------------
    def add(self, url: str, role: object, bootstrap_port: int | None = None, *, healthy: bool = False) -> Worker:
        """Register a worker; ValueError for a role that is not an engine's (from a client's body)."""
        role = engine_role(role)
        url = url.rstrip("/")
        if url in self.workers:
            raise ValueError(f"worker {url} is already registered")
        worker = Worker(url=url, role=role, bootstrap_port=bootstrap_port, healthy=healthy, activated=healthy)
        worker.quarantined = self.quarantine.get(url)
        self.workers[url] = worker
        log.info("registered %s worker %s", role, url)
        return worker

    def find(self, key: str) -> Worker | None:
        """A worker by id or URL (percent-encoded or not)."""
        key = unquote(key).rstrip("/")
        return next((w for url, w in self.workers.items() if key in (w.id, url)), None)

    def remove(self, key: str) -> Worker | None:
        worker = self.find(key)
        if worker is not None:
            del self.workers[worker.url]
            log.info("removed %s worker %s", worker.role, worker.url)
        return worker

    def of_role(self, role: Role) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role]

    def set_quarantine(self, url: str, reason: str | None) -> None:
        """Take a worker out of rotation for its weights (``reason``), or back in (None)."""
        url = url.rstrip("/")
        if reason is None:
            self.quarantine.pop(url, None)
        else:
            self.quarantine[url] = reason
        worker = self.workers.get(url)
        if worker is not None and worker.quarantined != reason:
            worker.quarantined = reason
            if reason is None:
                log.info("worker %s is back in rotation (it holds the pushed weights)", url)
            else:
                log.warning("worker %s is out of rotation: %s", url, reason)

    def routable(self, role: Role) -> list[Worker]:
        now = time.monotonic()
        out = []
        for w in self.workers.values():
            if w.role != role or not w.healthy or w.quarantined:
                continue
            if not self.config.breaker.disabled and w.cb_open_until > now:
                continue
            out.append(w)
        return out

    # -- outcomes ----------------------------------------------------------------------------------
    def in_flight(self, worker: Worker) -> LoadGuard:
        """Count a request in ``worker``'s load for the duration: the one place load changes."""
        return LoadGuard(worker)

    def record(self, worker: Worker, ok: bool) -> None:
        """Circuit breaker bookkeeping for an answer that says whether ``worker`` works (a 4xx is
        the client's fault and counts as ok; backpressure, 429/503 from a live worker, is not
        recorded at all).

        One state, read the same way by selection, ``/workers`` and the log: open while
        ``cb_open_until`` is ahead; then half-open, when only trial requests' outcomes count
        (answers to requests sent before the circuit opened neither close nor extend it)."""
        if self.config.breaker.disabled:
            return
        now = time.monotonic()
        if worker.cb_open_until > now:
            return  # open: late answers of requests sent before it opened change nothing
        if ok:
            worker.cb_failures = 0
            if worker.cb_half_open:
                worker.cb_successes += 1
                if worker.cb_successes >= self.config.breaker.success_threshold:
                    worker.cb_half_open = False
                    worker.cb_open_until = 0.0
                    log.info("circuit closed for %s", worker.url)
            return
        worker.cb_successes = 0
        if now - worker.cb_window_start > self.config.breaker.window_duration_secs:
            worker.cb_failures, worker.cb_window_start = 0, now  # older failures are forgotten
        worker.cb_failures += 1
        if worker.cb_half_open or worker.cb_failures >= self.config.breaker.failure_threshold:
            worker.cb_open_until = now + self.config.breaker.timeout_duration_secs
            worker.cb_half_open = True  # after the timeout, trial requests decide
            worker.cb_failures = 0
            log.warning("circuit opened for %s for %.0fs", worker.url, self.config.breaker.timeout_duration_secs)

    # -- health -----------------------------------------------------------------------------------
    def start(self, session: aiohttp.ClientSession) -> None:
        if not self.config.health.disabled:
            self._task = asyncio.create_task(self._health_loop(session), name="pdctl-router-health")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _health_loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            # Poll fast while some worker has never answered (engines still starting).
            waiting = any(not w.activated for w in self.workers.values())
            c = self.config
            await asyncio.sleep(
                min(c.health.startup_interval_secs, c.health.interval_secs) if waiting else c.health.interval_secs
            )
            await self.check_all(session)

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        workers = list(self.workers.values())
        if workers:
            await asyncio.gather(*(self.check(session, w) for w in workers))

    async def check(self, session: aiohttp.ClientSession, worker: Worker) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health.timeout_secs)
        ok = False
        try:
            async with session.get(worker.url + Endpoint.HEALTH.value, timeout=timeout) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            ok = False
        if ok:  # the version is extra: a worker without a JSON /model_info is still healthy
            try:
                async with session.get(worker.url + Endpoint.MODEL_INFO.value, timeout=timeout) as resp:
                    info = await resp.json(content_type=None) if resp.status == 200 else None
                if isinstance(info, dict):
                    worker.weight_version = info.get("weight_version")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                pass
        self.observe_health(worker, ok)

    def observe_health(self, worker: Worker, ok: bool) -> None:
        c = self.config
        if c.health.disabled:
            return  # always in rotation: nothing would bring it back
        if ok:
            worker.consecutive_failures = 0
            worker.consecutive_successes += 1
            if not worker.activated:
                worker.activated = worker.healthy = True
                log.info("worker %s is up (%s, weight version %s)", worker.url, worker.role, worker.weight_version)
            elif not worker.healthy and worker.consecutive_successes >= c.health.success_threshold:
                worker.healthy = True
                log.info("worker %s is healthy again", worker.url)
            return
        if not worker.activated or time.monotonic() - worker.registered_at < c.health.first_wait_secs:
            return  # still starting, or in the cold-start grace: compiling engines answer late
        worker.consecutive_successes = 0
        worker.consecutive_failures += 1
        if worker.healthy and worker.consecutive_failures >= c.health.failure_threshold:
            worker.healthy = False
            log.warning("worker %s is unhealthy (%d failed checks)", worker.url, worker.consecutive_failures)

    def mark_failed(self, worker: Worker) -> None:
        """A request could not even connect: count it as a failed health check at once."""
        self.observe_health(worker, False)
