"""The worker admin API: ``/workers`` (list, add, get, delete) as sglang-router and smg answer
it, ``/pdctl/cordon`` (out of rotation, drained) and ``/pdctl/refresh`` (a health round now, of
every worker or of one)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from pdctl.refit import MAX_SECS
from pdctl.roles import ENGINE_ROLES, Role
from pdctl.router import errors
from pdctl.router.config import RouterConfig
from pdctl.router.health import HealthChecks
from pdctl.router.jsonutil import json_object
from pdctl.router.reply import Reply, json_reply
from pdctl.router.server import Request, Routes
from pdctl.router.workers import Worker, WorkerRegistry

log = logging.getLogger("pdctl.router")


class WorkerApi:
    """The routes that change or show the router's workers (module docstring)."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        health: HealthChecks,
        session: Callable[[], aiohttp.ClientSession | None],
        hold_state: Callable[[], dict[str, Any] | None] = lambda: None,
        hand_off: Callable[[Worker], int] = lambda _: 0,
    ):
        """``session``: the router's client session (made when it starts); ``hold_state``: what
        holds new requests now (``FleetHolder.state``, pdctl.router.transaction.holder);
        ``hand_off``: takes back the requests that wait at a worker (``Legs.hand_off``)."""
        self.config = config
        self.registry = registry
        self.health = health
        self.session = session
        self.hold_state = hold_state
        self.hand_off = hand_off

    def add_routes(self, r: Routes) -> None:
        """Register the worker API (``/workers``, ``/workers/{id}``), ``/pdctl/cordon`` and ``/pdctl/refresh``."""
        r.add("GET", "/workers", self.list_workers)
        r.add("POST", "/workers", self.add_worker)
        r.add_prefix("DELETE", "/workers/", self.delete_worker)
        r.add_prefix("GET", "/workers/", self.get_worker)
        r.add("POST", "/pdctl/cordon", self.cordon)
        r.add("POST", "/pdctl/refresh", self.refresh)

    async def list_workers(self, _: Request) -> Reply:
        """sglang-router's answer, and ``hold`` while a weight update holds new requests (``pdctl
        status`` reads it through its node's agent: paused engines are held, not down)."""
        workers = [w.to_dict() for w in self.registry.workers.values()]
        stats = {f"{role}_count": len(self.registry.of_role(role)) for role in ENGINE_ROLES}
        body: dict[str, Any] = {"workers": workers, "total": len(workers), "stats": stats}
        hold = self.hold_state()
        if hold is not None:
            body["hold"] = hold
        return json_reply(body)

    async def add_worker(self, request: Request) -> Reply:
        """``{"url", "worker_type", "bootstrap_port", "api_key"}``; ``api_key`` (write-only, never
        answered) is what the router sends the worker: without it the worker gets no key (smg's
        rule; a worker registered at run time never receives the router's engine key unasked)."""
        body, problem = json_object(request.body)
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
        session = self.session()
        if session is not None and not self.config.health.disabled:
            await self.health.check(session, worker)
        return json_reply({"status": "accepted", "worker_id": worker.id, "url": worker.url}, status=202)

    async def get_worker(self, request: Request) -> Reply:
        """One worker's state (health included), by id or URL, as smg's ``GET /workers/{id}``."""
        worker = self.registry.find(request.tail)
        if worker is None:
            return errors.error_response(404, errors.NOT_FOUND, f"no worker {request.tail}")
        return json_reply(worker.to_dict())

    async def delete_worker(self, request: Request) -> Reply:
        """``DELETE /workers/{id or URL}``: unregister the worker now and keep the new set; 202 as sglang-router
        answers, 404 for an unknown worker."""
        worker = self.registry.remove(request.tail)
        if worker is None:
            return errors.error_response(404, errors.NOT_FOUND, f"no worker {request.tail}")
        self.registry.keep_workers()
        # 202 and "accepted" as sglang-router and smg answer (they remove in the background; pdctl
        # has already removed it), so that clients written against them read the same reply.
        return json_reply({"status": "accepted", "worker_id": worker.id, "message": "Worker removed"}, 202)

    async def cordon(self, request: Request) -> Reply:
        """``{"url", "cordon": true, "reason", "timeout_secs", "handoff"}``: take a worker out of
        rotation and answer once the requests it runs have finished (``drained``: false when the
        timeout came first); with ``handoff`` (a role switch's drain), the PD requests queued at a
        prefill with nothing made yet are sent to other pairs at once rather than waited for
        (``handed_off``: how many; a decode hands off none). ``"cordon": false`` takes
        it back (the version rule and health still apply). The worker's state comes back either way."""
        body, problem = json_object(request.body)
        if problem is None and not isinstance(body.get("url"), str):
            problem = "url must be the worker's URL (a string)"
        if problem is None and not isinstance(body.get("cordon", True), bool):
            problem = "cordon must be true or false"
        if problem is None and not isinstance(body.get("handoff", False), bool):
            problem = "handoff must be true or false"
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
        handed = self.hand_off(worker) if body.get("handoff", False) and worker.load > 0 else 0
        log.info(
            "worker %s is cordoned (%s); %d request(s) to finish, %d handed to other pairs",
            worker.url,
            worker.cordoned,
            worker.load,
            handed,
        )
        if worker.load > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(worker.drained.wait(), timeout)
        return json_reply({**worker.to_dict(), "drained": worker.load == 0, "handed_off": handed})

    async def refresh(self, request: Request) -> Reply:
        """A health round now: of every worker, or of the one ``{"url": ...}`` names (a command
        waiting for an engine it just switched or restarted asks for its checks one by one, so
        it is back after ``--health-success-threshold`` checks, not as many health intervals)."""
        body, problem = json_object(request.body)
        url = body.get("url")
        if problem is None and url is not None and not isinstance(url, str):
            problem = "url must be a string"
        if problem is not None:
            return errors.error_response(400, errors.BAD_REQUEST, problem)
        session = self.session()
        assert session is not None
        if url is None:
            await self.health.check_all(session)
            return json_reply({"workers": [w.to_dict() for w in self.registry.workers.values()]})
        worker = self.registry.find(url)
        if worker is None:
            return errors.error_response(404, errors.NOT_FOUND, f"no worker {url!r:.200}")
        await self.health.check(session, worker)
        return json_reply({"workers": [worker.to_dict()]})


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
