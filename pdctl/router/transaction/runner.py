"""The fleet transaction the router runs for whoever updates the fleet's weights through it: a
trainer's push (``pdctl.weights``, its steps at ``/pdctl/push/*``), RL frameworks through SGLang's
control routes (pdctl.router.facade) and ``pdctl weights load``.

One implementation of hold, pause, move (receive updates, or load from disk), verify, version,
continue, release, with one rule for what a failure leaves:

- **open**: the router holds new requests (``WeightUpdates.hold``: the gate, the lease) and pauses
  every engine; the open transaction is written to the router's state file first, so that a router
  killed from then on ends it when it starts again (``recover``).
- **move**: before the first weight moves, every engine is labelled ``pdctl:updating:<txn>``
  (pdctl.refit.UPDATING_LABEL): a restarting engine never takes its weights from one of them, and
  a router that restarts keeps them out of rotation. Each engine's answer sets its ``Mark``
  (pdctl.router.transaction.state).
- **end** (the driver's continue): sessions closed, the engines that took every update verified
  and stamped with the version, every engine continued, the router released.
- **fail** (a call failed, so the update cannot be whole): it ends at once, unless its driver
  can redo it (a push: the trainer sends the update again to the engines that survived, over a
  group built again, within the same hold, or aborts; ``FleetTxn.redo``). Engines whose weights
  may have changed leave rotation, labelled ``pdctl:partial:<txn>``, until a whole update reaches
  them; engines it never changed get their label back, are continued and serve on.
- **lapse** (no call for ``--framework-lease-secs``): the same as a failure, plus released memory
  given back.

Verification, the one rule: after a complete distributed update, every engine that took it must
hold the checksums of the updated tensors that the source holds: the trainer's own (a push sends
them with its commit), or, without them (a framework sends none), those of the agreeing strict
majority, where a tie fails everyone. By default (``verify: auto``) only engines that answer
per-tensor checksums of the full tensor are compared (pdctl's sim: ``/weights_checker`` with
``names``): SGLang's ``/weights_checker`` hashes each TP rank's shard, which differs across TP
layouts and from the full tensor, so an SGLang engine would fail a right update. A driver that
asks for ``sample`` or ``full`` has every engine compared.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

import aiohttp

from pdctl.refit import (
    DEFAULT_HOLD_TIMEOUT_SECS,
    UPDATING_LABEL,
    Hold,
    RefitMode,
    Release,
    VerifyMode,
)
from pdctl.router.config import RouterConfig
from pdctl.router.fanout import WorkerAnswer, call_all, unreachable
from pdctl.router.tasks import Tasks
from pdctl.router.transaction.groups import FleetGroup, label, label_of, weight_order
from pdctl.router.transaction.holder import FleetHolder
from pdctl.router.transaction.on_engines import OnEngines
from pdctl.router.transaction.recovery import end_left_open
from pdctl.router.transaction.state import (
    LEFT_OPEN,
    FleetTxn,
    Mark,
    Moved,
    Opener,
    TxnState,
    hold_modes,
    mark_of_load,
    mark_of_update,
)
from pdctl.router.transaction.verify import checksum_body, differing, engines_to_verify
from pdctl.router.updates import Conflict, Driver, WeightUpdates
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang import (
    Endpoint,
    PauseMode,
    pause_generation_body,
    update_weight_version_body,
)
from pdctl.sglang import control as sg

log = logging.getLogger("pdctl.router.transaction")

CONTROL_SECS = 60.0
"""Limit on an engine's answer to a short control call (pause, continue, flush, version, begin/end)."""

_serial = itertools.count(1)


def new_version() -> str:
    """The version an update gets when its driver names none: SGLang would keep the old name on
    new weights, and then an engine that restarts on the old weights would look current to the
    router's version rule (pdctl.router.fleet_weights)."""
    now = time.time()
    return f"fw-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}.{int(now * 1000) % 1000:03d}-{next(_serial)}"


class Unset:
    """A setting its caller left to the router's configuration."""


UNSET = Unset()


