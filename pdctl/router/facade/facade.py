"""SGLang's control routes answered by the router for the whole fleet, as if the fleet were one
engine of ``tp`` = all its engines' ranks (design.md "Driving the fleet from RL frameworks").

RL frameworks (AReaL, slime, skyrl-train) drive their engines with SGLang's own routes; pointed at
this router they drive every prefill and decode at once, and each weight update they send is the
fleet transaction a ``pdctl.weights`` push is (pdctl.router.refit): requests held, one version for
a prefill and a decode of one request, verification, an engine that failed half way out of
rotation and named in the answer, the next update making it whole.

Routes: ``/pause_generation``, ``/continue_generation``, ``/flush_cache`` (GET, POST),
``/abort_request``, ``/release_memory_occupation``, ``/resume_memory_occupation``,
``/get_weight_version``, ``/update_weight_version``, ``/update_weights_from_disk``,
``/init_weights_update_group``, ``/update_weights_from_distributed`` (both body forms),
``/destroy_weights_update_group``. Bodies, status codes and answers are SGLang 0.5.23's
(pdctl.sglang.control).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp

from pdctl.refit import DEFAULT_HOLD_TIMEOUT_SECS, Hold, RefitMode, Release
from pdctl.router.config import RouterConfig
from pdctl.router.facade.groups import FleetGroup, LayoutError, label, layout, weight_order
from pdctl.router.facade.txn import FrameworkTxn, Moved
from pdctl.router.fanout import WorkerAnswer, call_all, unreachable
from pdctl.router.fleet_weights import FleetWeights
from pdctl.router.jsonutil import loads
from pdctl.router.refit import Conflict, Driver, WeightUpdates
from pdctl.router.reply import Reply, json_reply
from pdctl.router.server import Request, Routes
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang import (
    Endpoint,
    PauseMode,
    pause_generation_body,
    supports_weight_update_session,
    update_weight_version_body,
)
from pdctl.sglang import control as sg

log = logging.getLogger("pdctl.router.facade")
audit_log = logging.getLogger("pdctl.router.audit")


CONTROL_SECS = 60.0
"""Limit on an engine's answer to a short control call (pause, continue, flush, version, begin/end)."""
INFO_SECS = 10.0

_serial = itertools.count(1)


def new_version() -> str:
    """The version a framework's update gets when it names none: SGLang would keep the old name on
    new weights, and then an engine that restarts on the old weights would look current to the
    router's version rule (pdctl.router.fleet_weights)."""
    now = time.time()
    return f"fw-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}.{int(now * 1000) % 1000:03d}-{next(_serial)}"


