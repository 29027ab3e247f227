"""The one owner of a weight update's life in the router: the gate it closes, the transaction that
holds it, that transaction's lease, and the push record (``PushRecord``) it leaves.

A transaction begins with a hold (``hold``): new requests wait at the gate, and in ``drain`` mode
the hold answers once those in flight have finished. It ends with ``release`` (the engines that
hold the new version go back into rotation, those that do not stay out until a later update) or
when its lease runs out (its driver is gone): then the engines it may have left half updated
leave rotation; a transaction that moved no weights (no push record: a framework's pause that
no update followed) just ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdctl.choices import Choice
from pdctl.refit import Hold, HoldAnswer, RefitMode, Release
from pdctl.router.fleet_weights import FleetWeights
from pdctl.router.gate import RefitGate
from pdctl.router.health import HealthChecks
from pdctl.router.metrics import RouterMetrics
from pdctl.router.workers import WorkerRegistry

log = logging.getLogger("pdctl.router")


class Conflict(Exception):
    """The call clashes with the transaction that holds the router (answered 409)."""


class PushState(Choice):
    """Where a weight update stands (``pdctl weights status``, ``pdctl top``)."""

    PUSHING = "pushing"
    COMPLETE = "complete"
    FAILED = "failed"
    ABANDONED = "abandoned (lease expired)"
    CANCELLED = "cancelled (no weights moved)"


class Driver(Choice):
    """Who drives an update: a ``pdctl.weights`` transaction (a trainer or ``pdctl weights load``)
    or an RL framework through SGLang's control routes (pdctl.router.facade)."""

    PDCTL = "pdctl"
    FRAMEWORK = "framework"


@dataclass
class PushRecord:
    """The latest weight update, for ``GET /pdctl/weights``."""

    txn: str
    version: str | None
    source: str | None
    """A load from disk's checkpoint path; None for a push."""
    refit: RefitMode
    group: Mapping[str, Any] | None
    driver: Driver = Driver.PDCTL
    state: PushState = PushState.PUSHING
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    complete: tuple[str, ...] = ()
    failed: dict[str, str] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        """Whether the update has ended (``ended_at`` is set)."""
        return self.ended_at is not None

    def to_json(self) -> dict[str, Any]:
        """The record as ``GET /pdctl/weights`` answers it; its outcome (complete, failed engines, phases, end) only
        once it has ended."""
        body: dict[str, Any] = {
            "txn": self.txn,
            "version": self.version,
            "source": self.source,
            "state": self.state.value,
            "refit": self.refit.value,
            "group": None if self.group is None else dict(self.group),
            "driver": self.driver.value,
            "started_at": self.started_at,
        }
        if self.ended:
            body.update(
                complete=list(self.complete),
                failed=dict(self.failed),
                phases=dict(self.phases),
                ended_at=self.ended_at,
            )
        return body


@dataclass
class _Holder:
    """The transaction holding the router (``txn`` None: a bare hold, from a test or an operator)."""

    txn: str | None
    engines: tuple[str, ...] = ()
    lease: asyncio.TimerHandle | None = None
    driver: Driver = Driver.PDCTL
    moved: bool = False
    """Weights have begun to move (its driver said so): only then may its engines be half updated."""
    ending: asyncio.Event | None = None
    """Set when its release has begun (every worker's health is read again before requests
    flow); the event is set when the gate opens."""


Lapsed = Callable[[str | None, bool, tuple[str, ...], Driver], bool | None]
"""Told when a transaction's lease ran out: its txn, whether weights had begun to move, its
engines (paused by it: someone must continue them) and its driver. A listener that answers True
ends the transaction itself (``release``, once its engines are fit to serve): the gate stays
closed until then."""


