"""The fleet's weight version as the rule for (re)joining rotation: a worker that comes back, or
whose version changed outside an update, stays out (quarantined as stale) unless it holds the
version the last update left the fleet on; when that version came from a checkpoint on disk,
the router loads it into the worker itself, which then comes back."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

import aiohttp

from pdctl.refit import in_flux
from pdctl.router.config import RouterConfig
from pdctl.router.fleet_weights import STALE, FleetWeights
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang import Endpoint

log = logging.getLogger("pdctl.router")


class VersionRule:
    """The fleet's weight-version rule for workers (pdctl.router.fleet_weights): a worker off the fleet's version stays
    out of rotation, and the router loads the fleet's checkpoint into it when the version came from disk."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry):
        self.config = config
        self.registry = registry

    def apply(self, session: aiohttp.ClientSession, worker: Worker, *, came_back: bool = False) -> None:
        """Keep ``worker`` (``came_back``: restarted, or its version changed outside an update)
        out of rotation unless it holds the fleet's version; load that version into it when it
        came from disk.

        While an update holds the fleet, versions move by the update's own hand: only a worker
        that comes back then (its boot weights) is kept out, and nothing is loaded into it; the
        release decides (complete: in; missed: loaded, or out until the next push). A drain lets
        retries through the closed gate, and one must not pair a restarted prefill's boot weights
        with a decode on the fleet's."""
        fleet = self.registry.fleet
        if self.registry.updating:
            if came_back and fleet is not None and worker.weight_version != fleet.version and not worker.quarantined:
                self.registry.set_quarantine(worker.url, fleet.stale_reason(worker.weight_version, updating=True))
            return
        stale = worker.quarantined is not None and worker.quarantined.startswith(STALE)
        held = worker.weight_version
        # A pdctl: label (weights moving or left half done) is never a version to serve, fleet or not.
        if not in_flux(held) and (fleet is None or held == fleet.version):
            if stale:
                self.registry.set_quarantine(worker.url, None)
            return
        if worker.quarantined is None or stale:
            reason = fleet.stale_reason(held) if fleet is not None else FleetWeights.flux_reason(held)
            self.registry.set_quarantine(worker.url, reason)
        if fleet is not None and fleet.source and worker.url not in self.registry.loading:
            task = asyncio.create_task(self._load(session, worker, fleet), name=f"pdctl-router-load {worker.url}")
            self.registry.loading[worker.url] = task
            task.add_done_callback(functools.partial(self._loaded, worker.url))

    def owed(self, worker: Worker) -> bool:
        """Out of rotation on stale weights that the router loads, with no load under way (the
        last one failed, or an update kept it out): its next check tries again."""
        return (
            worker.url not in self.registry.loading
            and worker.quarantined is not None
            and worker.quarantined.startswith(STALE)
            and not self.registry.updating
        )

    def _loaded(self, url: str, _task: asyncio.Task) -> None:
        self.registry.loading.pop(url, None)

    async def _load(self, session: aiohttp.ClientSession, worker: Worker, fleet: FleetWeights) -> None:
        """``/update_weights_from_disk`` of the fleet's checkpoint into a stale worker (out of
        rotation meanwhile); back in rotation once it holds the version."""
        log.info("worker %s holds %r: loading %s (%s)", worker.url, worker.weight_version, fleet.source, fleet.version)
        body = {"model_path": fleet.source, "weight_version": fleet.version}
        timeout = aiohttp.ClientTimeout(total=self.config.admission.request_timeout_secs)
        try:
            async with session.post(
                worker.url + Endpoint.UPDATE_WEIGHTS_FROM_DISK.value, json=body, timeout=timeout, headers=worker.auth
            ) as r:
                answer = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            answer = None
            log.warning("worker %s: loading %s failed: %s", worker.url, fleet.source, exc)
        if not (isinstance(answer, dict) and answer.get("success")):
            log.warning(
                "worker %s did not load %s: %s (tried again at its next check)", worker.url, fleet.source, answer
            )
            return
        if self.registry.fleet == fleet and not self.registry.updating:
            worker.weight_version = fleet.version
            self.registry.set_quarantine(worker.url, None)

    async def stop(self) -> None:
        """Cancel the loads of the fleet's weights under way and wait for them to end."""
        for task in list(self.registry.loading.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
