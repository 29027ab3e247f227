"""The router's application: routes, auth, request ids, admission, hold/release.

``RouterServer`` has ``start()``/``stop()`` and ``async with``; port 0 binds a free port.
It serves on pdctl's own HTTP server (``pdctl.router.server``); aiohttp's client is kept
for the cold paths (health checks, fan-outs, proxied GETs).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import yarl

from pdctl.refit import MAX_SECS, Hold, Release
from pdctl.roles import ENGINE_ROLES, Role
from pdctl.router import errors
from pdctl.router.auth import Keys
from pdctl.router.body_rules import COMPLETIONS, GENERATE, body_problem
from pdctl.router.config import RouterConfig
from pdctl.router.dispatch import Dispatcher
from pdctl.router.errors import RouteError
from pdctl.router.facade import SGLangFacade
from pdctl.router.fanout import WorkerAnswer, call_all
from pdctl.router.jsonutil import loads
from pdctl.router.metrics import RouterMetrics
from pdctl.router.refit import Conflict, Driver, WeightUpdates
from pdctl.router.refit.gate import RefitGate
from pdctl.router.reply import Answer, Reply, StreamReply, json_reply, text_reply
from pdctl.router.server import HttpServer, Request, Routes
from pdctl.router.shaping import Headers
from pdctl.router.upstream import Upstream
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang import Endpoint, batch_size_of

log = logging.getLogger("pdctl.router")
CLIENT_CLOSED = 499  # nginx's status for a request whose client left before its answer (never sent)


class RouterServer:
    def __init__(self, config: RouterConfig, *, upstream: Upstream | None = None):
        """``upstream``: how requests reach engines (real connections unless given; tests pass a
        ``MockUpstream``). Health checks, fan-outs and proxied GETs always use real HTTP."""
        self.config = config
        self.registry = WorkerRegistry(config)
        kept = self.registry.kept.workers  # as the worker API last left them, before a restart
        for w in config.workers if kept is None else kept:
            key = config.worker_key if kept is None else w.api_key
            self.registry.add(w.url, w.role, w.bootstrap_port, healthy=config.health.disabled, api_key=key)
        self.keys = Keys(config.api_key, config.control_keys, audit=config.audit, open_from=config.control_open_from)
        self.metrics = RouterMetrics()
        self.gate = RefitGate()  # closed while a weight update holds the router
        self.dispatcher = Dispatcher(config, self.registry, self.metrics, upstream, self.gate)
        self.session: aiohttp.ClientSession | None = None
        self._servers: list[HttpServer] = []
        self.port = config.port
        self.prometheus_port = config.prometheus_port
        limit = config.admission.max_concurrent_requests
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None
        self._waiting = 0
        self._active = 0  # requests past the hold gate
        self._idle = asyncio.Event()
        self._idle.set()
        self.updates = WeightUpdates(self.registry, self.metrics, self.gate)
        self.facade = SGLangFacade(config, self.registry, self.updates, self._client, self._idle, self._in_flight)
        self.updates.on_lapse.append(self._lapsed)
        self.registry.on_hung.append(self._hung)
        self._tasks: set[asyncio.Task] = set()
        self.metrics.in_flight.set_function(lambda: self._active)  # read at scrape time, not per request
        self._id_prefix = f"pdctl-{uuid.uuid4().hex[:12]}-"
        self._ids = itertools.count()
        self.routes = self._routes()

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        # One health round before taking traffic: workers that answer enter rotation with
        # their weight version known; the others join as soon as a later round reaches them.
        await self.registry.check_all(self.session)
        self.registry.start(self.session)
        try:
            admission = self.config.admission
            main = HttpServer(
                self.handle,
                errors.server_error,
                max_body=admission.max_payload_size,
                max_inflight_body=admission.max_inflight_body_bytes,
                check_head=self.keys.head_check,  # keys are checked before any body byte is read
            )
            self.metrics.body_bytes.set_function(lambda: main.inflight_body)
            self.port = await self._listen(main, self.config.port)
            if self.config.prometheus_port is not None:
                metrics_routes = Routes()
                metrics_routes.add("GET", "/metrics", self.metrics_endpoint)
                prom = HttpServer(lambda r: _route(metrics_routes, r), errors.server_error, max_body=1024 * 1024)
                self.prometheus_port = await self._listen(prom, self.config.prometheus_port)
        except OSError:
            await self.stop()  # a busy port or a bad host: give back what started
            raise

    async def _listen(self, server: HttpServer, port: int) -> int:
        self._servers.append(server)
        try:
            return await server.start(self.config.host, port)
        except OSError as exc:
            raise OSError(f"cannot listen on {self.config.host}:{port}: {exc.strerror or exc}") from exc

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.facade.stop()
        await self.registry.stop()
        for server in reversed(self._servers):
            await server.stop()
        self._servers.clear()
        if self.session:
            await self.session.close()
        await self.dispatcher.close()

    async def __aenter__(self) -> RouterServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    # -- routes -------------------------------------------------------------------------------------------
    def _routes(self) -> Routes:
        r = Routes()
        for path in (Endpoint.GENERATE, Endpoint.COMPLETIONS, Endpoint.CHAT_COMPLETIONS):
            r.add("POST", path.value, self.generate)
        r.add("GET", "/health", self.health)
        r.add("GET", "/liveness", self.health)
        r.add("GET", "/readiness", self.readiness)
        r.add("GET", Endpoint.HEALTH_GENERATE.value, self.health_generate)
        for path in (Endpoint.MODEL_INFO, Endpoint.GET_MODEL_INFO, Endpoint.MODELS):
            r.add("GET", path.value, self.proxy_get)
        r.add_prefix("GET", Endpoint.MODELS.value + "/", self.proxy_get)  # /v1/models/{id}
        for path in (Endpoint.SERVER_INFO, Endpoint.GET_SERVER_INFO):
            r.add("GET", path.value, self.server_info)
        self.facade.add_routes(r)  # SGLang's control routes, for the whole fleet
        r.add("GET", "/workers", self.list_workers)
        r.add("POST", "/workers", self.add_worker)
        r.add_prefix("DELETE", "/workers/", self.delete_worker)
        r.add_prefix("GET", "/workers/", self.get_worker)
        r.add("GET", "/metrics", self.metrics_endpoint)
        r.add("POST", "/pdctl/hold", self.hold)
        r.add("POST", "/pdctl/release", self.release)
        r.add("POST", "/pdctl/refresh", self.refresh)
        r.add("GET", "/pdctl/weights", self.weights_state)
        r.add("POST", "/pdctl/cordon", self.cordon)
        return r

    def handle(self, request: Request) -> Awaitable[Answer]:
        """Every request that passed the key check (``Keys.check``, on its headers): its route."""
        handler = self.routes.exact.get((request.method, request.path))  # (the common case, found at once)
        return handler(request) if handler is not None else _route(self.routes, request)

    # -- traffic ------------------------------------------------------------------------------------------
    async def generate(self, request: Request) -> Answer:
        """A generation request, from admission to its answer. It holds its admission slot and
        counts in flight (``hold`` in ``drain`` mode waits for the count to reach zero) until
        its answer ends: a stream's when its body ends, however it ends."""
        started = time.monotonic()
        route = request.path
        h = request.headers
        request_id = h.get("x-request-id") or h.get("x-correlation-id") or h.get("request-id")
        headers = Headers.of(request_id or f"{self._id_prefix}{next(self._ids):x}", h)
        status = 500
        ends: list[Callable[[], None]] = []  # what to undo once the answer ends
        answer: Answer | None = None
        try:
            try:
                body = loads(request.body)
                if not isinstance(body, dict):
                    raise ValueError("body must be a JSON object")
            except ValueError as exc:
                status = 400
                return errors.error_response(400, errors.BAD_REQUEST, f"invalid JSON body: {exc}", headers)
            admission = self.config.admission
            problem = body_problem(route, body, admission.max_n, admission.max_sequences)
            if problem is not None:
                status = 400
                return errors.error_response(400, errors.BAD_REQUEST, problem, headers)
            if self._slots is not None:
                ends.append(await self._admit())
            if not self.gate.is_open:
                await self.dispatcher.wait_open()
            if self._active == 0:
                self._idle.clear()
            self._active += 1
            ends.append(self._leave)
            answer = await self._route(route, body, headers)
            status = answer.status
            return answer
        except RouteError as exc:
            status = exc.status
            return errors.error_response(exc.status, exc.code, str(exc), headers)
        except asyncio.CancelledError:
            status = CLIENT_CLOSED  # the client went away (or the router stops): no failure of ours
            raise
        finally:
            if isinstance(answer, StreamReply):
                answer.on_close.append(functools.partial(self._ended, route, status, started, ends))
            else:
                self._ended(route, status, started, ends)

    def _ended(self, route: str, status: int, started: float, ends: list[Callable[[], None]]) -> None:
        for undo in ends:
            undo()
        self.metrics.answered(route, status, time.monotonic() - started)

    def _leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    def _route(self, route: str, body: dict[str, Any], headers: Headers) -> Awaitable[Answer]:
        # Not a coroutine of its own: it returns the dispatcher's (a layer less on every request).
        if not self.config.pd_disaggregation:
            return self.dispatcher.regular_request(route, body, headers)
        if route == GENERATE:
            batch = batch_size_of(body)
        elif route == COMPLETIONS:
            batch = _prompt_batch(body.get("prompt"))
        else:
            batch = None  # chat: scalar fields (n > 1 is refused by the engines we drive)
        return self.dispatcher.pd_request(route, body, batch, headers)

    async def _admit(self) -> Callable[[], None]:
        """A slot under the concurrency limit, waited for in a bounded queue (429 when the queue
        is full, 408 past the queue timeout); the callable gives it back."""
        slots = self._slots
        assert slots is not None
        if slots.locked() and self._waiting >= self.config.admission.queue_size:
            raise RouteError(429, errors.QUEUE_FULL, f"too many requests: {self._waiting} already queued")
        self._waiting += 1
        self.metrics.queued.set(self._waiting)
        try:
            await asyncio.wait_for(slots.acquire(), self.config.admission.queue_timeout_secs)
        except asyncio.TimeoutError:
            raise RouteError(408, errors.QUEUE_TIMEOUT, "timed out waiting for a free slot") from None
        finally:
            self._waiting -= 1
            self.metrics.queued.set(self._waiting)
        return slots.release

    # -- hold / release (weight updates: pdctl.router.refit) ----------------------------------------------
    async def hold(self, request: Request) -> Reply:
        """Stop admitting requests; in ``drain`` mode also wait for in-flight ones to finish
        (they are not failed), in ``interrupt`` mode answer at once (the transaction then
        aborts them on the engines, and the router continues them after the release).

        A weight push sends ``txn``, ``engines`` and ``lease_secs`` and repeats the call to renew
        the lease; a push that stops renewing (its trainer died) is treated as failed: its
        engines leave rotation (their weights may be partial) and requests are admitted again.
        The body is a ``pdctl.refit.Hold``.
        """
        raw, problem = _json_object(request)
        try:
            if problem is not None:
                raise ValueError(problem)
            hold = Hold.from_json(raw)
        except ValueError as exc:
            return errors.error_response(400, errors.BAD_REQUEST, f"bad hold: {exc}")
        try:
            answer, ready = await self.updates.hold(hold, idle=self._idle, in_flight=self._in_flight)
        except Conflict as exc:
            return errors.error_response(409, errors.BAD_REQUEST, str(exc))
        return json_reply(answer.to_json(), 200 if ready else 504)

    def _in_flight(self) -> int:
        return self._active

    def _client(self) -> aiohttp.ClientSession | None:
        return self.session

    def _hung(self, worker: Worker, why: str) -> None:
        """What a hung worker runs is failed over as a dead one's: retried on another pair, a
        stream continued on another decode."""
        self.dispatcher.legs.upstream.fail_host(worker.url, f"{worker.role} {worker.url}: {why}")

    def _lapsed(self, txn: str | None, moved: bool, engines: tuple[str, ...], driver: Driver) -> None:
        """A pdctl transaction's lease ran out (its trainer or ``pdctl weights load`` is gone): the
        engines it paused are continued, so that none stays paused (the facade continues its own)."""
        if driver is not Driver.PDCTL or not engines or self.session is None:
            return
        workers = [self.registry.workers[url] for url in engines if url in self.registry.workers]
        task = asyncio.ensure_future(call_all(self.session, workers, "POST", Endpoint.CONTINUE_GENERATION.value, {}))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def release(self, request: Request) -> Reply:
        """Re-read every worker's health and weight version, then admit requests again.

        ``complete`` lists engines that hold the pushed version (back into rotation);
        ``failed`` maps engines that do not to why (out of rotation until a later push).
        """
        raw, problem = _json_object(request)
        try:
            if problem is not None:
                raise ValueError(problem)
            release = Release.from_json(raw)
        except ValueError as exc:
            return errors.error_response(400, errors.BAD_REQUEST, f"bad release: {exc}")
        try:
            await self.updates.release(release, self.session)
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
                "last_push": None if last is None else last.to_json(),
                "workers": workers,
                "quarantine": dict(self.registry.quarantine),
            }
        )

    async def refresh(self, request: Request) -> Reply:
        assert self.session is not None
        await self.registry.check_all(self.session)
        return json_reply({"workers": [w.to_dict() for w in self.registry.workers.values()]})

    # -- info routes ---------------------------------------------------------------------------------------
    async def health(self, _: Request) -> Reply:
        return text_reply("OK")

    def _ready(self) -> tuple[bool, int, str]:
        """Whether the router can serve a request now: every registered worker has answered once,
        and each role has a worker in rotation (healthy, not cordoned, not quarantined, its
        circuit not open), for PD a prefill and a decode on one weight version. Also how many
        workers are in rotation, and what is missing when it cannot."""
        workers = list(self.registry.workers.values())
        routable = {role: self.registry.routable(role) for role in ENGINE_ROLES}
        count = sum(len(ws) for ws in routable.values())
        starting = [w.url for w in workers if not w.activated]
        if starting:
            return False, count, f"not answered yet: {', '.join(starting)}"
        roles = (Role.PREFILL, Role.DECODE) if self.config.pd_disaggregation else (Role.REGULAR,)
        missing = [role.value for role in roles if not routable[role]]
        if missing:
            return False, count, f"no {' or '.join(missing)} worker in rotation"
        if self.config.pd_disaggregation:
            prefills = {w.weight_version for w in routable[Role.PREFILL]}
            if not prefills & {w.weight_version for w in routable[Role.DECODE]}:
                return False, count, "no prefill and decode in rotation hold one weight version"
        return True, count, ""

    async def readiness(self, _: Request) -> Reply:
        ready, in_rotation, why = self._ready()
        body: dict[str, Any] = {
            "status": "ready" if ready else "not_ready",
            "healthy_workers": in_rotation,
            "total_workers": len(self.registry.workers),
        }
        if why:
            body["reason"] = why
        return json_reply(body, 200 if ready else 503)

    async def health_generate(self, _: Request) -> Reply:
        ready, _count, why = self._ready()
        if ready:
            return text_reply("At least one router has healthy workers")
        return errors.error_response(503, errors.NO_WORKERS, f"the router cannot serve: {why}")

    async def proxy_get(self, request: Request) -> Reply:
        assert self.session is not None
        role = Role.PREFILL if self.config.pd_disaggregation else Role.REGULAR
        workers = self.registry.routable(role) or self.registry.routable(Role.DECODE)
        if not workers:
            return errors.error_response(503, errors.NO_WORKERS, "no healthy worker to ask")
        path = request.path
        if request.tail:  # /v1/models/{id}: the id alone goes on, never a path the worker would resolve
            if any(seg in (".", "..") for seg in request.tail.split("/")):
                return errors.error_response(404, errors.NOT_FOUND, f"no model {request.tail!r:.80}")
            path = Endpoint.MODELS.value + "/" + quote(request.tail, safe="/")
        url = yarl.URL(workers[0].url + path, encoded=True)  # sent as built: no dot-segment resolving
        try:
            # the worker's own key; to one the router holds none for, the client's (a standalone router's engines)
            given = request.headers.get("authorization")
            auth = workers[0].auth or ({"Authorization": given} if given else {})
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=10), headers=auth) as r:
                return Reply(r.status, await r.read(), r.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return errors.error_response(502, errors.WORKER_FAILED, f"{workers[0].url}: {exc}")

    async def server_info(self, _: Request) -> Reply:
        """Each worker's ``/server_info`` under its role; a worker that does not answer (its engine
        restarting) is listed as ``{"url", "error", "internal_states": []}`` rather than left out:
        SGLang's bench_serving reads ``["decode"][0]`` of a PD router's answer, and failed after
        its run when the only decode was being restarted."""
        infos = await self._fan_out("GET", Endpoint.SERVER_INFO.value)
        by_role: dict[str, list] = {role.value: [] for role in ENGINE_ROLES}
        internal = []
        for a in infos:
            if a.status == 200 and isinstance(a.body, dict):
                by_role[a.worker.role].append(a.body)
                if a.worker.role is not Role.PREFILL:
                    internal.extend(a.body.get("internal_states", []))
        for a in infos:  # after those that answered: ["decode"][0] answers if one does
            if not (a.status == 200 and isinstance(a.body, dict)):
                why = f"answered {a.status}" if a.status else f"no answer: {a.body}"
                by_role[a.worker.role].append({"url": a.worker.url, "error": why, "internal_states": []})
        return json_reply(
            {"router": "pdctl", "workers_count": len(self.registry.workers), "internal_states": internal, **by_role}
        )

    async def _fan_out(self, method: str, path: str) -> list[WorkerAnswer]:
        assert self.session is not None
        return await call_all(self.session, self.registry.workers.values(), method, path)

    # -- /workers ------------------------------------------------------------------------------------------
    async def list_workers(self, _: Request) -> Reply:
        workers = [w.to_dict() for w in self.registry.workers.values()]
        stats = {f"{role}_count": len(self.registry.of_role(role)) for role in ENGINE_ROLES}
        return json_reply({"workers": workers, "total": len(workers), "stats": stats})

    async def add_worker(self, request: Request) -> Reply:
        """``{"url", "worker_type", "bootstrap_port", "api_key"}``; ``api_key`` (write-only, never
        answered) is what the router sends the worker: without it the worker gets no key (smg's
        rule; a worker registered at run time never receives the router's engine key unasked)."""
        body, problem = _json_object(request)
        if problem is None:
            problem = worker_problem(body)
        if problem is not None:
            return errors.error_response(400, errors.BAD_REQUEST, problem)
        url, role = body["url"], body.get("worker_type", Role.REGULAR.value)
        pd = self.config.pd_disaggregation
        if (role == Role.REGULAR.value) == pd and role in {r.value for r in ENGINE_ROLES}:
            wanted = "prefill or decode (a PD router)" if pd else "regular (a router without --pd-disaggregation)"
            return errors.error_response(400, errors.BAD_REQUEST, f"worker_type must be {wanted}, not {role}")
        known = self.registry.find(url)
        if known is not None:  # registered already (slime registers the engines it was given): no duplicate
            if known.role != role or (body.get("bootstrap_port") or known.bootstrap_port) != known.bootstrap_port:
                message = (
                    f"worker {known.url} is registered already as {known.role}"
                    f"{f' (bootstrap port {known.bootstrap_port})' if known.bootstrap_port else ''}; "
                    "DELETE it first to register it otherwise"
                )
                return errors.error_response(409, errors.BAD_REQUEST, message)
            return json_reply(
                {"status": "accepted", "worker_id": known.id, "url": known.url, "message": "already registered"},
                status=202,
            )
        key = body.get("api_key")
        if key is None and self.config.worker_key:
            log.warning("worker %s added without api_key: the router sends it no key", url)
        try:
            # Runtime workers join unhealthy and enter rotation after passing health checks.
            worker = self.registry.add(
                url, role, body.get("bootstrap_port"), healthy=self.config.health.disabled, api_key=key
            )
        except ValueError as exc:
            return errors.error_response(400, errors.BAD_REQUEST, str(exc))
        self.registry.keep_workers()
        if self.session is not None and not self.config.health.disabled:
            await self.registry.check(self.session, worker)
        return json_reply({"status": "accepted", "worker_id": worker.id, "url": worker.url}, status=202)

    async def get_worker(self, request: Request) -> Reply:
        """One worker's state (health included), by id or URL, as smg's ``GET /workers/{id}``."""
        worker = self.registry.find(request.tail)
        if worker is None:
            return errors.error_response(404, errors.NOT_FOUND, f"no worker {request.tail}")
        return json_reply(worker.to_dict())

    async def delete_worker(self, request: Request) -> Reply:
        worker = self.registry.remove(request.tail)
        if worker is None:
            return errors.error_response(404, errors.NOT_FOUND, f"no worker {request.tail}")
        self.registry.keep_workers()
        # 202 and "accepted" as sglang-router and smg answer (they remove in the background; pdctl
        # has already removed it), so that clients written against them read the same reply.
        return json_reply({"status": "accepted", "worker_id": worker.id, "message": "Worker removed"}, 202)

    async def cordon(self, request: Request) -> Reply:
        """``{"url", "cordon": true, "reason", "timeout_secs"}``: take a worker out of rotation and
        answer once the requests it runs have finished (``drained``: false when the timeout came
        first); ``"cordon": false`` takes it back (the version rule and health still apply). The
        worker's state comes back either way."""
        body, problem = _json_object(request)
        if problem is None and not isinstance(body.get("url"), str):
            problem = "url must be the worker's URL (a string)"
        if problem is None and not isinstance(body.get("cordon", True), bool):
            problem = "cordon must be true or false"
        if problem is not None:
            return errors.error_response(400, errors.BAD_REQUEST, problem)
        worker = self.registry.find(body["url"])
        if worker is None:
            return errors.error_response(404, errors.NOT_FOUND, f"no worker {body.get('url')!r}")
        timeout = body.get("timeout_secs", 600)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 <= timeout <= MAX_SECS:
            message = f"timeout_secs must be a number from 0 to {MAX_SECS:g}"
            return errors.error_response(400, errors.BAD_REQUEST, message)
        if not body.get("cordon", True):
            if worker.cordoned:
                log.info("worker %s is no longer cordoned", worker.url)
            worker.cordoned, worker.drained = None, None
            self.registry.rotation_changed()
            return json_reply({**worker.to_dict(), "drained": worker.load == 0})
        worker.cordoned = str(body.get("reason") or "cordoned")
        worker.drained = asyncio.Event()
        log.info("worker %s is cordoned (%s); %d request(s) to finish", worker.url, worker.cordoned, worker.load)
        if worker.load > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(worker.drained.wait(), timeout)
        return json_reply({**worker.to_dict(), "drained": worker.load == 0})

    async def metrics_endpoint(self, _: Request) -> Reply:
        return Reply(200, self.metrics.render(self.registry), "text/plain; version=0.0.4; charset=utf-8")


def _prompt_batch(prompt: Any) -> int | None:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return None


def _route(routes: Routes, request: Request) -> Awaitable[Answer]:
    """``request``'s handler, called (its coroutine is the server's to await), or its 404 or 405."""
    handler = routes.find(request)
    if handler is None:
        return _now(errors.error_response(404, errors.NOT_FOUND, f"no route {request.path}"))
    if isinstance(handler, bool):  # False: the path exists under another method
        message = f"{request.method} not allowed on {request.path}"
        return _now(errors.error_response(405, errors.METHOD_NOT_ALLOWED, message))
    return handler(request)


async def _now(answer: Answer) -> Answer:
    return answer


def _json_object(request: Request) -> tuple[dict[str, Any], str | None]:
    """The body as a JSON object (an empty body is ``{}``), or why it is not one."""
    if not request.body.strip():
        return {}, None
    try:
        body = loads(request.body)
    except ValueError as exc:
        return {}, f"invalid JSON body: {exc}"
    if not isinstance(body, dict):
        return {}, "the body must be a JSON object"
    return body, None


def worker_problem(body: dict[str, Any]) -> str | None:
    """Why a ``POST /workers`` body is refused, or None."""
    url = body.get("url")
    if not isinstance(url, str):
        return "url must be a string: http(s)://HOST:PORT"
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        return f"url {url!r:.80} must not hold spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port
        host = parts.hostname or ""
        host.encode("idna")  # every label 1 to 63 characters, no empty one
    except (ValueError, UnicodeError) as exc:
        return f"url {url!r:.80}: {exc}"
    if parts.scheme not in ("http", "https") or not host:
        return f"url {url!r:.80} must be http(s)://HOST[:PORT]"
    if port is not None and not 1 <= port <= 65535:
        return f"url {url!r:.80}: port must be 1 to 65535"
    if parts.query or parts.fragment or parts.username or parts.password:
        return f"url {url!r:.80} must not carry credentials, a query or a fragment"
    if parts.path not in ("", "/"):
        return f"url {url!r:.80} must be a server's root (no path): requests go to its SGLang routes"
    role = body.get("worker_type", Role.REGULAR.value)
    if not isinstance(role, str):
        return "worker_type must be a string: regular, prefill or decode"
    bootstrap = body.get("bootstrap_port")
    if bootstrap is not None and (
        not isinstance(bootstrap, int) or isinstance(bootstrap, bool) or not 1 <= bootstrap <= 65535
    ):
        return "bootstrap_port must be an integer from 1 to 65535 (or null)"
    key = body.get("api_key")
    if key is not None and (not isinstance(key, str) or not key or any(not 0x21 <= ord(c) <= 0x7E for c in key)):
        return "api_key must be a non-empty string of printable ASCII without spaces"
    return None
