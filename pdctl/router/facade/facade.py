"""SGLang's control routes answered by the router for the whole fleet, as if the fleet were one
engine of ``tp`` = all its engines' ranks (design.md "Driving the fleet from RL frameworks").

RL frameworks (AReaL, slime, skyrl-train) drive their engines with SGLang's own routes; pointed at
this router they drive every prefill and decode at once. Each route here is a thin adapter: it
reads SGLang's body (pdctl.sglang.control), checks it against the weight groups the fleet joined
(``GroupBook``) and hands the work to the router's one fleet transaction
(pdctl.router.transaction), answering as SGLang 0.5.23 answers. A failed answer also carries its
message as the HTTP reason phrase, for clients that print only that (AReaL).

Routes: ``/pause_generation``, ``/continue_generation``, ``/flush_cache`` (GET, POST),
``/abort_request``, ``/release_memory_occupation``, ``/resume_memory_occupation``,
``/get_weight_version``, ``/update_weight_version``, ``/update_weights_from_disk``,
``/init_weights_update_group``, ``/update_weights_from_distributed`` (both body forms),
``/destroy_weights_update_group``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pdctl.refit import TXN_HEADER
from pdctl.router.config import RouterConfig
from pdctl.router.fanout import call_all
from pdctl.router.jsonutil import loads
from pdctl.router.reply import Reply, json_reply
from pdctl.router.server import Request, Routes
from pdctl.router.transaction import FleetTransactions, FleetTxn, Moved, Opener, UpdateFailed
from pdctl.router.transaction.groups import FleetGroup, GroupBook, LayoutError, label, label_of, layout
from pdctl.router.updates import Conflict
from pdctl.sglang import Endpoint
from pdctl.sglang import control as sg

log = logging.getLogger("pdctl.router.facade")
audit_log = logging.getLogger("pdctl.router.audit")

INFO_SECS = 10.0


class SGLangFacade:
    """SGLang's control routes for the whole fleet (module docstring). One call that changes the
    transaction runs at a time (``FleetTransactions.lock``: SGLang's model update lock)."""

    def __init__(self, config: RouterConfig, txns: FleetTransactions):
        self.config = config
        self.txns = txns
        self.book = GroupBook()

    def add_routes(self, routes: Routes) -> None:
        """Register every SGLang control route (``sg.CONTROL_ROUTES``) on ``routes``, each audited."""
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

    async def _end_implicit(self) -> None:
        """The framework moved on to another kind of call: a transaction the router opened for an
        update ends here (one that holds released memory waits for its resume)."""
        txn = self.txns.current
        if txn is not None and txn.opener is Opener.UPDATE and not txn.released:
            await self.txns.end(txn)

    # -- pause / continue ----------------------------------------------------------------------------
    async def pause_generation(self, request: Request) -> Reply:
        """Every engine pauses in the body's mode; new requests wait at the router until the
        framework's continue, or until it has sent nothing for ``framework_lease_secs``."""
        try:
            mode = sg.pause_mode(_body(request))
        except ValueError as exc:
            return _error(400, str(exc))
        async with self.txns.lock:
            if foreign := self.txns.holder.foreign(_caller(request)):
                return _error(409, foreign)
            await self._end_implicit()
            txn = self.txns.current
            try:
                if txn is None:
                    await self.txns.open(Opener.PAUSE, mode)
                else:
                    async with self.txns.call(txn):
                        await self.txns.pause_again(txn, mode)
            except Conflict as exc:
                return _error(409, str(exc))
        return json_reply(sg.PAUSED)

    async def continue_generation(self, request: Request) -> Reply:
        """Ends the transaction (pdctl.router.transaction ``end``); with none open, every engine
        is continued (SGLang's continue of an engine that is not paused does nothing)."""
        async with self.txns.lock:
            if foreign := self.txns.holder.foreign(_caller(request)):
                return _error(409, foreign)
            txn = self.txns.current
            if txn is None:
                await self.txns.call_all(self.txns.engines(), Endpoint.CONTINUE_GENERATION, {})
            else:
                async with self.txns.call(txn):
                    await self.txns.end(txn)
        return json_reply(sg.CONTINUED)

    # -- caches, aborts, memory ---------------------------------------------------------------------------
    async def flush_cache(self, request: Request) -> Reply:
        """200 only when every engine flushed (SGLang's 400 while requests are running)."""
        async with self.txns.lock:
            if pushing := self.txns.holder.pushing(_caller(request)):
                return _error(409, pushing)
            await self._end_implicit()
            txn = self.txns.current
            if txn is not None:
                self.txns.renew(txn)
            answers = await call_all(
                self.txns.session, self.txns.engines(), request.method, Endpoint.FLUSH_CACHE.value, None
            )
        failed = [f"{label(a.worker)} {a.why()}" for a in answers if a.status != 200]
        if failed:
            return json_reply({"status": "failed", "message": f"flush failed on {'; '.join(failed)}"}, 400)
        return json_reply(
            {"status": "success", "message": f"Successfully flushed cache on all {len(answers)} HTTP workers"}
        )

    async def abort_request(self, request: Request) -> Reply:
        """Pass the body's abort on to every engine; 200 with an empty body when at least one was reached, 502 when none
        answered, 409 while a push holds the router, 400 for a body that is not an object."""
        try:
            body = dict(sg.as_object(_body(request)))
        except ValueError as exc:
            return _error(400, str(exc))
        if pushing := self.txns.holder.pushing(_caller(request)):
            return _error(409, pushing)
        answers = await self.txns.call_all(self.txns.engines(), Endpoint.ABORT_REQUEST, body)
        if answers and not any(a.reached for a in answers):
            return _error(502, "no engine answered: " + "; ".join(f"{label(a.worker)} {a.why()}" for a in answers))
        return Reply(200, b"", "text/plain")

    async def release_memory(self, request: Request) -> Reply:
        """Every engine releases the tags' memory. SGLang releases only an idle engine and serves
        nothing well without its memory: the router holds new requests and pauses the engines
        first (a transaction of its own when the framework did not pause), until every tag is
        resumed or the framework sends nothing for ``framework_lease_secs``; then the memory is
        given back and requests flow."""
        try:
            tags = sg.memory_tags(_body(request), required=True)
        except ValueError as exc:
            return _error(400, str(exc))
        async with self.txns.lock:
            if foreign := self.txns.holder.foreign(_caller(request)):
                return _error(409, foreign)
            await self._end_implicit()
            try:
                txn = self.txns.current or await self.txns.open(Opener.MEMORY, None)
            except Conflict as exc:
                return _error(409, str(exc))
            async with self.txns.call(txn):
                try:
                    answers = await self.txns.on_engines.release_memory(txn, tags)
                except ValueError as exc:
                    return _error(400, str(exc))
        failed = [f"{label(a.worker)} {a.why()}" for a in answers if a.status != 200]
        if failed:
            return _error(400, f"release_memory_occupation failed on {'; '.join(failed)}")
        return Reply(200, b"null")

    async def resume_memory(self, request: Request) -> Reply:
        """Every engine resumes the tags' memory; a transaction the router opened for a memory release ends once
        no memory is left released and no weights moved. 400 with no transaction open, for a bad body or when an
        engine failed; 409 while another driver holds the router."""
        try:
            tags = sg.memory_tags(_body(request), required=True)
        except ValueError as exc:
            return _error(400, str(exc))
        async with self.txns.lock:
            if foreign := self.txns.holder.foreign(_caller(request)):
                return _error(409, foreign)
            txn = self.txns.current
            if txn is None:
                return _error(400, "nothing to resume: no memory of this fleet is released")
            async with self.txns.call(txn):
                try:
                    answers = await self.txns.on_engines.resume_memory(txn, tags)
                except ValueError as exc:
                    return _error(400, str(exc))
                if txn.opener is Opener.MEMORY and not txn.released and txn.moved is Moved.NOTHING:
                    await self.txns.end(txn)
        failed = [f"{label(a.worker)} {a.why()}" for a in answers if a.status != 200]
        if failed:
            return _error(400, f"resume_memory_occupation failed on {'; '.join(failed)}")
        return Reply(200, b"null")

    # -- versions --------------------------------------------------------------------------------------
    async def get_weight_version(self, request: Request) -> Reply:
        """``{"weight_version"}`` when every engine that answers agrees (read from their
        ``/model_info``: SGLang 0.5.18 and later have no ``/get_weight_version``); 409 with each
        engine's version when they differ."""
        async with self.txns.lock:
            await self._end_implicit()
        answers = await call_all(
            self.txns.session, self.txns.engines(), "GET", Endpoint.MODEL_INFO.value, None, INFO_SECS
        )
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
        """Every engine's label, and, outside a transaction, the fleet's version; inside one, the
        version its end stamps on the engines that took the update."""
        try:
            body = sg.as_object(_body(request))
            version = sg.text(body, "new_version")
            abort_all = sg.flag(body, "abort_all_requests", True)
        except ValueError as exc:
            return _fail(400, str(exc))
        async with self.txns.lock:
            await self._end_implicit()
            if foreign := self.txns.holder.foreign(_caller(request)):
                return _fail(409, foreign)
            txn = self.txns.current
            if txn is not None and txn.moved is not Moved.NOTHING:
                txn.version = version  # stamped at its end, on the engines that took it whole
                self.txns.renew(txn)
                return json_reply(
                    {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
                )
            answers = await self.txns.call_all(
                self.txns.engines(),
                Endpoint.UPDATE_WEIGHT_VERSION,
                {"new_version": version, "abort_all_requests": abort_all},
            )
            self.txns.registry.relabelled([a.worker for a in answers if a.ok], version)
            failed = [f"{label(a.worker)} {a.why()}" for a in answers if not a.ok]
            if not failed:
                self.txns.updates.set_fleet_version(version)
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
        async with self.txns.lock:
            if foreign := self.txns.holder.foreign(_caller(request)):
                return _fail(409, foreign, num_paused_requests=0)
            txn = self.txns.current
            if txn is not None and txn.moved is Moved.DISTRIBUTED:
                if txn.opener is not Opener.UPDATE:
                    return _fail(409, _moved_already(txn), num_paused_requests=0)
                await self.txns.end(txn)
                txn = None
            try:
                txn = txn or await self.txns.open(Opener.UPDATE, None)
            except Conflict as exc:
                return _fail(409, str(exc), num_paused_requests=0)
            async with self.txns.call(txn):
                problems = await self.txns.load(txn, disk)
                if txn.implicit and not txn.released:
                    await self.txns.end(txn)
        if problems:
            named = "; ".join(f"{label_of(self.txns.registry, u)}: {why}" for u, why in problems.items())
            return _fail(
                400, f"Failed to update model weights on {len(problems)} engine(s): {named}", num_paused_requests=0
            )
        return json_reply({"success": True, "message": sg.UPDATED_FROM_DISK, "num_paused_requests": 0})

    async def init_group(self, request: Request) -> Reply:
        """Every engine joins ``group_name``, engine j at R0 + the ranks of the engines before it;
        answered when they all have joined, which is when the framework's own rank 0 has (bounded
        by the engines' rendezvous timeout and ``--request-timeout-secs``)."""
        try:
            body = _body(request)
            spec = sg.InitGroup.from_body(body)
            only = _engine_urls(body)
        except ValueError as exc:
            return _fail(400, f"init_weights_update_group: {exc}")
        async with self.txns.lock:
            if pushing := self.txns.holder.pushing(_caller(request)):
                return _fail(409, pushing)
            await self._end_implicit()
            txn = self.txns.current
        if txn is None:
            return await self._init_group(spec, only)
        async with self.txns.call(txn):  # the framework's rendezvous may take a while: no lapse under it
            return await self._init_group(spec, only)

    async def _init_group(self, spec: sg.InitGroup, only: frozenset[str] | None) -> Reply:
        """``only``: the engines (URLs) to join, every engine of the router when None (a push
        leaves out those that do not answer, as ``pdctl.weights`` has always done)."""
        old = self.book.pop(spec.group_name)
        if old is not None:
            # A framework that joins a name again has left the old group (AReaL retries a failed
            # update so, and has no destroy): SGLang refuses a second group of one name, so the
            # old one goes first; an engine that restarted since has none to destroy.
            await self.txns.call_all(
                (m.worker for m in old.members), Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP, {"group_name": spec.group_name}
            )
        engines = self.txns.engines()
        if only is not None:
            unknown = sorted(only - {w.url for w in engines})
            if unknown:
                return _fail(400, f"Failed to initialize custom process group: not engines of this router: {unknown}")
            engines = [w for w in engines if w.url in only]
        infos = await call_all(self.txns.session, engines, "GET", Endpoint.SERVER_INFO.value, None, INFO_SECS)
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
                    self.txns.session,
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
            await self.txns.call_all(joined, Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP, {"group_name": spec.group_name})
            return _fail(
                400,
                f"Failed to initialize custom process group on {'; '.join(failed)}",
                engines={a.worker.url: a.why() for a in flat if not a.ok},
            )
        self.book.add(FleetGroup(spec, members))
        return json_reply({"success": True, "message": sg.GROUP_INITIALIZED})

    async def destroy_group(self, request: Request) -> Reply:
        """A body with no ``group_name`` (or none at all: skyrl-train's) means the fleet's default
        or only group (``GroupBook.resolve``)."""
        try:
            name = self.book.resolve(sg.named_group(_body(request)))
        except (ValueError, LayoutError) as exc:
            return _fail(400, str(exc))
        async with self.txns.lock:
            if pushing := self.txns.holder.pushing(_caller(request)):
                return _fail(409, pushing)
            await self._end_implicit()
            group = self.book.pop(name)
        if group is None:
            return _fail(400, sg.NO_GROUP_TO_DESTROY)
        answers = await self.txns.call_all(
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
        transaction if the framework did not pause first. A failure ends the transaction at once
        (pdctl.router.transaction ``fail``; a push's stays open for its trainer to redo or abort)
        and the answer says what each engine holds (``engines``: URL -> why; ``left``: those that
        gave no answer, the likely cause of the others' failures)."""
        try:
            update = sg.DistributedUpdate.from_body(_body(request))
            name = self.book.resolve(update.group_name)
        except (ValueError, LayoutError) as exc:
            return _fail(400, f"update_weights_from_distributed: {exc}")
        async with self.txns.lock:
            if foreign := self.txns.holder.foreign(_caller(request)):
                return _fail(409, foreign)
            group = self.book.groups.get(name)
            if group is None:
                return _fail(400, sg.missing_group(name, list(self.book.groups)))
            if name in self.book.broken:
                return _fail(
                    400,
                    f"Failed to receive weights: group {name} is broken ({self.book.broken[name]}); "
                    "destroy it and init it again",
                )
            txn = self.txns.current
            if txn is not None and txn.moved is Moved.DISK:
                return _fail(409, _moved_already(txn))
            try:
                txn = txn or await self.txns.open(Opener.UPDATE, None)
            except Conflict as exc:
                return _fail(409, str(exc))
            try:
                async with self.txns.call(txn):
                    await self.txns.receive(txn, group, update)
            except UpdateFailed as exc:
                if exc.left:  # their ranks left the group: no later broadcast over it can complete
                    self.book.broke(name, f"{', '.join(label_of(self.txns.registry, u) for u in exc.left)} left it")
                log.warning("update_weights_from_distributed over %s: %s", name, exc)
                return _fail(400, f"Failed to update parameter online: {exc}", engines=exc.engines, left=list(exc.left))
        return json_reply({"success": True, "message": sg.UPDATED_ONLINE})


def _moved_already(txn: FleetTxn) -> str:
    return (
        f"weights already moved {txn.moved.value} in this transaction ({txn.id}); "
        "/continue_generation ends it before another kind of update"
    )


def _caller(request: Request) -> str | None:
    """The push a call says it belongs to (``TXN_HEADER``), if any."""
    return request.headers.get(_TXN_HEADER)


_TXN_HEADER = TXN_HEADER.lower()


def _engine_urls(body: Any) -> frozenset[str] | None:
    """``pdctl_engines``, pdctl's addition to ``/init_weights_update_group``: the engines to join."""
    urls = body.get("pdctl_engines") if isinstance(body, dict) else None
    if urls is None:
        return None
    if not isinstance(urls, list) or not all(isinstance(u, str) and u for u in urls):
        raise ValueError("pdctl_engines must be a list of engine URLs")
    return frozenset(u.rstrip("/") for u in urls)


def _body(request: Request) -> Any:
    """The request's JSON body (an empty body is None); ValueError for bytes that are not JSON."""
    if not request.body.strip():
        return None
    try:
        return loads(request.body)
    except ValueError as exc:
        raise ValueError(f"invalid JSON body: {exc}") from None


def _fail(status: int, message: str, **extra: Any) -> Reply:
    """SGLang's answer of a failed weight route: ``{"success": false, "message"}``; the message is
    the reason phrase too."""
    reply = json_reply({"success": False, "message": message, **extra}, status)
    reply.reason = message
    return reply


def _error(status: int, message: str) -> Reply:
    """SGLang's error body of its other routes: ``{"error": {"message"}}``; the message is the
    reason phrase too."""
    reply = json_reply({"error": {"message": message}}, status)
    reply.reason = message
    return reply


def _audited(
    method: str, path: str, handler: Callable[[Request], Awaitable[Reply]]
) -> Callable[[Request], Awaitable[Reply]]:
    """Every facade call leaves an audit line (route and outcome; the key check has logged who);
    a refusal or failure also a WARNING with its message, so that the framework's user reads why."""

    async def answer(request: Request) -> Reply:
        try:
            reply = await handler(request)
        except ValueError as exc:  # a body that is not JSON
            reply = _error(400, str(exc))
        audit_log.info("sglang_control method=%s path=%s status=%d", method, path, reply.status)
        if reply.status >= 400:
            log.warning("%s %s answered %d: %s", method, path, reply.status, reply.reason or "")
        return reply

    async def audited(request: Request) -> Reply:
        # A control call acts on the whole fleet: a client that goes away (its trainer killed, a
        # Ctrl-C) must not cut it half way, so it runs to its end in a task of its own, which the
        # client's cancellation does not reach; its outcome is logged all the same.
        task = asyncio.ensure_future(answer(request))
        _running.add(task)
        task.add_done_callback(_running.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            log.warning("%s %s: its client went away; the call goes on to its end", method, path)
            raise

    return audited


_running: set[asyncio.Task] = set()
"""Control calls whose client went away, kept referenced until they end."""