class SGLangFacade:
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
        ``in_flight``: the router's in-flight requests, for a hold that drains."""
        self.config = config
        self.registry = registry
        self.updates = updates
        self._session = session
        self._idle = idle
        self._in_flight = in_flight
        self.groups: dict[str, FleetGroup] = {}
        self.broken: dict[str, str] = {}
        """Group name -> why it can no longer carry updates (an engine left it mid-update)."""
        self.txn: FrameworkTxn | None = None
        self._lock = asyncio.Lock()  # calls that change the transaction, one at a time (SGLang's model update lock)
        self._tasks: set[asyncio.Task] = set()
        updates.on_lapse.append(self._lapsed)

    def add_routes(self, routes: Routes) -> None:
        handlers: dict[Endpoint, Callable[[Request], Awaitable[Reply]]] = {
            Endpoint.PAUSE_GENERATION: self.pause_generation,
            Endpoint.CONTINUE_GENERATION: self.continue_generation,
            Endpoint.FLUSH_CACHE: self.flush_cache,
            Endpoint.ABORT_REQUEST: self.abort_request,
            Endpoint.RELEASE_MEMORY_OCCUPATION: self.release_memory,
            Endpoint.RESUME_MEMORY_OCCUPATION: self.resume_memory,
            Endpoint.GET_WEIGHT_VERSION: self.get_weight_version,
            Endpoint.UPDATE_WEIGHT_VERSION: self.update_weight_version,
            Endpoint.UPDATE_WEIGHTS_FROM_DISK: self.update_from_disk,
            Endpoint.INIT_WEIGHTS_UPDATE_GROUP: self.init_group,
            Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED: self.update_from_distributed,
            Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP: self.destroy_group,
        }
        for method, endpoint in sg.CONTROL_ROUTES:
            routes.add(method, endpoint.value, _audited(method, endpoint.value, handlers[endpoint]))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- helpers ------------------------------------------------------------------------------------------
    @property
    def session(self) -> aiohttp.ClientSession:
        session = self._session()
        assert session is not None, "the router has started"
        return session

    def _label(self, url: str) -> str:
        worker = self.registry.workers.get(url)
        return label(worker) if worker is not None else url

    def _engines(self) -> list[Worker]:
        return weight_order(self.registry.workers.values())

    async def _all(
        self, workers: Iterable[Worker], endpoint: Endpoint, body: Any = None, *, secs: float = CONTROL_SECS
    ) -> list[WorkerAnswer]:
        return await call_all(self.session, list(workers), "POST", endpoint.value, body, secs)

    def _foreign(self) -> str | None:
        """Why a call that acts on the paused engines is refused: another transaction (a
        ``pdctl.weights`` push, ``pdctl weights load``) holds the router and its engines."""
        holder = self.updates.holder
        if holder is not None and (self.txn is None or self.txn.txn != holder):
            return f"weight push {holder} holds the router"
        return None

    def _renew(self, txn: FrameworkTxn) -> None:
        txn.calls += 1
        self.updates.renew(txn.txn, self.config.admission.max_hold_secs)

    def _background(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the transaction ----------------------------------------------------------------------------------
    async def _open(self, paused: PauseMode | None) -> FrameworkTxn:
        """Hold the router and pause the engines for a framework's transaction: its own pause
        (``paused``: requests wait at the router, those in flight get what the pause mode gives
        them), or an update sent with no pause (held as the topology's refit mode says, as a
        push is). Raises Conflict when a ``pdctl.weights`` transaction holds the router."""
        holder = self.updates.holder
        if holder is not None:
            raise Conflict(f"weight push {holder} holds the router")
        txn = FrameworkTxn(f"framework-{time.time_ns():x}", paused, tuple(self._engines()))
        refit = self.config.refit
        if paused is not None:
            gate = (
                RefitMode.INTERRUPT if refit is RefitMode.INTERRUPT and paused is PauseMode.ABORT else RefitMode.DRAIN
            )
            engine_mode = paused
        else:
            gate = refit
            engine_mode = PauseMode.ABORT if refit is RefitMode.INTERRUPT else PauseMode.RETRACT
        hold = Hold(
            txn=txn.txn,
            engines=tuple(w.url for w in txn.engines),
            lease_secs=self.config.admission.max_hold_secs,
            timeout_secs=DEFAULT_HOLD_TIMEOUT_SECS,
            refit=gate,
            max_staleness=self.config.max_staleness,
        )
        started = time.monotonic()
        _, ready = await self.updates.hold(
            hold, idle=self._idle, in_flight=self._in_flight, record=False, driver=Driver.FRAMEWORK, wait=paused is None
        )
        if not ready:
            await self.updates.release(Release(txn=txn.txn), self._session())
            raise Conflict(f"requests in flight did not finish within {DEFAULT_HOLD_TIMEOUT_SECS:.0f}s (refit drain)")
        self.txn = txn
        answers = await self._all(txn.engines, Endpoint.PAUSE_GENERATION, pause_generation_body(engine_mode))
        for a in answers:
            if not a.ok:
                log.warning("framework pause: %s %s (it pauses no request)", label(a.worker), a.why())
        txn.timed("pause", time.monotonic() - started)
        log.info(
            "framework transaction %s: %s, %d engine(s) paused (%s)",
            txn.txn,
            f"paused ({paused.value})" if paused else "an update with no pause",
            len(txn.engines),
            engine_mode.value,
        )
        return txn

    async def _end_implicit(self) -> None:
        """The framework moved on to another kind of call: an implicit transaction ends here."""
        if self.txn is not None and self.txn.implicit:
            await self._finish(self.txn)

    async def _finish(self, txn: FrameworkTxn) -> None:
        """End ``txn``: close the engines' update sessions, set the version on those that took
        every update, verify them, continue every engine, release the router."""
        failed = dict(txn.failed)
        complete: list[str] = []
        if txn.moved is Moved.DISTRIBUTED and txn.broke is not None:
            # The framework's update stopped part way: whoever took part of it holds a mix of
            # versions; engines it never reached keep their weights and version.
            for url in txn.took:
                failed.setdefault(url, f"holds part of an update that did not finish ({txn.broke})")
            if txn.begun:
                await self._all((m.worker for m in txn.begun.values()), Endpoint.END_WEIGHT_UPDATE, {})
        elif txn.moved is Moved.DISTRIBUTED:
            members = txn.members()
            started = time.monotonic()
            for a in await self._all((m.worker for m in txn.begun.values()), Endpoint.END_WEIGHT_UPDATE, {}):
                if not a.ok:
                    failed.setdefault(a.worker.url, f"end_weight_update {a.why()}")
            txn.timed("end", time.monotonic() - started)
            whole = [m for url, m in members.items() if url not in failed]
            if all(m.is_sim for m in members.values()) and whole and txn.names:
                started = time.monotonic()
                failed.update(await self._verify([m.worker for m in whole], txn.names))
                txn.timed("verify", time.monotonic() - started)
            version = txn.version or new_version()
            txn.version = version
            if self.updates.last is not None and self.updates.last.txn == txn.txn:
                self.updates.last.version = version
            started = time.monotonic()
            stamped = [m.worker for m in whole if m.url not in failed]
            for a in await self._all(stamped, Endpoint.UPDATE_WEIGHT_VERSION, update_weight_version_body(version)):
                if a.ok:
                    complete.append(a.worker.url)
                else:
                    failed.setdefault(a.worker.url, f"update_weight_version {a.why()}")
            txn.timed("version", time.monotonic() - started)
        elif txn.moved is Moved.DISK:
            complete = [url for url in txn.loaded if url not in failed]
        started = time.monotonic()
        for a in await self._all(txn.engines, Endpoint.CONTINUE_GENERATION, {}):
            if not a.ok:
                log.warning("framework transaction %s: continue %s: %s", txn.txn, label(a.worker), a.why())
        txn.timed("continue", time.monotonic() - started)
        if txn.moved is not Moved.NOTHING:
            reasons = {url: f"framework weight update {txn.version} failed: {why}" for url, why in failed.items()}
            log.info(
                "framework transaction %s ended: version %s on %d engine(s)%s",
                txn.txn,
                txn.version,
                len(complete),
                f"; out of rotation: {', '.join(reasons)}" if reasons else "",
            )
        else:
            reasons = {}
        self.txn = None
        await self.updates.release(Release(txn.txn, tuple(complete), reasons, dict(txn.phases)), self._session())

    async def _verify(self, workers: list[Worker], names: list[str]) -> dict[str, str]:
        """Engines whose checksums of ``names`` differ from the others' (the sim's
        ``/weights_checker``; every member received the same broadcasts). The larger side wins;
        a tie fails everyone (nobody can tell which is right)."""
        body = {"action": "checksum", "names": list(dict.fromkeys(names)), "mode": "sample"}
        answers = await self._all(
            workers, Endpoint.WEIGHTS_CHECKER, body, secs=self.config.admission.request_timeout_secs
        )
        failed: dict[str, str] = {}
        sums: dict[str, list[str]] = {}
        for a in answers:
            checksums = a.body.get("checksums") if a.ok and isinstance(a.body, dict) else None
            if not isinstance(checksums, dict):
                failed[a.worker.url] = f"verify: {a.why()}"
                continue
            key = repr(sorted(checksums.items()))
            sums.setdefault(key, []).append(a.worker.url)
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

    def _lapsed(self, txn_id: str | None, moved: bool, engines: tuple[str, ...], driver: Driver) -> None:
        """A framework's transaction was not renewed for ``--max-hold-secs``: the router already let
        requests in again (and took the engines out of rotation when weights had moved); its
        engines are continued here so that none stays paused."""
        txn = self.txn
        if txn is None or txn.txn != txn_id:
            return
        self.txn = None
        log.error(
            "framework transaction %s: nothing came for %.0fs after its last call (%s); its engines are continued%s",
            txn.txn,
            self.config.admission.max_hold_secs,
            "a pause with no continue" if txn.paused else "an update with no end",
            " and out of rotation until a later update makes them whole" if moved else "",
        )

        async def continue_all() -> None:
            if txn.begun:
                await self._all((m.worker for m in txn.begun.values()), Endpoint.END_WEIGHT_UPDATE, {})
            await self._all(txn.engines, Endpoint.CONTINUE_GENERATION, {})

        self._background(continue_all())

    # -- pause / continue ----------------------------------------------------------------------------
    async def pause_generation(self, request: Request) -> Reply:
        try:
            mode = sg.pause_mode(_body(request))
        except ValueError as exc:
            return _error(400, str(exc))
        async with self._lock:
            await self._end_implicit()
            txn = self.txn
            if txn is None:
                try:
                    await self._open(mode)
                except Conflict as exc:
                    return _error(409, str(exc))
            else:  # paused again (perhaps in another mode): the engines take it, the transaction goes on
                self._renew(txn)
                txn.paused = txn.paused or mode
                await self._all(txn.engines, Endpoint.PAUSE_GENERATION, pause_generation_body(mode))
        return json_reply(sg.PAUSED)

    async def continue_generation(self, request: Request) -> Reply:
        async with self._lock:
            txn = self.txn
            foreign = self._foreign()
            if foreign is not None:
                return _error(409, foreign)
            if txn is None:
                await self._all(self._engines(), Endpoint.CONTINUE_GENERATION, {})
            else:
                await self._finish(txn)
        return json_reply(sg.CONTINUED)

    # -- caches, aborts, memory ---------------------------------------------------------------------------
    async def flush_cache(self, request: Request) -> Reply:
        """200 only when every engine flushed (SGLang's 400 while requests are running)."""
        async with self._lock:
            await self._end_implicit()
            if self.txn is not None:
                self._renew(self.txn)
            method = request.method
            answers = await call_all(
                self.session, self._engines(), method, Endpoint.FLUSH_CACHE.value, None, CONTROL_SECS
            )
        failed = [f"{label(a.worker)} {a.why()}" for a in answers if a.status != 200]
        if failed:
            return json_reply({"status": "failed", "message": f"flush failed on {'; '.join(failed)}"}, 400)
        return json_reply(
            {"status": "success", "message": f"Successfully flushed cache on all {len(answers)} HTTP workers"}
        )

    async def abort_request(self, request: Request) -> Reply:
        try:
            body = dict(sg.as_object(_body(request)))
        except ValueError as exc:
            return _error(400, str(exc))
        answers = await self._all(self._engines(), Endpoint.ABORT_REQUEST, body)
        if answers and not any(a.reached for a in answers):
            return _error(502, "no engine answered: " + "; ".join(f"{label(a.worker)} {a.why()}" for a in answers))
        return Reply(200, b"", "text/plain")

    async def release_memory(self, request: Request) -> Reply:
        return await self._memory(request, Endpoint.RELEASE_MEMORY_OCCUPATION)

    async def resume_memory(self, request: Request) -> Reply:
        return await self._memory(request, Endpoint.RESUME_MEMORY_OCCUPATION)

    async def _memory(self, request: Request, endpoint: Endpoint) -> Reply:
        try:
            tags = sg.memory_tags(_body(request))
        except ValueError as exc:
            return _error(400, str(exc))
        foreign = self._foreign()
        if foreign is not None:
            return _error(409, foreign)
        if self.txn is not None:
            self._renew(self.txn)
        answers = await self._all(self._engines(), endpoint, {"tags": tags})
        failed = [f"{label(a.worker)} {a.why()}" for a in answers if a.status != 200]
        if failed:
            return _error(400, f"{endpoint.value.lstrip('/')} failed on {'; '.join(failed)}")
        return Reply(200, b"null")

    # -- versions --------------------------------------------------------------------------------------
    async def get_weight_version(self, request: Request) -> Reply:
        """``{"weight_version"}`` when every engine that answers agrees (read from their
        ``/model_info``: SGLang 0.5.18 and later have no ``/get_weight_version``); 409 with each
        engine's version when they differ."""
        async with self._lock:
            await self._end_implicit()
        engines = self._engines()
        answers = await call_all(self.session, engines, "GET", Endpoint.MODEL_INFO.value, None, INFO_SECS)
        versions = {a.worker.url: a.body.get("weight_version") for a in answers if a.ok and isinstance(a.body, dict)}
        if not versions:
            return _error(503, "no engine answered /model_info")
        held = set(versions.values())
        if len(held) == 1:
            return json_reply({"weight_version": held.pop()})
        return json_reply(
            {
                "error": {
                    "message": f"the fleet's engines hold {len(held)} weight versions",
                    "type": "conflict",
                    "code": "weight_versions_differ",
                },
                "weight_versions": versions,
            },
            409,
        )

    async def update_weight_version(self, request: Request) -> Reply:
        try:
            body = sg.as_object(_body(request))
            version = sg.text(body, "new_version")
            abort_all = sg.flag(body, "abort_all_requests", True)
        except ValueError as exc:
            return _fail(400, str(exc))
        async with self._lock:
            await self._end_implicit()
            txn = self.txn
            foreign = self._foreign()
            if foreign is not None:
                return _fail(409, foreign)
            self.registry.updating = True  # engines' versions change under the liveness probes meanwhile
            try:
                answers = await self._all(
                    self._engines(),
                    Endpoint.UPDATE_WEIGHT_VERSION,
                    {"new_version": version, "abort_all_requests": abort_all},
                )
            finally:
                self.registry.updating = txn is not None and txn.moved is not Moved.NOTHING
            failed = [f"{label(a.worker)} {a.why()}" for a in answers if not a.ok]
            if txn is not None:
                self._renew(txn)
                txn.version = version
            elif not failed:
                fleet = self.registry.fleet
                self.registry.set_fleet(FleetWeights(version, fleet.source if fleet else None))
        if failed:
            return _fail(400, f"Failed to update weight version on {'; '.join(failed)}")
        return json_reply({"success": True, "message": f"Weight version updated to {version}", "new_version": version})

    # -- updates -------------------------------------------------------------------------------------------
    async def update_from_disk(self, request: Request) -> Reply:
        """The fleet transaction of ``pdctl weights load``: every engine loads ``model_path``; one
        that refuses keeps its weights and version (and stays in rotation), one that does not
        answer leaves rotation; the version is set only on those that loaded."""
        try:
            disk = sg.DiskUpdate.from_body(_body(request))
        except ValueError as exc:
            return _fail(400, f"update_weights_from_disk: {exc}", num_paused_requests=0)
        async with self._lock:
            if self.txn is not None and self.txn.moved is not Moved.NOTHING:
                if self.txn.implicit:
                    await self._end_implicit()
                else:
                    return _fail(409, _moved_already(self.txn), num_paused_requests=0)
            txn = self.txn
            try:
                txn = txn if txn is not None else await self._open(None)
            except Conflict as exc:
                return _fail(409, str(exc), num_paused_requests=0)
            self._renew(txn)
            version = disk.weight_version or txn.version or new_version()
            txn.version, txn.source, txn.moved = version, disk.model_path, Moved.DISK
            self.updates.moving(txn.txn)
            self.updates.start_record(txn.txn, version, disk.model_path, self.config.refit, None, Driver.FRAMEWORK)
            self.registry.updating = True
            started = time.monotonic()
            timeout = self.config.admission.request_timeout_secs
            answers = await self._all(txn.engines, Endpoint.UPDATE_WEIGHTS_FROM_DISK, disk.to_body(None), secs=timeout)
            txn.timed("transfer", time.monotonic() - started)
            loaded = []
            for a in answers:
                if a.ok:
                    loaded.append(a.worker)
                elif a.reached:
                    txn.refused[a.worker.url] = a.why()
                else:
                    txn.failed[a.worker.url] = f"load: {a.why()}"
            started = time.monotonic()
            for a in await self._all(loaded, Endpoint.UPDATE_WEIGHT_VERSION, update_weight_version_body(version)):
                if not a.ok:
                    txn.failed[a.worker.url] = f"loaded, but update_weight_version {a.why()}"
            txn.timed("version", time.monotonic() - started)
            txn.loaded = tuple(w.url for w in loaded if w.url not in txn.failed)
            problems = {**txn.refused, **txn.failed}
            if txn.implicit:
                await self._finish(txn)
        if problems:
            named = "; ".join(f"{self._label(u)}: {why}" for u, why in problems.items())
            return _fail(
                400, f"Failed to update model weights on {len(problems)} engine(s): {named}", num_paused_requests=0
            )
        return json_reply({"success": True, "message": sg.UPDATED_FROM_DISK, "num_paused_requests": 0})

    async def init_group(self, request: Request) -> Reply:
        """Every engine joins ``group_name``, engine j at R0 + the ranks of the engines before it;
        answered when they all have joined, which is when the framework's own rank 0 has (bounded
        by the engines' rendezvous timeout and ``--request-timeout-secs``)."""
        try:
            spec = sg.InitGroup.from_body(_body(request))
        except ValueError as exc:
            return _fail(400, f"init_weights_update_group: {exc}")
        async with self._lock:
            await self._end_implicit()
        engines = self._engines()
        infos = await call_all(self.session, engines, "GET", Endpoint.SERVER_INFO.value, None, INFO_SECS)
        silent = [f"{label(a.worker)} {a.why()}" for a in infos if not (a.ok and isinstance(a.body, dict))]
        if silent:
            return _fail(400, f"Failed to initialize custom process group: /server_info of {'; '.join(silent)}")
        try:
            members = layout(spec, engines, {a.worker.url: a.body for a in infos})
        except LayoutError as exc:
            return _fail(400, f"Failed to initialize custom process group: {exc}")
        log.info(
            "joining weight group %s (world %d): %s",
            spec.group_name,
            spec.world_size,
            ", ".join(f"{label(m.worker)} ranks {m.rank_offset}..{m.rank_offset + m.ranks - 1}" for m in members),
        )
        timeout = self.config.admission.request_timeout_secs
        answers = await asyncio.gather(
            *(
                call_all(
                    self.session,
                    [m.worker],
                    "POST",
                    Endpoint.INIT_WEIGHTS_UPDATE_GROUP.value,
                    spec.to_body(m.rank_offset),
                    timeout,
                )
                for m in members
            )
        )
        flat = [a[0] for a in answers]
        failed = [f"{label(a.worker)} {a.why()}" for a in flat if not a.ok]
        if failed:
            joined = [a.worker for a in flat if a.ok]
            await self._all(joined, Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP, {"group_name": spec.group_name})
            return _fail(400, f"Failed to initialize custom process group on {'; '.join(failed)}")
        self.groups[spec.group_name] = FleetGroup(spec, members)
        self.broken.pop(spec.group_name, None)
        return json_reply({"success": True, "message": sg.GROUP_INITIALIZED})

    async def destroy_group(self, request: Request) -> Reply:
        try:
            name = sg.group_name(_body(request))
        except ValueError as exc:
            return _fail(400, str(exc))
        async with self._lock:
            await self._end_implicit()
            group = self.groups.pop(name, None)
            self.broken.pop(name, None)
        if group is None:
            return _fail(400, sg.NO_GROUP_TO_DESTROY)
        answers = await self._all(
            (m.worker for m in group.members), Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP, {"group_name": name}
        )
        # An engine that restarted since (its group is gone with its old process) or is down has nothing to destroy.
        failed = [
            f"{label(a.worker)} {a.why()}"
            for a in answers
            if a.reached and not a.ok and sg.NO_GROUP_TO_DESTROY not in a.why()
        ]
        if failed:
            return _fail(400, f"Failed to destroy custom process group on {'; '.join(failed)}")
        return json_reply({"success": True, "message": sg.GROUP_DESTROYED})

    async def update_from_distributed(self, request: Request) -> Reply:
        """One update call sent to every engine of the group at once (they all take part in the
        framework's one broadcast), answered when all have answered. The first opens the fleet
        transaction if the framework did not pause first."""
        try:
            update = sg.DistributedUpdate.from_body(_body(request))
        except ValueError as exc:
            return _fail(400, f"update_weights_from_distributed: {exc}")
        async with self._lock:
            group = self.groups.get(update.group_name)
            if group is None:
                return _fail(400, sg.missing_group(update.group_name, list(self.groups)))
            if update.group_name in self.broken:
                why = self.broken[update.group_name]
                return _fail(
                    400,
                    f"Failed to receive weights: group {update.group_name} is broken ({why}); "
                    "destroy it and init it again",
                )
            txn = self.txn
            if txn is not None and txn.moved is Moved.DISK:
                return _fail(409, _moved_already(txn))
            try:
                txn = txn if txn is not None else await self._open(None)
            except Conflict as exc:
                return _fail(409, str(exc))
            self._renew(txn)
            if txn.moved is Moved.NOTHING:
                await self._begin(txn)
            if update.group_name not in txn.groups:
                txn.groups[update.group_name] = group
                await self._begin_sessions(txn, group)
            started = time.monotonic()
            workers = [m.worker for m in group.members]
            # A dead engine is found before anything is sent: the others never enter a broadcast
            # that cannot complete (its ranks are gone), so they stay whole and serve on.
            dead = await unreachable(workers)
            if dead:
                for url, why in dead.items():
                    txn.failed.setdefault(url, why)
                named = "; ".join(f"{self._label(url)}: {why}" for url, why in dead.items())
                self.broken[update.group_name] = f"{named} left it"
                txn.broke = txn.broke or f"an update over {update.group_name} could not reach {named}"
                self._renew(txn)
                return _fail(400, f"Failed to update parameter online: {named}; nothing was sent to the other engines")
            timeout = self.config.admission.request_timeout_secs
            body = update.to_body(flush_cache=False, weight_version=None)
            answers = await self._all(workers, Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED, body, secs=timeout)
            txn.timed("transfer", time.monotonic() - started)
            txn.names.extend(update.names)
            if update.weight_version is not None:
                txn.version = update.weight_version
            failed = {a.worker.url: a for a in answers if not a.ok}
            for a in answers:  # a failed answer may still have left part of this bucket behind
                txn.took[a.worker.url] = txn.took.get(a.worker.url, 0) + 1
            for url, a in failed.items():
                txn.failed.setdefault(url, f"update_weights_from_distributed {a.why()}")
            if failed:
                first = next(iter(failed.values()))
                txn.broke = txn.broke or f"{label(first.worker)} failed an update ({first.why()})"
            gone = [a for a in failed.values() if not a.reached]
            if gone:  # its ranks left the group: no later broadcast over it can complete
                self.broken[update.group_name] = f"{label(gone[0].worker)} did not answer an update ({gone[0].why()})"
            self._renew(txn)
        if failed:
            named = "; ".join(f"{label(a.worker)} {a.why()}" for a in failed.values())
            return _fail(
                400, f"Failed to update parameter online on {len(failed)} of {len(answers)} engine(s): {named}"
            )
        return json_reply({"success": True, "message": sg.UPDATED_ONLINE})

    async def _begin(self, txn: FrameworkTxn) -> None:
        """Weights are about to move: the push record starts and the engines' caches are flushed
        (nothing runs on them until the transaction ends, so no prefix computed on the old weights
        survives it)."""
        txn.moved = Moved.DISTRIBUTED
        self.updates.moving(txn.txn)
        group_json = None
        self.updates.start_record(txn.txn, None, None, self.config.refit, group_json, Driver.FRAMEWORK)
        self.registry.updating = True
        started = time.monotonic()
        for a in await call_all(self.session, txn.engines, "POST", Endpoint.FLUSH_CACHE.value, None, CONTROL_SECS):
            if a.status != 200:
                log.warning(
                    "framework update: %s kept its cache (%s); stale prefixes may be reused", label(a.worker), a.why()
                )
        txn.timed("pause", time.monotonic() - started)

    async def _begin_sessions(self, txn: FrameworkTxn, group: FleetGroup) -> None:
        """SGLang 0.5.21+ takes distributed updates only inside a weight-update session, which
        frameworks written for older SGLang never open: opened here for them."""
        if self.updates.last is not None and self.updates.last.txn == txn.txn and self.updates.last.group is None:
            self.updates.last.group = group.to_json()
        due = [m for m in group.members if m.url not in txn.begun and supports_weight_update_session(m.sglang_version)]
        if not due:
            return
        started = time.monotonic()
        answers = await self._all((m.worker for m in due), Endpoint.BEGIN_WEIGHT_UPDATE, {"selector": "all"})
        for m, a in zip(due, answers, strict=True):
            if a.ok:
                txn.begun[m.url] = m
            else:
                txn.failed.setdefault(m.url, f"begin_weight_update {a.why()}")
        txn.timed("begin", time.monotonic() - started)


def _moved_already(txn: FrameworkTxn) -> str:
    return (
        f"weights already moved {txn.moved.value} in this transaction ({txn.txn}); "
        "/continue_generation ends it before another kind of update"
    )


def _body(request: Request) -> Any:
    """The request's JSON body (an empty body is None); ValueError for bytes that are not JSON."""
    if not request.body.strip():
        return None
    try:
        return loads(request.body)
    except ValueError as exc:
        raise ValueError(f"invalid JSON body: {exc}") from None


def _fail(status: int, message: str, **extra: Any) -> Reply:
    """SGLang's answer of a failed weight route: ``{"success": false, "message"}``."""
    return json_reply({"success": False, "message": message, **extra}, status)


def _error(status: int, message: str) -> Reply:
    """SGLang's error body of its other routes: ``{"error": {"message"}}``."""
    return json_reply({"error": {"message": message}}, status)


def _audited(
    method: str, path: str, handler: Callable[[Request], Awaitable[Reply]]
) -> Callable[[Request], Awaitable[Reply]]:
    """Every facade call leaves an audit line (route and outcome; the key check has logged who)."""

    async def audited(request: Request) -> Reply:
        try:
            reply = await handler(request)
        except ValueError as exc:  # a body that is not JSON
            reply = _error(400, str(exc))
        audit_log.info("sglang_control method=%s path=%s status=%d", method, path, reply.status)
        return reply

    return audited
