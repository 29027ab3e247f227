"""The router's application: its parts put together, its routes, and a generation request from
its head to its answer (request ids, admission, the refit gate, then the dispatcher).

The parts: ``Keys`` (auth.py, checked on each request's head), ``Admission`` (admission.py),
the ``Dispatcher`` (dispatch.py: the request path), the ``WorkerRegistry`` (workers.py),
``WeightUpdates`` (updates/: a weight update's owner) with its hold routes (updates/holds.py) and the
SGLang control facade (facade/), the worker admin API (worker_api.py) and the metrics.

``RouterServer`` has ``start()``/``stop()`` and ``async with``; port 0 binds a free port.
It serves on pdctl's own HTTP server (``pdctl.router.server``); aiohttp's client is kept
for the cold paths (health checks, fan-outs, proxied GETs).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import aiohttp
import yarl

from pdctl.roles import ENGINE_ROLES, Role
from pdctl.router import errors
from pdctl.router.admission import Admission
from pdctl.router.auth import Keys
from pdctl.router.body_rules import COMPLETIONS, GENERATE, body_problem
from pdctl.router.config import RouterConfig
from pdctl.router.dispatch import Dispatcher
from pdctl.router.errors import RouteError
from pdctl.router.facade import SGLangFacade
from pdctl.router.fanout import WorkerAnswer, call_all
from pdctl.router.gate import RefitGate
from pdctl.router.health import HealthChecks
from pdctl.router.jsonutil import loads
from pdctl.router.metrics import RouterMetrics
from pdctl.router.planner_api import PlannerApi
from pdctl.router.reply import Answer, Reply, StreamReply, json_reply, text_reply
from pdctl.router.server import HttpServer, Request, Routes
from pdctl.router.shaping import Headers
from pdctl.router.transaction import FleetTransactions
from pdctl.router.transaction.routes import LoadRoute, PushRoutes
from pdctl.router.updates import WeightUpdates
from pdctl.router.updates.holds import HoldRoutes
from pdctl.router.upstream import Upstream
from pdctl.router.versions import VersionRule
from pdctl.router.worker_api import WorkerApi
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang import Endpoint, batch_size_of

CLIENT_CLOSED = 499  # nginx's status for a request whose client left before its answer (never sent)


class RouterServer:
    """A router (module docstring): ``start()``/``stop()`` or ``async with``."""

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
        self.admission = admission = Admission(config.admission, self.metrics)
        self.dispatcher = Dispatcher(config, self.registry, self.metrics, upstream, self.gate, admission=admission)
        self.session: aiohttp.ClientSession | None = None
        self._servers: list[HttpServer] = []
        self.port = config.port
        self.prometheus_port = config.prometheus_port
        self.health_checks = HealthChecks(config, self.registry, VersionRule(config, self.registry))
        self.updates = WeightUpdates(self.registry, self.health_checks, self.metrics, self.gate)
        self.transactions = FleetTransactions(
            config, self.registry, self.updates, self._client, admission.idle, admission.in_flight
        )
        self.facade = SGLangFacade(config, self.transactions)
        self.load_route = LoadRoute(self.transactions)
        self.push_routes = PushRoutes(self.transactions)
        self.holds = HoldRoutes(self.updates, self.registry, admission, self._client, self.transactions.holder.state)
        self.worker_api = WorkerApi(
            config,
            self.registry,
            self.health_checks,
            self._client,
            self.transactions.holder.state,
            self.dispatcher.legs.hand_off,
        )
        self.registry.on_hung.append(self._hung)
        self._id_prefix = f"pdctl-{uuid.uuid4().hex[:12]}-"
        self._ids = itertools.count()
        self.planner_api = PlannerApi(self.metrics)
        self.routes = self._routes()

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """End what a predecessor's transaction left open, run one health round, start the health loops and listen (the
        main port, and the Prometheus port when configured). Raises OSError, with everything started stopped again, when
        a port cannot be bound."""
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        # A predecessor killed during a transaction of its own left engines paused: continued first.
        await self.transactions.recover()
        # One health round before taking traffic: workers that answer enter rotation with
        # their weight version known; the others join as soon as a later round reaches them.
        await self.health_checks.check_all(self.session)
        self.health_checks.start(self.session)
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
        """Stop the holds, transactions, health loops, servers, client session and dispatcher; safe after a failed
        ``start``."""
        await self.holds.stop()
        await self.transactions.tasks.stop()
        await self.health_checks.stop()
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
        """The router's base URL (a wildcard host given as ``127.0.0.1``); valid once ``start`` bound the port."""
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
        self.holds.add_routes(r)  # a pdctl.weights transaction's
        self.load_route.add_routes(r)  # pdctl weights load, run by the router
        self.push_routes.add_routes(r)  # a trainer's push, run by the router
        self.worker_api.add_routes(r)
        self.planner_api.add_routes(r)  # step hints and the planner's decisions
        r.add("GET", "/metrics", self.metrics_endpoint)
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
            limits = self.config.admission
            problem = body_problem(route, body, limits.max_n, limits.max_sequences)
            if problem is not None:
                status = 400
                return errors.error_response(400, errors.BAD_REQUEST, problem, headers)
            timed = self.planner_api.clock.arrived()  # (a step's time is its clients': from arrival)
            if timed is not None:
                ends.append(timed)
            admission = self.admission
            if admission.slots is not None:
                ends.append(await admission.slot())
            if not self.gate.is_open:
                await self.dispatcher.wait_open()
            admission.enter()
            ends.append(admission.leave)
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

    def _client(self) -> aiohttp.ClientSession | None:
        return self.session

    def _hung(self, worker: Worker, why: str) -> None:
        """What a hung worker runs is failed over as a dead one's: retried on another pair, a
        stream continued on another decode."""
        self.dispatcher.legs.upstream.fail_host(worker.url, f"{worker.role} {worker.url}: {why}")

    # -- info routes ---------------------------------------------------------------------------------------
    async def health(self, _: Request) -> Reply:
        """``GET /health``: 200 ``OK`` while the router's process serves, whatever its workers."""
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
        """``GET /readiness``: 200 when the router can serve a request now, else 503 with the reason (and the hold,
        while a weight update holds requests); both give worker counts."""
        ready, in_rotation, why = self._ready()
        hold = self.transactions.holder.state()
        if hold is not None:  # requests wait: the router cannot serve one now, whatever its workers
            ready, why = False, hold["reason"]
        body: dict[str, Any] = {
            "status": "ready" if ready else "not_ready",
            "healthy_workers": in_rotation,
            "total_workers": len(self.registry.workers),
        }
        if why:
            body["reason"] = why
        if hold is not None:
            body["hold"] = hold
        return json_reply(body, 200 if ready else 503)

    async def health_generate(self, _: Request) -> Reply:
        """``GET /health_generate``: 200 when the router can serve a request now, else 503 with why not; sends no
        request to a worker."""
        ready, _count, why = self._ready()
        hold = self.transactions.holder.state()
        if hold is not None:
            ready, why = False, hold["reason"]
        if ready:
            return text_reply("At least one router has healthy workers")
        return errors.error_response(503, errors.NO_WORKERS, f"the router cannot serve: {why}")

    async def proxy_get(self, request: Request) -> Reply:
        """A GET passed on to one worker in rotation (a prefill or regular one, else a decode) with the worker's key,
        and its answer returned as is; 503 with no worker in rotation, 502 when the worker fails, 404 for a model id
        with a dot segment."""
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

    async def metrics_endpoint(self, _: Request) -> Reply:
        """``GET /metrics``: every router metric in the Prometheus text format."""
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
