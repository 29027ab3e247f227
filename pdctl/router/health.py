"""Health checks: the loops that watch the router's workers. The health loop checks every worker
(SGLang's ``/health``, then ``/model_info`` for its weight version) at ``interval_secs``, faster
while one is starting or out of rotation; the liveness loop probes the workers in rotation
(``/model_info``) between checks, to find a process gone or hung before requests do. What a
check's outcome does to a worker is the registry's (``observe_health``, ``lost``, ``hung``);
a changed weight version goes through the version rule (pdctl.router.versions).

Both loops cost the router the same per request whatever the fleet's size (issue 59.3): the
health loop begins at most ``CHECKS_PER_SEC`` checks a second on average (a bucket that fills
between rounds, so a round that is due gets its whole budget), each in a task of its own (a
worker that times out holds up no other), at most ``CHECKS_IN_FLIGHT`` at once; the liveness
loop probes at most ``PROBES_PER_SEC`` workers a round. A fleet within the rates (160
workers at the default 10 s interval, 160 starting at once, 64 for liveness) is checked as it
always was; in a larger one each worker in rotation is checked every N/16 s (64 s at 1024
workers; sglang-router checks every 60 s), the liveness loop probes only workers that answered
nothing (a request or a probe) for an interval, silent ones first while a silence can make one
hung, then the longest unprobed. A worker that keeps answering requests is not probed there: a
process that restarted between two of its requests is found by its refused requests or by its
next health check. ``check_all`` (the router's start, an update's end) checks every worker at once."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import aiohttp

from pdctl.router.config import RouterConfig
from pdctl.router.versions import VersionRule
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang import Endpoint

log = logging.getLogger("pdctl.router")

PROBES_AT_ONCE = 64
"""Most liveness probes of a round in flight at once."""
CHECKS_IN_FLIGHT = 256
"""Most health checks in flight at once (each in a task of its own, ended by its own timeout, so
a worker that does not answer holds up no other worker's check): a round selects no more beyond
it, workers starting or out of rotation first, so a partition cannot open a connection per worker."""
CHECKS_PER_SEC = 16
"""Health checks (``/health``, then ``/model_info``) of workers in rotation begun per second, on
average; the budget fills up to ``interval_secs`` of it between rounds."""
URGENT_CHECKS_PER_SEC = 320
"""The same for workers starting or out of rotation, checked at the fast interval and first (160
a round at the default 0.5 s: a fleet starting at once is checked whole at every round up to that)."""
PROBES_PER_SEC = 64
"""Liveness probes a round may send: this many a second of the interval, and at least this many."""

T = TypeVar("T")
R = TypeVar("R")


class HealthChecks:
    """The health and liveness loops over the registry's workers (module docstring). What a check finds is handed to the
    registry and, for a changed weight version, to the version rule."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, versions: VersionRule):
        self.config = config
        self.registry = registry
        self.versions = versions
        self._task: asyncio.Task | None = None
        self._liveness: asyncio.Task | None = None
        self._checking: dict[Worker, asyncio.Task] = {}
        """Health checks in flight, by worker (each in a task: a slow one holds no round)."""
        self._last_round = time.monotonic()
        self._budget = float(CHECKS_PER_SEC * config.health.interval_secs)
        """Checks of workers in rotation the loop may begin now (``_due``)."""

    def start(self, session: aiohttp.ClientSession) -> None:
        """Start the health loop, and the liveness loop when ``liveness_interval_secs`` is set, on ``session``; nothing
        with health checks off."""
        if not self.config.health.disabled:
            self._task = asyncio.create_task(self._health_loop(session), name="pdctl-router-health")
            if self.config.health.liveness_interval_secs > 0:
                self._liveness = asyncio.create_task(self._liveness_loop(session), name="pdctl-router-liveness")

    async def stop(self) -> None:
        """Stop the loops, and the loads of the fleet's weights they started."""
        for task in (self._task, self._liveness, *self._checking.values()):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._checking.clear()
        await self.versions.stop()

    async def _liveness_loop(self, session: aiohttp.ClientSession) -> None:
        """Each worker in rotation, every ``liveness_interval_secs``: its ``/model_info`` (no
        generation, unlike ``/health``). A refused connection means its process is gone (a crash,
        a restart): it leaves rotation at once rather than after ``failure_threshold`` health
        checks. A changed weight version outside an update means a new process (one that
        restarted between two probes): the version rule applies at once. A worker that answers
        none of its probes for ``liveness_timeout_secs`` is hung. In a fleet larger than
        ``PROBES_PER_SEC`` allows, only workers that answered nothing for an interval are probed
        (``_to_probe``)."""
        interval = self.config.health.liveness_interval_secs
        while True:
            await asyncio.sleep(interval)
            await self.liveness_round(session, interval)

    async def liveness_round(self, session: aiohttp.ClientSession, interval: float) -> None:
        """One round of the liveness loop (``interval``: its period, and each probe's limit)."""
        sent = time.monotonic()
        live = self._to_probe(sent, interval)
        for worker in live:
            worker.probed_at = sent
        relabels = self.registry.relabels
        results = await _each(live, lambda w: _model_info(session, w, interval))
        stale = self.registry.relabels != relabels  # an update relabelled engines meanwhile
        now = time.monotonic()
        hung_after = self.config.health.liveness_timeout_secs
        for worker, info in zip(live, results, strict=True):
            if info is _SILENT:
                # Silent since its answer before this probe, or an interval before it (a large
                # fleet probes a worker seldom: its last answer may be long past).
                worker.silent_since = worker.silent_since or max(worker.last_answer, sent - interval)
                if hung_after and worker.healthy and now - worker.silent_since >= hung_after:
                    self.registry.hung(worker, now - worker.silent_since)
                continue
            worker.last_answer, worker.silent_since = now, 0.0
            if info is _REFUSED and worker.healthy:
                self.registry.lost(worker, "its port refuses connections")
            elif not stale and isinstance(info, dict) and info.get("weight_version") != worker.weight_version:
                worker.weight_version = info.get("weight_version")
                if not self.registry.updating:
                    self.versions.apply(session, worker)
                self.registry.rotation_changed()

    def _to_probe(self, now: float, interval: float) -> list[Worker]:
        """The workers a liveness round probes: every worker in rotation, or, in a fleet larger
        than the round's budget, those that answered nothing (a request or a probe) for an
        interval: the silent ones first while a silence can make a worker hung (it then leaves
        rotation), then the longest unprobed."""
        live = [w for w in self.registry.workers.values() if w.healthy]
        budget = max(PROBES_PER_SEC, math.ceil(PROBES_PER_SEC * interval))
        if len(live) <= budget:
            return live
        quiet = [w for w in live if w.silent_since or now - w.last_answer >= interval]
        if self.config.health.liveness_timeout_secs:
            quiet.sort(key=lambda w: (not w.silent_since, w.probed_at))
        else:  # no silence ends in "hung": silent workers take their turn with the others
            quiet.sort(key=lambda w: w.probed_at)
        return quiet[:budget]

    async def _health_loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            for worker in self._due(time.monotonic()):
                task = asyncio.ensure_future(self.check(session, worker))
                self._checking[worker] = task
                task.add_done_callback(functools.partial(self._checked, worker))
            wait = self._wait(time.monotonic())
            # A worker lost from here on wakes the loop (then checked at the fast interval).
            self.registry.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.registry.wake.wait(), wait)

    def _checked(self, worker: Worker, _: asyncio.Future) -> None:
        self._checking.pop(worker, None)

    def _period(self) -> float:
        """Seconds between two checks of a worker in rotation: ``interval_secs``, or longer in a
        fleet too large to check at that interval within ``CHECKS_PER_SEC``."""
        return max(self.config.health.interval_secs, len(self.registry.workers) / CHECKS_PER_SEC)

    def _due(self, now: float) -> list[Worker]:
        """The workers to check now (stamped ``checked_at``), none whose check is in flight, at
        most ``CHECKS_IN_FLIGHT`` in flight: those not up yet (engines starting) or out of
        rotation (a restarted engine is back as soon as it answers) first, up to
        ``URGENT_CHECKS_PER_SEC``; then those in rotation unchecked for a period, the longest
        unchecked first, as far as the budget goes."""
        c = self.config.health
        fast = min(c.startup_interval_secs, c.interval_secs)
        since, self._last_round = now - self._last_round, now
        # A fleet checked whole each interval keeps its interval's budget (all due together are
        # checked together); a larger one gets a second's at most: a steady rate, no bursts.
        whole = CHECKS_PER_SEC * c.interval_secs
        cap = whole if len(self.registry.workers) <= whole else CHECKS_PER_SEC
        self._budget = min(cap, self._budget + CHECKS_PER_SEC * since)
        room = CHECKS_IN_FLIGHT - len(self._checking)
        workers = [w for w in self.registry.workers.values() if w not in self._checking]
        urgent = sorted((w for w in workers if not (w.activated and w.healthy)), key=lambda w: w.checked_at)
        urgent = urgent[: min(room, math.ceil(URGENT_CHECKS_PER_SEC * max(since, fast)))]
        period = self._period()
        routine = sorted(
            (w for w in workers if w.activated and w.healthy and now - w.checked_at >= period),
            key=lambda w: w.checked_at,
        )
        routine = routine[: max(0, min(room - len(urgent), int(self._budget)))]
        self._budget -= len(routine)
        for worker in (*urgent, *routine):
            worker.checked_at = now
        return urgent + routine

    def _wait(self, now: float) -> float:
        """Seconds until the next round: the fast interval while some worker is not up or out of
        rotation, else until the next worker in rotation is due (at most ``interval_secs``), or
        until the budget has room for the next check."""
        c = self.config.health
        workers = list(self.registry.workers.values())
        if any(not (w.activated and w.healthy) for w in workers):
            return min(c.startup_interval_secs, c.interval_secs)
        if not workers:
            return c.interval_secs
        next_due = min(w.checked_at for w in workers) + self._period()
        # A fleet checked whole each interval waits for its next due worker; a larger one, whose
        # workers come due one after another, takes them a second's budget at a time (a round
        # reads every worker: 16 rounds a second cost more than its checks).
        soonest = 1.0 / CHECKS_PER_SEC if len(workers) <= CHECKS_PER_SEC * c.interval_secs else 1.0
        return min(c.interval_secs, max(next_due - now, soonest))

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        """Check every worker now, all at once (the router's start, the end of an update, whose
        release waits for it: no rate)."""
        workers = list(self.registry.workers.values())
        now = time.monotonic()
        for worker in workers:
            worker.checked_at = now
        await asyncio.gather(*(self.check(session, w) for w in workers))

    async def check(self, session: aiohttp.ClientSession, worker: Worker) -> None:
        """One health check of ``worker``. Whatever goes wrong stays inside this worker's check
        (a failed check): one bad worker must not stop the health loop or a release."""
        try:
            await self._check(session, worker)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("health check of %s failed: %s: %s", worker.url, type(exc).__name__, exc)
            self.registry.observe_health(worker, False)

    async def _check(self, session: aiohttp.ClientSession, worker: Worker) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health.timeout_secs)
        ok = False
        # While a weight update holds the fleet its engines are paused, and SGLang's /health (a
        # one-token generation) cannot pass: an engine that answers /model_info is alive then. A
        # healthy engine cordoned (a switch's or a restart's drain) is asked /model_info too: a
        # generation of ours there as its switch is asked makes SGLang refuse the flip ("not idle";
        # seen: `pdctl restart`'s capture refused in CI). One out of rotation for its health still
        # earns its way back with a generation.
        light = self.registry.updating or (worker.cordoned is not None and worker.healthy)
        probe = Endpoint.MODEL_INFO if light else Endpoint.HEALTH
        try:
            async with session.get(worker.url + probe.value, timeout=timeout, headers=worker.auth) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            ok = False
        if ok:  # the version is extra: a worker without a JSON /model_info is still healthy
            held = worker.weight_version
            relabels = self.registry.relabels
            try:
                async with session.get(
                    worker.url + Endpoint.MODEL_INFO.value, timeout=timeout, headers=worker.auth
                ) as resp:
                    info = await resp.json(content_type=None) if resp.status == 200 else None
                if isinstance(info, dict) and self.registry.relabels == relabels:  # else it may predate a label
                    worker.weight_version = info.get("weight_version")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                pass
            if worker.weight_version != held or not worker.healthy or self.versions.owed(worker):
                self.versions.apply(session, worker, came_back=not worker.healthy)
            if worker.weight_version != held:
                self.registry.rotation_changed()
        self.registry.observe_health(worker, ok)