class WeightUpdates:
    """The one owner of a weight update's life in the router (module docstring): the gate it closes, the hold and its
    lease, and the latest push record (``last``). At most one transaction holds the router; a clashing call raises
    Conflict."""

    def __init__(self, registry: WorkerRegistry, health: HealthChecks, metrics: RouterMetrics, gate: RefitGate):
        """``health``: the router's health checks (a release re-reads every worker's health and
        version; a worker off the fleet's version meets the version rule)."""
        self.registry = registry
        self.health = health
        self.metrics = metrics
        self.gate = gate
        self.last: PushRecord | None = None
        """The latest update that moved weights (or began to)."""
        self._holder: _Holder | None = None
        self._held_at = 0.0
        self.on_lapse: list[Lapsed] = []

    @property
    def holder(self) -> str | None:
        """The txn of the transaction that holds the router, if one does and said which."""
        return self._holder.txn if self._holder is not None else None

    @property
    def holder_driver(self) -> Driver | None:
        """The driver of the transaction that holds the router; None when none does or the hold names no txn."""
        return self._holder.driver if self._holder is not None and self._holder.txn is not None else None

    def hold_state(self) -> dict[str, Any] | None:
        """While a hold keeps the gate closed: its txn, driver, since when (epoch seconds) and for
        how long; None while requests flow."""
        secs = self.held_secs()
        if secs is None:
            return None
        holder = self._holder
        return {
            "txn": holder.txn if holder is not None else None,
            "driver": holder.driver.value if holder is not None and holder.txn is not None else None,
            "ending": holder is not None and holder.ending is not None,
            "since": time.time() - secs,
            "secs": round(secs, 1),
        }

    def held_secs(self) -> float | None:
        """How long the current hold has kept the gate closed (None: it is open)."""
        return None if self.gate.is_open else time.monotonic() - self._held_at

    # -- hold -----------------------------------------------------------------------------------------
    async def hold(
        self,
        hold: Hold,
        *,
        idle: asyncio.Event,
        in_flight: Callable[[], int],
        record: bool = True,
        driver: Driver = Driver.PDCTL,
        wait: bool = True,
    ) -> tuple[HoldAnswer, bool]:
        """Close the gate for ``hold``; in ``drain`` mode wait (``hold.timeout_secs``) until
        ``idle`` (nothing in flight), unless not ``wait`` (a framework's pause: the engines' own
        pause mode decides what happens to what is in flight). The answer, and whether it came in
        time. A hold with a
        txn (a new one, or its driver renewing it) starts or renews the lease; ``record``
        starts its push record. Raises Conflict when another transaction holds the router or
        this one has ended."""
        while self._holder is not None and self._holder.ending is not None:
            await self._holder.ending.wait()  # a release reading health: this hold follows it
        txn = hold.txn
        holder = self._holder
        new_transaction = txn is None or holder is None or holder.txn != txn
        if txn is not None:
            if holder is not None and holder.txn is not None and holder.txn != txn:
                raise Conflict(f"weight push {holder.txn} holds the router")
            last = self.last
            if last is not None and last.txn == txn and last.ended:  # a renewal that crossed the release
                raise Conflict(f"weight push {txn} has ended")
            if holder is None or holder.txn != txn:
                if holder is not None and holder.lease is not None:  # a bare hold becomes this transaction
                    holder.lease.cancel()
                holder = self._holder = _Holder(txn, driver=driver)
            holder.engines = tuple(hold.engines) or holder.engines
            holder.moved = holder.moved or hold.moved
            self.registry.updating = True
            if record and (last is None or last.txn != txn):
                self.start_record(txn, hold.version, hold.source, hold.refit, hold.group, driver)
            if holder.lease is not None:  # no lease runs while the driver waits in this call: it cannot renew
                holder.lease.cancel()
                holder.lease = None
        elif holder is None:
            holder = self._holder = _Holder(None)
        if self.gate.is_open:
            self._held_at = time.monotonic()
            log.info(
                "held for a weight update%s (%s); %d request(s) in flight",
                f" ({txn})" if txn else "",
                hold.refit.value,
                in_flight(),
            )
        self.gate.close(hold.refit, hold.max_staleness, new_transaction=new_transaction)
        # Requests waiting for a worker wake and wait at the gate instead, out of the count a
        # drain waits for (the worker they lack may be kept out until this hold's release).
        self.registry.rotation_changed()
        ready = True
        try:
            if hold.refit is RefitMode.DRAIN and wait:
                try:
                    await asyncio.wait_for(idle.wait(), max(hold.timeout_secs, 0.001))
                except asyncio.TimeoutError:
                    ready = False
        except asyncio.CancelledError:
            # Its driver went away before it was answered (Ctrl-C during the drain): it will
            # never renew nor release, and nothing moved: requests flow again at once.
            holder = self._holder
            if new_transaction and holder is not None and holder.txn == txn:
                self._end_unanswered(holder)
            raise
        finally:  # the lease starts when the answer goes out (a drain longer than the lease is no dead driver)
            holder = self._holder
            if holder is not None and holder.txn == txn and not self.gate.is_open:
                self.renew(holder, hold.lease_secs)
        return HoldAnswer(True, ready, in_flight(), hold.refit), ready

    def renew(self, holder: _Holder | str | None, lease_secs: float) -> None:
        """(Re)start the lease of the transaction that holds the router (given as its holder or txn)."""
        if not isinstance(holder, _Holder):
            if self._holder is None or self._holder.txn != holder:
                return
            holder = self._holder
        if holder.lease is not None:
            holder.lease.cancel()
        holder.lease = asyncio.get_running_loop().call_later(lease_secs, self._lapse, holder, lease_secs)

    def suspend(self, txn: str) -> None:
        """No lease runs for ``txn`` while its driver's call is being served (it cannot renew from
        inside one); ``renew`` restarts it when the call ends."""
        holder = self._holder
        if holder is not None and holder.txn == txn and holder.lease is not None:
            holder.lease.cancel()
            holder.lease = None

    def describe_group(self, txn: str, group: Mapping[str, Any]) -> None:
        """The weight group ``txn`` moves weights over, for its push record."""
        if self.last is not None and self.last.txn == txn:
            self.last.group = group

    def name_version(self, txn: str, version: str) -> None:
        """The version ``txn`` stamps on the engines that took it (known only at its end for a
        framework's update), for its push record."""
        if self.last is not None and self.last.txn == txn:
            self.last.version = version

    def set_fleet_version(self, version: str) -> None:
        """Every engine was relabelled ``version`` outside a transaction (``/update_weight_version``):
        the fleet is at it, from wherever its weights came."""
        fleet = self.registry.fleet
        self.registry.set_fleet(FleetWeights(version, fleet.source if fleet else None))

    def _end_unanswered(self, holder: _Holder) -> None:
        log.warning(
            "weight update %s went away before its hold was answered: admitting requests again", holder.txn or "(bare)"
        )
        last = self.last
        if holder.txn is not None and last is not None and last.txn == holder.txn and not last.ended:
            last.state, last.ended_at = PushState.CANCELLED, time.time()
        self._holder = None
        self.registry.updating = False
        self.gate.open()

    def moving(self, txn: str) -> None:
        """Weights begin to move under ``txn`` (the facade's own transactions say it here)."""
        if self._holder is not None and self._holder.txn == txn:
            self._holder.moved = True

    def start_record(
        self,
        txn: str,
        version: str | None,
        source: str | None,
        refit: RefitMode,
        group: Mapping[str, Any] | None,
        driver: Driver = Driver.PDCTL,
    ) -> PushRecord:
        """Weights begin to move under ``txn``: its push record (the latest)."""
        self.last = PushRecord(txn, version, source, refit, group, driver)
        return self.last

    # -- the end of a transaction ---------------------------------------------------------------------
    def _lapse(self, holder: _Holder, lease: float) -> None:
        if self._holder is not holder:
            return
        holder.lease = None
        if holder.txn is not None:
            # The router's own transaction (pdctl.router.transaction) ends it: memory given back
            # and engines continued before a request may reach them.
            for told in list(self.on_lapse):
                try:
                    if told(holder.txn, holder.moved, holder.engines, holder.driver):
                        return
                except Exception:
                    log.exception("a lapse listener failed")
        txn = holder.txn
        last = self.last
        ours = txn is not None and last is not None and last.txn == txn and not last.ended
        moved = holder.moved
        self._holder = None
        if txn is None:
            log.warning("a hold without a transaction was not renewed within %.0fs: admitting requests again", lease)
        elif not moved:
            log.warning(
                "weight update %s was not renewed within %.0fs and moved no weights: its engines are continued "
                "and stay in rotation; admitting requests again",
                txn,
                lease,
            )
            if ours:
                assert last is not None
                last.state, last.ended_at = PushState.CANCELLED, time.time()
                self.metrics.weight_update_ended("cancelled", {}, self.held_secs())
        else:
            # A framework's transaction knows which engines it changed: its own lapse (on_lapse) says.
            if holder.driver is Driver.PDCTL:
                log.error(
                    "weight push %s did not renew its hold within %.0fs (trainer gone?): its %d engine(s) leave "
                    "rotation until a later push reaches them; admitting requests again",
                    txn,
                    lease,
                    len(holder.engines),
                )
                for url in holder.engines:
                    self.registry.set_quarantine(url, f"weight push {txn} stopped half way (lease expired)")
            if ours:
                assert last is not None
                last.state, last.ended_at = PushState.ABANDONED, time.time()
            self.metrics.weight_update_ended("abandoned", {}, self.held_secs())
        self.registry.updating = False
        self.gate.open()
        if txn is not None:
            return  # its listeners heard it above and none took it
        for told in list(self.on_lapse):
            try:
                told(txn, moved, holder.engines, holder.driver)
            except Exception:  # one listener's bug must not keep the others from hearing
                log.exception("a lapse listener failed")

    async def release(self, release: Release, session: aiohttp.ClientSession | None) -> None:
        """End ``release.txn``: ``complete`` engines hold its version (back into rotation),
        ``failed`` ones do not (out of rotation until a later update); every worker's health and
        version are read again, then requests flow. Raises Conflict when another transaction
        holds the router."""
        txn = release.txn
        holder = self._holder
        if txn is not None and holder is not None and holder.txn is not None and txn != holder.txn:
            raise Conflict(f"weight push {holder.txn} holds the router")
        if holder is not None and holder.ending is not None:  # a release repeated while the first reads health
            await holder.ending.wait()
            return
        for url in release.complete:
            self.registry.set_quarantine(url, None)
        for url, reason in release.failed.items():
            self.registry.set_quarantine(url, reason)
        if holder is not None and holder.lease is not None:
            holder.lease.cancel()
        last = self.last
        outcome: PushState | None = None
        if last is not None and txn is not None and last.txn == txn:
            if not release.moved:
                outcome = PushState.CANCELLED
            elif release.failed or not release.complete:
                outcome = PushState.FAILED
            else:
                outcome = PushState.COMPLETE
            last.complete, last.failed = tuple(release.complete), dict(release.failed)
            last.phases = dict(release.phases)
            self.metrics.weight_update_ended(outcome.name.lower(), dict(release.phases), self.held_secs())
            if release.complete and release.moved and last.version is not None:
                self.registry.set_fleet(FleetWeights(str(last.version), last.source))
        if holder is not None:
            holder.ending = asyncio.Event()
        self.registry.updating = False
        fleet = self.registry.fleet
        if fleet is not None and fleet.source and last is not None and last.txn == txn and release.moved:
            # A load from disk that some engines missed (not answering: restarting, say): the
            # router loads the checkpoint into each itself, now or when it answers again.
            for url in release.failed:
                worker = self.registry.workers.get(url)
                if worker is not None and worker.weight_version != fleet.version:
                    self.registry.set_quarantine(url, fleet.stale_reason(worker.weight_version))
                    if session is not None and worker.healthy:
                        self.health.versions.apply(session, worker)
        try:
            if session is not None:
                await self.health.check_all(session)
        finally:
            # Whatever the checks met, requests flow again. The transaction reads as ended only
            # from here: until the gate opens it still holds the router, and says so.
            if outcome is not None and last is not None:
                last.state, last.ended_at = outcome, time.time()
            if self._holder is holder:
                self._holder = None
            self.gate.open()
            if holder is not None and holder.ending is not None:
                holder.ending.set()