class UpdateFailed(Exception):
    """An update call failed. The transaction has ended (``FleetTransactions.fail``), unless it is
    redoable (a push: its driver redoes or aborts it); the message says what happened to every
    engine. ``left``: engines that left the weight group (dead, or no answer), over which no later
    broadcast can complete; ``engines``: URL -> what went wrong there."""

    def __init__(self, message: str, left: tuple[str, ...] = (), engines: Mapping[str, str] | None = None):
        super().__init__(message)
        self.left = left
        self.engines = dict(engines or {})


class FleetTransactions:
    """The one owner of the router's own fleet transactions (module docstring). At most one is
    open (``current``); its driver's calls are made one at a time under ``lock`` (the facade's
    routes and a push's steps take it; a push's abort does not wait for it, and an update call
    under way stops before it sends when the transaction ended meanwhile)."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        updates: WeightUpdates,
        session: Callable[[], aiohttp.ClientSession | None],
        idle: asyncio.Event,
        in_flight: Callable[[], int],
    ):
        """``session``: the router's client session (made when it starts); ``idle`` and
        ``in_flight``: the router's requests in flight, for a hold that drains."""
        self.config = config
        self.registry = registry
        self.updates = updates
        self._session = session
        self._idle = idle
        self._in_flight = in_flight
        self.current: FleetTxn | None = None
        self.lock = asyncio.Lock()
        self.on_engines = OnEngines(self.call_all, self._keep, updates)
        self.holder = FleetHolder(updates, lambda: self.current)
        self.tasks = Tasks()
        """Its tasks that outlive a call (an end its client stopped waiting for, a lapse's cleanup)."""
        updates.on_lapse.append(self._lapsed)

    @property
    def session(self) -> aiohttp.ClientSession:
        """The router's client session; valid only once the router has started."""
        session = self._session()
        assert session is not None, "the router has started"
        return session

    def engines(self) -> list[Worker]:
        """The fleet's engines in the weight group's order."""
        return weight_order(self.registry.workers.values())

    async def call_all(
        self, workers: Iterable[Worker], endpoint: Endpoint, body: Any = None, *, secs: float = CONTROL_SECS
    ) -> list[WorkerAnswer]:
        """POST ``body`` to ``endpoint`` on every one of ``workers`` at once, each answer awaited at most ``secs``; one
        answer per worker, in order, failures included."""
        return await call_all(self.session, list(workers), "POST", endpoint.value, body, secs)

    def _keep(self) -> None:
        """Write what a restarted router must undo of the open transaction (nothing once it ended)."""
        txn = self.current
        self.registry.keep_transaction(None if txn is None or txn.ended else txn.record())

    # -- open -----------------------------------------------------------------------------------------
    async def open(
        self,
        opener: Opener,
        pause: PauseMode | None,
        driver: Driver = Driver.FRAMEWORK,
        *,
        refit: RefitMode | None = None,
        max_staleness: int | Unset | None = UNSET,
        abandoned: asyncio.Event | None = None,
        lease_secs: float | None = None,
        timeout_secs: float = DEFAULT_HOLD_TIMEOUT_SECS,
        version: str | None = None,
        call_secs: float | None = None,
        drain_pause: PauseMode = PauseMode.RETRACT,
    ) -> FleetTxn:
        """Hold the router and pause every engine. ``pause``: the driver's own pause mode (requests
        wait at the router; those in flight get what that mode gives them); None: the refit mode
        decides (``refit``, else the router's), as for a push (drain: wait for requests in flight,
        then pause in ``retract``; interrupt: pause in ``abort`` at once). Raises Conflict when
        another transaction holds the router, a drain did not finish, or ``abandoned`` was set
        while the drain waited (its driver went away: nothing had changed, requests flow at once).
        Once the hold is answered it runs to its end whatever its caller does. ``lease_secs``:
        how long it may go without a call (default ``--framework-lease-secs``); ``timeout_secs``:
        how long the drain may take; ``version``: the version it stamps unless its driver names
        another; ``call_secs``: the limit on each engine's answer to an update call (default
        ``--request-timeout-secs``); ``drain_pause``: the engines' pause mode after a drain."""
        holder = self.updates.holder
        if holder is not None:
            raise Conflict(f"weight push {holder} holds the router")
        refit = refit or self.config.refit
        gate, engine_mode = hold_modes(refit, pause, drain_pause)
        kind = "push" if opener is Opener.PUSH else "framework"
        txn = FleetTxn(f"{kind}-{time.time_ns():x}", opener, engine_mode, tuple(self.engines()), driver)
        txn.lease_secs, txn.version, txn.refit, txn.call_secs = lease_secs, version, gate, call_secs
        hold = Hold(
            txn=txn.id,
            engines=tuple(w.url for w in txn.engines),
            lease_secs=self._lease(txn),
            timeout_secs=timeout_secs,
            refit=gate,
            max_staleness=self.config.max_staleness if isinstance(max_staleness, Unset) else max_staleness,
        )
        with txn.timed("hold"):
            holding = asyncio.ensure_future(
                self.updates.hold(
                    hold, idle=self._idle, in_flight=self._in_flight, record=False, driver=driver, wait=pause is None
                )
            )
            if abandoned is not None:
                gone = asyncio.ensure_future(abandoned.wait())
                await asyncio.wait((holding, gone), return_when=asyncio.FIRST_COMPLETED)
                gone.cancel()
                if not holding.done():  # its driver left while requests drained: the hold ends unanswered
                    holding.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await holding
                    raise Conflict("its driver went away while requests in flight drained; nothing changed")
            _, ready = await holding
            if not ready:
                await self.updates.release(Release(txn=txn.id), self._session())
                raise Conflict(f"requests in flight did not finish within {timeout_secs:.0f}s (refit drain)")
        self.current = txn
        self._keep()  # before the pause: a router killed from here on continues them when it starts
        with txn.timed("pause"):
            await asyncio.shield(self._pause(txn, engine_mode))
        log.info("transaction %s opened by %s: %d engine(s) paused (%s)", txn.id, opener, len(txn.engines), engine_mode)
        return txn

    async def _pause(self, txn: FleetTxn, mode: PauseMode) -> None:
        for a in await self.call_all(txn.engines, Endpoint.PAUSE_GENERATION, pause_generation_body(mode)):
            if not a.ok:
                log.warning("transaction %s: pause %s %s (it pauses no request)", txn.id, label(a.worker), a.why())

    async def pause_again(self, txn: FleetTxn, mode: PauseMode) -> None:
        """The driver paused again (perhaps in another mode): the engines take it, and a
        transaction the router opened becomes the driver's (its continue ends it)."""
        txn.adopt(mode)
        await self.call_all(txn.engines, Endpoint.PAUSE_GENERATION, pause_generation_body(mode))

    @contextlib.asynccontextmanager
    async def call(self, txn: FleetTxn) -> AsyncIterator[None]:
        """A driver's call in progress: no lease runs out under it; renewed when it ends."""
        self.updates.suspend(txn.id)
        try:
            yield
        finally:
            if not txn.ended:
                self.updates.renew(txn.id, self._lease(txn))

    def renew(self, txn: FleetTxn) -> None:
        """Its driver is alive (a call, or a renewal between calls): its lease starts again."""
        self.updates.renew(txn.id, self._lease(txn))

    def _lease(self, txn: FleetTxn) -> float:
        return txn.lease_secs if txn.lease_secs is not None else self.config.admission.framework_lease_secs

    # -- moving -------------------------------------------------------------------------------------
    async def _move(self, txn: FleetTxn, moved: Moved) -> None:
        """Weights are about to move. The first time: the push record starts, every engine is
        labelled as updating, and for a distributed update their caches are flushed (nothing runs
        on them until the end, so no prefix computed on the old weights survives it)."""
        first = txn.state is TxnState.HELD
        txn.move(TxnState.MOVING, moved)
        if not first:
            return
        self.updates.moving(txn.id)
        self.updates.start_record(txn.id, txn.version, txn.source, txn.refit, None, txn.driver)
        with txn.timed("pause"):
            for w in txn.engines:
                txn.prior[w.url] = w.weight_version
            flushes: Awaitable[list[WorkerAnswer]] = (
                call_all(self.session, txn.engines, "POST", Endpoint.FLUSH_CACHE.value, None, CONTROL_SECS)
                if moved is Moved.DISTRIBUTED
                else _nothing()
            )
            labels, flushed = await asyncio.gather(self._label(txn.engines, UPDATING_LABEL + txn.id), flushes)
            for a in flushed:
                if a.status != 200:
                    log.warning("transaction %s: %s kept its cache (%s); stale prefixes may be reused", txn.id,
                                label(a.worker), a.why())  # fmt: skip
            for a in labels:
                if not a.ok:
                    log.warning("transaction %s: labelling %s as updating: %s", txn.id, label(a.worker), a.why())
        self._keep()

    async def _label(self, workers: Iterable[Worker], version: str) -> list[WorkerAnswer]:
        """Set ``version`` as the weight version label of ``workers`` (no request is aborted); the
        registry holds it for those that took it as soon as all answered."""
        answers = await self._relabel(workers, version)
        self.registry.relabelled([a.worker for a in answers if a.ok], version)
        return answers

    def _relabel(self, workers: Iterable[Worker], version: str) -> Awaitable[list[WorkerAnswer]]:
        """The calls that set ``version`` on ``workers``, without telling the registry."""
        return self.call_all(workers, Endpoint.UPDATE_WEIGHT_VERSION, update_weight_version_body(version))

    async def receive(self, txn: FleetTxn, group: FleetGroup, update: sg.DistributedUpdate) -> None:
        """One update call to every member of ``group`` at once (they all take part in the driver's
        one broadcast), answered when all have answered. An engine whose port takes no connection
        is found before anything is sent, so the others never enter a broadcast that cannot
        complete. Raises UpdateFailed when any engine failed (the transaction ended, unless its
        driver may redo it), or when it ended meanwhile (a push's abort does not wait for this
        call: until it is sent its engines count as receiving, so such an end takes them out)."""
        workers = [m.worker for m in group.members]
        txn.sending.update(w.url for w in workers)
        await self._move(txn, Moved.DISTRIBUTED)
        if group.name not in txn.groups and not txn.ended:
            txn.groups[group.name] = group
            await self.on_engines.begin_sessions(txn, group)
        dead = await unreachable(workers)
        if txn.ended:
            raise UpdateFailed(f"transaction {txn.id} ended while this update call waited: {txn.failure}")
        if dead:
            txn.sending.difference_update(w.url for w in workers)  # nothing was sent to any of them
            for url, why in dead.items():  # one that took nothing yet changed nothing: its restart decides
                txn.mark(url, Mark.GONE if txn.marks.get(url) is Mark.TAKING else Mark.REFUSED, why)
            named = "; ".join(f"{label_of(self.registry, url)}: {why}" for url, why in dead.items())
            await self._failed(txn, f"{named}; nothing was sent to the other engines", tuple(dead), dead)
        body = update.to_body(flush_cache=False, weight_version=None, group_name=group.name)
        secs = txn.call_secs or self.config.admission.request_timeout_secs
        with txn.timed("transfer"):
            answers = await self.call_all(workers, Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED, body, secs=secs)
        txn.sending.difference_update(w.url for w in workers)
        txn.names.extend(update.names)
        if update.weight_version is not None:
            txn.version = update.weight_version
        for a in answers:
            url = a.worker.url
            txn.mark(url, mark_of_update(txn.marks.get(url, Mark.UNTOUCHED), a),
                     None if a.ok else f"update_weights_from_distributed {a.why()}")  # fmt: skip
        failed = [a for a in answers if not a.ok]
        if failed:
            named = "; ".join(f"{label(a.worker)} {a.why()}" for a in failed)
            await self._failed(
                txn,
                f"{len(failed)} of {len(answers)} engine(s) failed it: {named}",
                tuple(a.worker.url for a in failed if not a.reached),
                {a.worker.url: a.why() for a in failed},
            )

    async def _failed(self, txn: FleetTxn, why: str, left: tuple[str, ...], engines: Mapping[str, str]) -> None:
        """An update call failed: raises UpdateFailed, the transaction ended first unless its
        driver may redo it (``FleetTxn.redoable``)."""
        if txn.redoable:
            raise UpdateFailed(f"{why}; the push stays open for its driver to redo or abort", left, engines)
        raise UpdateFailed(await self.fail(txn, why), left, engines)

    async def redo(self, txn: FleetTxn, survivors: Iterable[str]) -> None:
        """Its driver sends the update again from the first tensor to ``survivors`` (URLs) only,
        over a group it builds again (``FleetTxn.redo``); their update sessions start again."""
        await self.on_engines.end_sessions(txn)
        txn.redo(frozenset(survivors))
        self._keep()

    async def load(self, txn: FleetTxn, disk: sg.DiskUpdate) -> dict[str, str]:
        """Every engine loads ``disk.model_path``. One that refuses keeps its weights and version
        (and its place in rotation); one that does not answer leaves rotation at the end; the
        version is set only on those that loaded. Returns URL -> what went wrong."""
        txn.version = disk.weight_version or txn.version or new_version()
        txn.source = disk.model_path
        await self._move(txn, Moved.DISK)
        txn.sending.update(w.url for w in txn.engines)
        with txn.timed("transfer"):
            answers = await self.call_all(
                txn.engines, Endpoint.UPDATE_WEIGHTS_FROM_DISK, disk.to_body(None),
                secs=self.config.admission.request_timeout_secs,
            )  # fmt: skip
        txn.sending.clear()
        for a in answers:
            txn.mark(a.worker.url, mark_of_load(a), None if a.ok else f"load: {a.why()}")
        loaded = txn.engines_marked(Mark.LOADED)
        with txn.timed("version"):
            for a in await self._label(loaded, txn.version):
                if not a.ok:
                    txn.why.setdefault(a.worker.url, f"loaded, but update_weight_version {a.why()}")
        return {url: txn.why[url] for url in txn.marks if url in txn.why}

    # -- the end --------------------------------------------------------------------------------------
    async def end(
        self, txn: FleetTxn, source: Mapping[str, str] | None = None, verify: VerifyMode = VerifyMode.AUTO
    ) -> None:
        """End ``txn`` as its driver meant it to end: memory given back, sessions closed, the
        engines that took every update verified (module docstring: against ``source``, the
        driver's checksums by tensor name, when it sent them) and stamped with the version, every
        engine continued, the router released (engines that missed the version out of rotation).
        Nothing when it has ended already (its lease ran out, or its driver aborted it)."""
        if txn.ended:
            return
        await self.on_engines.give_back_memory(txn)
        complete: list[Worker] = []
        if txn.moved is Moved.DISTRIBUTED:
            with txn.timed("end"):
                for a in await self.on_engines.end_sessions(txn):
                    if not a.ok:
                        txn.mark(a.worker.url, Mark.PARTIAL, f"end_weight_update {a.why()}", "end")
            checked = engines_to_verify(txn, source is not None, verify)
            if checked and txn.names:
                with txn.timed("verify"):
                    answers = await self.call_all(
                        checked, Endpoint.WEIGHTS_CHECKER, checksum_body(txn.names, verify),
                        secs=self.config.admission.request_timeout_secs,
                    )  # fmt: skip
                    for url, why in differing(answers, txn.names, source).items():
                        txn.mark(url, Mark.PARTIAL, why, "verify")
            txn.version = txn.version or new_version()
            self.updates.name_version(txn.id, txn.version)
            with txn.timed("version"):
                for a in await self._label(txn.engines_marked(Mark.TAKING), txn.version):
                    if a.ok:
                        complete.append(a.worker)
                    else:
                        txn.mark(a.worker.url, Mark.PARTIAL, f"update_weight_version {a.why()}", "version")
        elif txn.moved is Moved.DISK:
            complete = [w for w in txn.engines_marked(Mark.LOADED) if w.url not in txn.why]
        await self._close(txn, complete)

    async def fail(self, txn: FleetTxn, why: str) -> str:
        """A call of ``txn`` failed: the update cannot be whole, so it ends now (its driver may
        never continue: AReaL raises without). Returns what happened, for the driver's answer."""
        if txn.ended:
            return f"the update had ended already ({txn.failure or 'its end'})"
        txn.failure = txn.failure or why
        await self.on_engines.give_back_memory(txn)
        await self.on_engines.end_sessions(txn)
        await self._close(txn, [])
        changed = [label_of(self.registry, url) for url in txn.changed()]
        kept = [label_of(self.registry, url) for url in txn.unchanged()]
        outcome = f"the update stopped ({why}); it is over"
        if changed:
            outcome += f": {', '.join(changed)} may hold part of it and are out of rotation until a whole update"
        if kept:
            outcome += f"; {', '.join(kept)} never changed and serve on"
        return outcome

    async def _close(self, txn: FleetTxn, complete: list[Worker]) -> None:
        """The end every transaction shares: labels made true, every engine continued, the router
        released: ``complete`` engines hold the version, changed ones that are not leave rotation.
        Once only (a lapse and its driver's late end may both reach here)."""
        if txn.ended:
            return
        done = {w.url for w in complete}
        closing = txn.closing(done)
        reasons, restore, labels = closing.reasons, closing.restore, closing.labels
        with txn.timed("continue"):
            answers = await asyncio.gather(*(self._relabel(group, version) for version, group in labels))
            # All at once, the broken out of rotation with them: a retry never pairs half a relabel.
            for url, reason in reasons.items():
                self.registry.set_quarantine(url, reason)
            for (version, _), took in zip(labels, answers, strict=True):
                self.registry.relabelled([a.worker for a in took if a.ok], version)
            for a in await self.call_all(txn.engines, Endpoint.CONTINUE_GENERATION, {}):
                if not a.ok:
                    log.warning("transaction %s: continue %s: %s", txn.id, label(a.worker), a.why())
        if txn.moved is not Moved.NOTHING:
            log.log(
                logging.WARNING if reasons else logging.INFO,
                "transaction %s ended: version %s on %d engine(s)%s%s",
                txn.id,
                txn.version,
                len(complete),
                f"; out of rotation: {', '.join(f'{label_of(self.registry, u)} ({r})' for u, r in reasons.items())}"
                if reasons
                else "",
                f"; kept their weights and serve on: {', '.join(label_of(self.registry, w.url) for w in restore)}"
                if reasons and restore
                else "",
            )
        txn.move(TxnState.ENDED)
        if self.current is txn:
            self.current = None
        self._keep()
        ended = Release(txn.id, tuple(done), reasons, dict(txn.phases), moved=txn.moved is not Moved.NOTHING)
        await self.updates.release(ended, self._session())

    async def recover(self) -> None:
        """At the router's start: end what a transaction of a killed predecessor left (recovery.py)."""
        await end_left_open(self.registry, self.session, CONTROL_SECS)

    # -- when the driver is gone -------------------------------------------------------------------------
    def _lapsed(self, txn_id: str | None, moved: bool, engines: tuple[str, ...], driver: Driver) -> bool:
        """No call came for ``framework_lease_secs``: the transaction ends as a failure does (its
        driver is gone). The gate stays closed until its memory is back and its engines are
        continued (``_close`` releases it); engines it may have changed leave rotation."""
        txn = self.current
        if txn is None or txn.id != txn_id:
            return False
        left = "memory released and not resumed" if txn.released else LEFT_OPEN[txn.opener]
        txn.failure = f"nothing came for {self._lease(txn):.0f}s after its driver's last call ({left})"
        self.current = None
        log.error(
            "transaction %s: %s; its engines are continued%s",
            txn.id,
            txn.failure,
            f" and {len(txn.changed())} out of rotation until a whole update" if txn.changed() else "",
        )

        async def finish() -> None:
            await self.on_engines.give_back_memory(txn)
            await self.on_engines.end_sessions(txn)
            await self._close(txn, [])

        self.tasks.spawn(finish())
        return True


async def _nothing() -> list[WorkerAnswer]:
    return []