async def _each(items: Sequence[T], call: Callable[[T], Awaitable[R]]) -> list[R]:
    """``call`` on every item, at most ``PROBES_AT_ONCE`` at a time; the results in order."""
    if not items:
        return []
    limit = asyncio.Semaphore(PROBES_AT_ONCE)

    async def one(item: T) -> R:
        async with limit:
            return await call(item)

    return await asyncio.gather(*(one(item) for item in items))


_REFUSED = object()
_SILENT = object()


async def _model_info(session: aiohttp.ClientSession, worker: Worker, timeout: float) -> object:
    """A worker's ``/model_info`` (a dict), ``_REFUSED`` when nothing listens on its port,
    ``_SILENT`` when no answer came in time (or the connection broke before one), or None when it
    answered but not with JSON."""
    try:
        async with session.get(
            worker.url + Endpoint.MODEL_INFO.value, timeout=aiohttp.ClientTimeout(total=timeout), headers=worker.auth
        ) as resp:
            try:
                info = await resp.json(content_type=None) if resp.status == 200 else None
            except ValueError:
                return None
    except aiohttp.ClientConnectorError as exc:
        return _REFUSED if isinstance(exc.os_error, ConnectionRefusedError) else _SILENT
    except asyncio.CancelledError:
        raise
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
        return _SILENT
    except Exception:  # (a URL that cannot even be requested is no answer either)
        return _SILENT
    return info if isinstance(info, dict) else None
