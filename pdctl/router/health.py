"""Health checks: the loops that watch the router's workers. The health loop checks every worker
(SGLang's ``/health``, then ``/model_info`` for its weight version) at ``interval_secs``, faster
while one is starting or out of rotation; the liveness loop probes the workers in rotation
(``/model_info``) between checks, to find a process gone or hung before requests do. What a
check's outcome does to a worker is the registry's (``observe_health``, ``lost``, ``hung``);
a changed weight version goes through the version rule (pdctl.router.versions)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp

from pdctl.router.config import RouterConfig
from pdctl.router.versions import VersionRule
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang import Endpoint

log = logging.getLogger("pdctl.router")


class HealthChecks:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, versions: VersionRule):
        self.config = config
        self.registry = registry
        self.versions = versions
        self._task: asyncio.Task | None = None
        self._liveness: asyncio.Task | None = None

    def start(self, session: aiohttp.ClientSession) -> None:
        if not self.config.health.disabled:
            self._task = asyncio.create_task(self._health_loop(session), name="pdctl-router-health")
            if self.config.health.liveness_interval_secs > 0:
                self._liveness = asyncio.create_task(self._liveness_loop(session), name="pdctl-router-liveness")

    async def stop(self) -> None:
        """Stop the loops, and the loads of the fleet's weights they started."""
        for task in (self._task, self._liveness):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.versions.stop()

    async def _liveness_loop(self, session: aiohttp.ClientSession) -> None:
        """Each worker in rotation, every ``liveness_interval_secs``: its ``/model_info`` (no
        generation, unlike ``/health``). A refused connection means its process is gone (a crash,
        a restart): it leaves rotation at once rather than after ``failure_threshold`` health
        checks. A changed weight version outside an update means a new process (one that
        restarted between two probes): the version rule applies at once. A slow or silent
        worker is left to the health checks' thresholds."""
        interval = self.config.health.liveness_interval_secs
        while True:
            await asyncio.sleep(interval)
            live = [w for w in self.registry.workers.values() if w.healthy]
            relabels = self.registry.relabels
            results = await asyncio.gather(*(_model_info(session, w, interval) for w in live))
            stale = self.registry.relabels != relabels  # an update relabelled engines meanwhile
            now = time.monotonic()
            hung_after = self.config.health.liveness_timeout_secs
            for worker, info in zip(live, results, strict=True):
                if info is _SILENT:
                    if hung_after and worker.healthy and now - worker.last_answer >= hung_after:
                        self.registry.hung(worker, now - worker.last_answer)
                    continue
                worker.last_answer = now
                if info is _REFUSED and worker.healthy:
                    self.registry.lost(worker, "its port refuses connections")
                elif not stale and isinstance(info, dict) and info.get("weight_version") != worker.weight_version:
                    worker.weight_version = info.get("weight_version")
                    if not self.registry.updating:
                        self.versions.apply(session, worker)
                    self.registry.rotation_changed()

    async def _health_loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            # Poll fast while some worker has never answered (engines still starting) or is out of
            # rotation (a restarted engine is back as soon as it answers); a worker lost in the
            # meantime wakes the loop.
            waiting = any(not w.activated or not w.healthy for w in self.registry.workers.values())
            c = self.config
            interval = (
                min(c.health.startup_interval_secs, c.health.interval_secs) if waiting else c.health.interval_secs
            )
            self.registry.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.registry.wake.wait(), interval)
            await self.check_all(session)

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        workers = list(self.registry.workers.values())
        if workers:
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
        # one-token generation) cannot pass: an engine that answers /model_info is alive then.
        probe = Endpoint.MODEL_INFO if self.registry.updating else Endpoint.HEALTH
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
