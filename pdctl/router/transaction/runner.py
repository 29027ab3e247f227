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
    PARTIAL_LABEL,
    UPDATING_LABEL,
    Hold,
    RefitMode,
    Release,
    VerifyMode,
)
from pdctl.router.config import RouterConfig
from pdctl.router.fanout import WorkerAnswer, call_all, unreachable
from pdctl.router.refit import Conflict, Driver, WeightUpdates
from pdctl.router.transaction.groups import FleetGroup, label, weight_order
from pdctl.router.transaction.state import (
    LEFT_OPEN,
    FleetTxn,
    Mark,
    Moved,
    Opener,
    TxnState,
    mark_of_load,
    mark_of_update,
)
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang import (
    Endpoint,
    PauseMode,
    pause_generation_body,
    supports_weight_update_session,
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
    open (``current``); its driver's calls are made one at a time by the caller (the facade's lock)."""

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
        self._tasks: set[asyncio.Task] = set()
        updates.on_lapse.append(self._lapsed)

    @property
    def lease_secs(self) -> float:
        return self.config.admission.framework_lease_secs

    @property
    def session(self) -> aiohttp.ClientSession:
        session = self._session()
        assert session is not None, "the router has started"
        return session

    def engines(self) -> list[Worker]:
        """The fleet's engines in the weight group's order."""
        return weight_order(self.registry.workers.values())

    async def call_all(
        self, workers: Iterable[Worker], endpoint: Endpoint, body: Any = None, *, secs: float = CONTROL_SECS
    ) -> list[WorkerAnswer]:
        return await call_all(self.session, list(workers), "POST", endpoint.value, body, secs)

    def hold_state(self) -> dict[str, Any] | None:
        """What holds the router now, if anything (``WeightUpdates.hold_state`` with ``by``, in
        words: whose transaction, and what opened it), for every health surface to say."""
        state = self.updates.hold_state()
        if state is None:
            return None
        txn = self.current
        if state["ending"]:
            state["by"] = f"the end of weight update {state['txn']} (every worker's health read again)"
        elif txn is not None and txn.id == state["txn"]:
            state["by"] = f"{'memory released by a framework' if txn.released else txn.opener} ({txn.id})"
        elif state["txn"] is not None:
            state["by"] = f"weight push {state['txn']}"
        else:
            state["by"] = "a hold with no transaction"
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state["since"]))
        state["reason"] = f"held by {state['by']} since {since} ({state['secs']:.0f} s)"
        return state

    def foreign(self, caller: str | None = None) -> str | None:
        """Why a call that acts on the fleet is refused: another transaction holds the router and
        its engines (a bare ``/pdctl/hold``, or a push whose driver is not ``caller``, the
        transaction its call names in ``TXN_HEADER``)."""
        holder = self.updates.holder
        txn = self.current
        if holder is not None and (txn is None or txn.id != holder):
            return f"weight push {holder} holds the router"
        if txn is not None and txn.opener is Opener.PUSH and caller != txn.id:
            return f"weight push {txn.id} holds the router"
        return None

    def pushing(self, caller: str | None) -> str | None:
        """Why a call that changes the fleet's weight groups is refused: another driver's push is
        open (a bare hold, or a framework's pause, leaves groups to whoever calls)."""
        txn = self.current
        if txn is not None and txn.opener is Opener.PUSH and caller != txn.id:
            return f"weight push {txn.id} holds the router"
        return None

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Future[Any]:
        """Run ``coro`` in a task of the router's own, kept until it ends (cancelled when the router stops)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

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
        another."""
        holder = self.updates.holder
        if holder is not None:
            raise Conflict(f"weight push {holder} holds the router")
        refit = refit or self.config.refit
        if pause is not None:
            gate = RefitMode.INTERRUPT if refit is RefitMode.INTERRUPT and pause is PauseMode.ABORT else RefitMode.DRAIN
            engine_mode = pause
        else:
            gate = refit
            engine_mode = PauseMode.ABORT if refit is RefitMode.INTERRUPT else PauseMode.RETRACT
        kind = "push" if opener is Opener.PUSH else "framework"
        txn = FleetTxn(f"{kind}-{time.time_ns():x}", opener, engine_mode, tuple(self.engines()), driver)
        txn.lease_secs, txn.version, txn.refit = lease_secs, version, gate
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
        return txn.lease_secs if txn.lease_secs is not None else self.lease_secs

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
        complete. Raises UpdateFailed, the transaction ended, when any engine failed."""
        await self._move(txn, Moved.DISTRIBUTED)
        if group.name not in txn.groups:
            txn.groups[group.name] = group
            await self._begin_sessions(txn, group)
        workers = [m.worker for m in group.members]
        dead = await unreachable(workers)
        if dead:
            for url, why in dead.items():  # one that took nothing yet changed nothing: its restart decides
                txn.mark(url, Mark.GONE if txn.marks.get(url) is Mark.TAKING else Mark.REFUSED, why)
            named = "; ".join(f"{self._label_of(url)}: {why}" for url, why in dead.items())
            await self._failed(txn, f"{named}; nothing was sent to the other engines", tuple(dead), dead)
        body = update.to_body(flush_cache=False, weight_version=None, group_name=group.name)
        txn.sending.update(w.url for w in workers)
        with txn.timed("transfer"):
            answers = await self.call_all(
                workers, Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED, body, secs=self.config.admission.request_timeout_secs
            )
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
        await self._end_sessions(txn)
        txn.redo(frozenset(survivors))
        self._keep()

    async def _begin_sessions(self, txn: FleetTxn, group: FleetGroup) -> None:
        """SGLang 0.5.21+ takes distributed updates only inside a weight-update session, which
        frameworks written for older SGLang never open: opened here for them."""
        last = self.updates.last
        if last is not None and last.txn == txn.id and last.group is None:
            self.updates.describe_group(txn.id, group.to_json())
        due = [
            m for m in group.members if m.url not in txn.sessions and supports_weight_update_session(m.sglang_version)
        ]
        if not due:
            return
        with txn.timed("begin"):
            answers = await self.call_all((m.worker for m in due), Endpoint.BEGIN_WEIGHT_UPDATE, {"selector": "all"})
        for m, a in zip(due, answers, strict=True):
            if a.ok:
                txn.sessions[m.url] = m
            else:  # its next update is refused before its receive (no session): the failure says so
                log.warning("transaction %s: begin_weight_update %s %s", txn.id, label(m.worker), a.why())
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

    async def load_for_pdctl(
        self,
        disk: sg.DiskUpdate,
        refit: RefitMode | None,
        max_staleness: int | Unset | None,
        tell: Callable[[dict[str, Any]], None],
        abandoned: asyncio.Event,
    ) -> dict[str, Any]:
        """``pdctl weights load``: a load from disk as one transaction of its own, told step by
        step. Its driver going away while requests drain cancels it (nothing changed); from the
        hold's answer on, it runs to its end (the fleet ends on one version whether or not anyone
        waits for the answer). The outcome per engine URL: ``complete``, ``refused`` (kept their
        weights, in rotation), ``failed`` (out of rotation; the router loads the checkpoint into
        each once it answers again)."""
        mode = refit or self.config.refit
        draining = mode is RefitMode.DRAIN
        tell({"step": "holding", "drain": draining})
        txn = await self.open(
            Opener.LOAD, None, Driver.PDCTL, refit=mode, max_staleness=max_staleness, abandoned=abandoned
        )

        tell({"step": "loading", "path": disk.model_path, "engines": len(txn.engines)})
        await self.load(txn, disk)
        await self.end(txn)
        return self.outcome(txn)

    @staticmethod
    def outcome(txn: FleetTxn) -> dict[str, Any]:
        """What an ended transaction did, for its driver (by engine URL): ``complete`` (hold its
        version, in rotation), ``refused`` (kept their weights, in rotation), ``failed`` (out of
        rotation until a whole update; ``steps`` says in which step each went wrong), its
        version, phases and id."""
        refused = {u: txn.why[u] for u, m in txn.marks.items() if m is Mark.REFUSED and u in txn.why}
        whole = (Mark.TAKING, Mark.LOADED)
        complete = (
            []
            if txn.failure
            else [w.url for w in txn.engines if txn.marks.get(w.url) in whole and w.url not in txn.why]
        )
        failed = {u: why for u, why in txn.why.items() if u not in refused}
        failed.update(
            {u: f"holds part of it ({txn.failure})" for u in txn.changed() if u not in failed and u not in complete}
        )
        return {
            "version": txn.version, "complete": complete, "refused": refused, "failed": failed,
            "steps": {u: txn.phase_of.get(u, "transfer") for u in failed}, "phases": dict(txn.phases), "txn": txn.id,
        }  # fmt: skip

    # -- memory -----------------------------------------------------------------------------------------
    async def release_memory(self, txn: FleetTxn, tags: list[str] | None) -> list[WorkerAnswer]:
        """``/release_memory_occupation`` on every engine of ``txn`` (paused: SGLang releases only
        an idle engine). Raises ValueError, sending nothing, for a tag an engine has released
        already (SGLang's memory saver ends the engine's process on a second release)."""
        wanted = frozenset(tags or sg.MEMORY_TAGS)
        twice = {
            label(w): sorted(txn.released[w.url] & wanted)
            for w in txn.engines
            if txn.released.get(w.url, frozenset()) & wanted
        }
        if twice:
            raise ValueError(f"already released: {twice}; resume_memory_occupation first")
        answers = await self.call_all(txn.engines, Endpoint.RELEASE_MEMORY_OCCUPATION, {"tags": tags})
        for a in answers:
            if a.status == 200:
                txn.memory(a.worker.url, txn.released.get(a.worker.url, frozenset()) | wanted)
        self._keep()
        return answers

    async def resume_memory(self, txn: FleetTxn, tags: list[str] | None) -> list[WorkerAnswer]:
        """``/resume_memory_occupation`` on the engines that released ``tags``. Raises ValueError,
        sending nothing, when none did (SGLang's scheduler ends the engine on a resume of a tag
        it did not release)."""
        wanted = frozenset(tags) if tags else None
        due = [w for w in txn.engines if txn.released.get(w.url) and (wanted is None or wanted <= txn.released[w.url])]
        if not due:
            held = {label(w): sorted(txn.released[w.url]) for w in txn.engines if w.url in txn.released}
            asked = sorted(wanted) if wanted else "no tag"
            raise ValueError(f"nothing to resume: {asked} is not released (released: {held or 'none'})")
        answers = await self.call_all(due, Endpoint.RESUME_MEMORY_OCCUPATION, {"tags": tags})
        for a in answers:
            if a.status == 200:
                txn.memory(a.worker.url, frozenset() if wanted is None else txn.released[a.worker.url] - wanted)
        self._keep()
        return answers

    async def _resume_all(self, txn: FleetTxn) -> None:
        """Give back whatever memory ``txn`` still holds released (an engine cannot serve without it)."""
        for url, tags in list(txn.released.items()):
            worker = next((w for w in txn.engines if w.url == url), None)
            if worker is None:
                continue
            (a,) = await self.call_all([worker], Endpoint.RESUME_MEMORY_OCCUPATION, {"tags": sorted(tags)})
            if a.status == 200:
                txn.memory(url, frozenset())
            else:
                log.warning("transaction %s: resume_memory_occupation %s %s", txn.id, label(worker), a.why())

    # -- the end --------------------------------------------------------------------------------------
    async def end(
        self, txn: FleetTxn, source: Mapping[str, str] | None = None, verify: VerifyMode = VerifyMode.AUTO
    ) -> None:
        """End ``txn`` as its driver meant it to end: memory given back, sessions closed, the
        engines that took every update verified (module docstring: against ``source``, the
        driver's checksums by tensor name, when it sent them) and stamped with the version, every
        engine continued, the router released (engines that missed the version out of rotation)."""
        await self._resume_all(txn)
        complete: list[Worker] = []
        if txn.moved is Moved.DISTRIBUTED:
            with txn.timed("end"):
                for a in await self._end_sessions(txn):
                    if not a.ok:
                        txn.mark(a.worker.url, Mark.PARTIAL, f"end_weight_update {a.why()}", "end")
            checked = self._to_verify(txn, source is not None, verify)
            if checked and txn.names:
                with txn.timed("verify"):
                    for url, why in (await self._verify(checked, txn.names, source, verify)).items():
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
        txn.failure = txn.failure or why
        await self._resume_all(txn)
        await self._end_sessions(txn)
        await self._close(txn, [])
        changed = [self._label_of(url) for url in txn.changed()]
        kept = [self._label_of(url) for url in txn.unchanged()]
        outcome = f"the update stopped ({why}); it is over"
        if changed:
            outcome += f": {', '.join(changed)} may hold part of it and are out of rotation until a whole update"
        if kept:
            outcome += f"; {', '.join(kept)} never changed and serve on"
        return outcome

    async def _end_sessions(self, txn: FleetTxn) -> list[WorkerAnswer]:
        if not txn.sessions:
            return []
        answers = await self.call_all((m.worker for m in txn.sessions.values()), Endpoint.END_WEIGHT_UPDATE, {})
        txn.sessions.clear()
        return answers

    async def _close(self, txn: FleetTxn, complete: list[Worker]) -> None:
        """The end every transaction shares: labels made true, every engine continued, the router
        released: ``complete`` engines hold the version, changed ones that are not leave rotation."""
        done = {w.url for w in complete}
        broken = [w for w in txn.engines if txn.may_have_changed(w.url) and w.url not in done]
        restore = [w for w in txn.engines if not txn.may_have_changed(w.url) and w.url in txn.prior]
        name = txn.version or txn.id
        reasons = {
            w.url: f"weight update {name} failed: {txn.why[w.url]}"
            if w.url in txn.why
            else f"holds part of weight update {name}, which did not finish ({txn.failure or 'its end failed'})"
            for w in broken
        }
        with txn.timed("continue"):
            labels = [(PARTIAL_LABEL + txn.id, broken)] if broken else []
            for version, group in itertools.groupby(
                sorted(restore, key=lambda w: str(txn.prior[w.url])), key=lambda w: txn.prior[w.url]
            ):
                if version is not None:
                    labels.append((version, list(group)))
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
                f"; out of rotation: {', '.join(f'{self._label_of(u)} ({r})' for u, r in reasons.items())}"
                if reasons
                else "",
                f"; kept their weights and serve on: {', '.join(self._label_of(w.url) for w in restore)}"
                if reasons and restore
                else "",
            )
        txn.move(TxnState.ENDED)
        if self.current is txn:
            self.current = None
        self._keep()
        ended = Release(txn.id, tuple(done), reasons, dict(txn.phases), moved=txn.moved is not Moved.NOTHING)
        await self.updates.release(ended, self._session())

    @staticmethod
    def _to_verify(txn: FleetTxn, sourced: bool, verify: VerifyMode) -> list[Worker]:
        """The engines whose checksums the one rule compares (module docstring): none when off;
        every taker when the driver asked for a mode; else the sims among them, and without
        the source's checksums only when every taker is a sim (a majority of all of them)."""
        takers = txn.engines_marked(Mark.TAKING)
        if verify is VerifyMode.OFF:
            return []
        if verify is not VerifyMode.AUTO:
            return takers
        members = {m.url: m for g in txn.groups.values() for m in g.members}
        sims = [w for w in takers if w.url in members and members[w.url].is_sim]
        return sims if sourced or len(sims) == len(takers) else []

    async def _verify(
        self, workers: list[Worker], names: list[str], source: Mapping[str, str] | None, verify: VerifyMode
    ) -> dict[str, str]:
        """Engines whose checksums of ``names`` differ from ``source``'s, or without it from the
        strict majority's (module docstring)."""
        mode = "full" if verify is VerifyMode.FULL else "sample"
        wanted = list(dict.fromkeys(names))
        body = {"action": "checksum", "names": wanted, "mode": mode}
        answers = await self.call_all(
            workers, Endpoint.WEIGHTS_CHECKER, body, secs=self.config.admission.request_timeout_secs
        )
        failed: dict[str, str] = {}
        sums: dict[str, list[str]] = {}
        for a in answers:
            checksums = a.body.get("checksums") if a.ok and isinstance(a.body, dict) else None
            if not isinstance(checksums, dict):
                failed[a.worker.url] = f"verify: {a.why()}"
            elif source is not None:
                bad = [n for n in wanted if checksums.get(n) != source.get(n)]
                if bad:
                    failed[a.worker.url] = f"checksum differs for {len(bad)} tensor(s), first {bad[0]}"
            else:
                sums.setdefault(repr(sorted(checksums.items())), []).append(a.worker.url)
        if len(sums) > 1:
            sides = sorted(sums.values(), key=len, reverse=True)
            best = sides[0] if len(sides[0]) > len(sides[1]) else []
            for side in sides:
                if side is not best:
                    for url in side:
                        failed[url] = (
                            f"its weights differ from {len(best) or 'every other'} engine(s)' after the update"
                        )
        return failed

    def _label_of(self, url: str) -> str:
        worker = self.registry.workers.get(url)
        return label(worker) if worker is not None else url

    # -- when the driver is gone -------------------------------------------------------------------------
    def _lapsed(self, txn_id: str | None, moved: bool, engines: tuple[str, ...], driver: Driver) -> bool:
        """No call came for ``framework_lease_secs``: the transaction ends as a failure does (its
        driver is gone). The gate stays closed until its memory is back and its engines are
        continued (``_close`` releases it); engines it may have changed leave rotation."""
        txn = self.current
        if txn is None or txn.id != txn_id:
            return False
        left = "memory released and not resumed" if txn.released else LEFT_OPEN[txn.opener]
        txn.failure = f"nothing came for {self.lease_secs:.0f}s after its driver's last call ({left})"
        self.current = None
        log.error(
            "transaction %s: %s; its engines are continued%s",
            txn.id,
            txn.failure,
            f" and {len(txn.changed())} out of rotation until a whole update" if txn.changed() else "",
        )

        async def finish() -> None:
            await self._resume_all(txn)
            await self._end_sessions(txn)
            await self._close(txn, [])

        self.spawn(finish())
        return True

    async def recover(self) -> None:
        """At the router's start: end what a transaction of a killed predecessor left (its
        engines paused, their update sessions open, memory released). Engines it may have
        changed carry its ``pdctl:`` label, which keeps them out of rotation (pdctl.router.versions)."""
        record = self.registry.kept.transaction
        if not record:
            return
        urls = [str(u) for u in record.get("engines") or []]
        workers = [self.registry.workers[u] for u in urls if u in self.registry.workers]
        log.warning(
            "transaction %s (%s) was open when the previous router stopped: ending it on %d engine(s)",
            record.get("txn"), record.get("opener"), len(workers),
        )  # fmt: skip
        released = record.get("released") or {}
        for url, tags in released.items() if isinstance(released, dict) else ():
            if url in self.registry.workers:
                await self.call_all([self.registry.workers[url]], Endpoint.RESUME_MEMORY_OCCUPATION, {"tags": tags})
        sessions = [self.registry.workers[u] for u in record.get("sessions") or [] if u in self.registry.workers]
        if sessions:
            await self.call_all(sessions, Endpoint.END_WEIGHT_UPDATE, {})
        for a in await self.call_all(workers, Endpoint.CONTINUE_GENERATION, {}):
            if not a.ok:
                log.warning("continuing %s after the previous router: %s", label(a.worker), a.why())
        self.registry.keep_transaction(None)


async def _nothing() -> list[WorkerAnswer]:
    return []
