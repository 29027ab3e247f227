"""``/pdctl/hold``, ``/pdctl/release`` and ``/pdctl/weights``: a ``pdctl.weights`` transaction's
routes, thin adapters over its owner (``WeightUpdates``). RL frameworks reach the same owner
through SGLang's own control routes (pdctl.router.facade)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import aiohttp

from pdctl.refit import Hold, Release
from pdctl.router import errors
from pdctl.router.admission import Admission
from pdctl.router.fanout import call_all
from pdctl.router.jsonutil import json_object
from pdctl.router.reply import Reply, json_reply
from pdctl.router.server import Request, Routes
from pdctl.router.tasks import Tasks
from pdctl.router.updates.owner import Conflict, Driver, WeightUpdates
from pdctl.router.workers import WorkerRegistry
from pdctl.sglang import Endpoint


class HoldRoutes:
    """The routes of a ``pdctl.weights`` transaction (module docstring)."""

    def __init__(
        self,
        updates: WeightUpdates,
        registry: WorkerRegistry,
        admission: Admission,
        session: Callable[[], aiohttp.ClientSession | None],
        hold_state: Callable[[], dict[str, Any] | None] = lambda: None,
    ):
        """``session``: the router's client session (made when it starts); ``hold_state``: what
        holds new requests now, in words (``FleetHolder.state``, pdctl.router.transaction.holder)."""
        self.updates = updates
        self.registry = registry
        self.admission = admission
        self.session = session
        self.hold_state = hold_state
        self.tasks = Tasks()
        updates.on_lapse.append(self._lapsed)

    def add_routes(self, r: Routes) -> None:
        """Register ``POST /pdctl/hold``, ``POST /pdctl/release`` and ``GET /pdctl/weights`` on ``r``."""
        r.add("POST", "/pdctl/hold", self.hold)
        r.add("POST", "/pdctl/release", self.release)
        r.add("GET", "/pdctl/weights", self.weights_state)

    async def stop(self) -> None:
        """Cancel the tasks these routes started and wait for them to end."""
        await self.tasks.stop()

    async def hold(self, request: Request) -> Reply:
        """Stop admitting requests; in ``drain`` mode also wait for in-flight ones to finish
        (they are not failed), in ``interrupt`` mode answer at once (the transaction then
        aborts them on the engines, and the router continues them after the release).

        A weight push sends ``txn``, ``engines`` and ``lease_secs`` and repeats the call to renew
        the lease; a push that stops renewing (its trainer died) is treated as failed: its
        engines leave rotation (their weights may be partial) and requests are admitted again.
        The body is a ``pdctl.refit.Hold``.
        """
        hold = _parsed(request, Hold.from_json)
        if isinstance(hold, Reply):
            return hold
        admission = self.admission
        try:
            answer, ready = await self.updates.hold(hold, idle=admission.idle, in_flight=admission.in_flight)
        except Conflict as exc:
            return errors.error_response(409, errors.BAD_REQUEST, str(exc))
        return json_reply(answer.to_json(), 200 if ready else 504)

    async def release(self, request: Request) -> Reply:
        """Re-read every worker's health and weight version, then admit requests again.

        ``complete`` lists engines that hold the pushed version (back into rotation);
        ``failed`` maps engines that do not to why (out of rotation until a later push).
        """
        release = _parsed(request, Release.from_json)
        if isinstance(release, Reply):
            return release
        try:
            await self.updates.release(release, self.session())
        except Conflict as exc:
            return errors.error_response(409, errors.BAD_REQUEST, str(exc))
        return json_reply({"held": False, "workers": [w.to_dict() for w in self.registry.workers.values()]})

    async def weights_state(self, _: Request) -> Reply:
        """The latest weight transaction (group, version, outcome) and each worker's version."""
        keys = ("url", "worker_type", "is_healthy", "weight_version", "quarantined", "cordoned", "circuit_open")
        workers = [{k: w.to_dict()[k] for k in keys} for w in self.registry.workers.values()]
        last = self.updates.last
        return json_reply(
            {
                "held": self.updates.holder is not None,
                "holder": self.updates.holder,
                "holder_driver": self.updates.holder_driver,
                "hold": self.hold_state(),
                "last_push": None if last is None else last.to_json(),
                "workers": workers,
                "quarantine": dict(self.registry.quarantine),
            }
        )

    def _lapsed(self, txn: str | None, moved: bool, engines: tuple[str, ...], driver: Driver) -> None:
        """A pdctl transaction's lease ran out (its trainer or ``pdctl weights load`` is gone): the
        engines it paused are continued, so that none stays paused (the facade continues its own)."""
        session = self.session()
        if driver is not Driver.PDCTL or not engines or session is None:
            return
        workers = [self.registry.workers[url] for url in engines if url in self.registry.workers]
        self.tasks.spawn(call_all(session, workers, "POST", Endpoint.CONTINUE_GENERATION.value, {}))


T = TypeVar("T")


def _parsed(request: Request, parse: Callable[[dict[str, Any]], T]) -> T | Reply:
    """The body as ``parse`` reads it (``Hold.from_json``, ...), or the 400 that says why not."""
    raw, problem = json_object(request.body)
    try:
        if problem is not None:
            raise ValueError(problem)
        return parse(raw)
    except ValueError as exc:
        what = parse.__qualname__.split(".")[0].lower()
        return errors.error_response(400, errors.BAD_REQUEST, f"bad {what}: {exc}")
