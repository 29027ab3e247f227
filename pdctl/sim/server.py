"""SimServer: one sim engine process's lifecycle (sglang-protocol.md sections 2, 4, 5).

``start`` rendezvouses TP peers on other nodes, loads the model, starts the scheduler, the
prefill's bootstrap server and the HTTP API (native, OpenAI and weight routes, each a module
over one SimService); ``stop`` undoes it. Also ``async with``; port 0 binds a free port
(tests), reported by ``.port``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import torch
from aiohttp import web

from pdctl.errors import SimError
from pdctl.httputil import sglang_key_refusal, start_site
from pdctl.sglang import generate_error_body
from pdctl.sim import native_http, openai, remote_instance, role_switch, weights_http
from pdctl.sim.body import MAX_BODY_BYTES, ContractError, ValidationError
from pdctl.sim.config import SimConfig
from pdctl.sim.engine import Engine
from pdctl.sim.hooks import register_forward_hooks
from pdctl.sim.kv import KVStore, bootstrap_app
from pdctl.sim.metrics import SimMetrics
from pdctl.sim.model import resolve_model
from pdctl.sim.multinode import PeerHub
from pdctl.sim.remote_instance import receive_from_seed
from pdctl.sim.service import SimService
from pdctl.sim.weights import WeightGroupMember

log = logging.getLogger("pdctl.sim")
READY_LINE = "The server is fired up and ready to roll!"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SimServer:
    """One sim engine: HTTP API, scheduler thread, optional bootstrap server and TP helpers."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.service: SimService | None = None
        """Everything the routes use; set once start() has loaded the model."""
        self._runners: list[web.AppRunner] = []
        self._session: aiohttp.ClientSession | None = None
        self._members: WeightGroupMember | None = None
        self._engine: Engine | None = None
        self.hub: PeerHub | None = None
        self.failed = asyncio.Event()
        """Set when the engine can no longer serve (a TP peer node died, its scheduler failed); the
        process then exits with 1."""

    @property
    def status(self) -> str:
        """``starting``, ``up``, ``stopping`` or ``failed``: the service's status once started, before that ``failed``
        if the engine already cannot serve."""
        if self.service is not None:
            return self.service.status
        return "failed" if self.failed.is_set() else "starting"

    @property
    def port(self) -> int:
        """The HTTP port: the bound one once started (port 0 binds a free one), else the configured one."""
        return self.service.port if self.service is not None else self.config.port

    @property
    def bootstrap_port(self) -> int:
        """The PD bootstrap server's port: the bound one once started, else the configured one."""
        return self.service.bootstrap_port if self.service is not None else self.config.bootstrap_port

    @property
    def url(self) -> str:
        """The HTTP API's base URL, ``http://host:port``."""
        return f"http://{self.config.host}:{self.port}"

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Bring the engine up as SGLang's launch does: rendezvous TP peer nodes, load the model (or receive it from a
        seed instance), start the scheduler, the bootstrap server when the role needs one and the HTTP API, then warm
        up with a one-token request unless ``skip_server_warmup``. Raises SimError when the seed's weights cannot be
        received."""
        c = self.config
        peers: list = []
        if c.layout is not None:  # every TP rank rendezvouses before anything loads, as in SGLang
            self.hub = PeerHub(c.layout, c.model_path, self._cannot_serve)
            peers = await self.hub.start(c.dist_timeout_secs)
        # A remote_instance load builds the model and fills it from the seed (SGLang's
        # RemoteInstanceModelLoader); the sim's checkpoint is not read then.
        load_format = "dummy" if c.remote_source is not None else c.load_format
        model = await asyncio.to_thread(resolve_model, c.model_path, load_format, c.context_length)
        if c.remote_source is not None:
            try:
                await asyncio.to_thread(receive_from_seed, model, c.remote_source, c.dist_timeout_secs)
            except (RuntimeError, OSError, ValueError) as exc:  # the seed went away mid-transfer, say
                raise SimError(f"loading the weights from the seed instance failed: {exc}") from exc
        register_forward_hooks(model, c.forward_hooks)  # once, at load, as SGLang's ModelRunner does
        local_ranks = c.layout.tp_per_node if c.layout else c.tp_size
        self._members = await asyncio.to_thread(
            WeightGroupMember, local_ranks, peers, c.weight_digest, c.weight_group_timeout_secs
        )
        kv_store, bootstrap_port = None, c.bootstrap_port
        # With --enable-pd-role-switch every PD engine serves KV from the start (SGLang's
        # disagg_service.py): one switched to prefill already has its bootstrap server.
        if c.disaggregation_mode == "prefill" or (c.enable_pd_role_switch and c.disaggregation_mode != "null"):
            kv_store = KVStore(asyncio.get_running_loop())
            runner, bootstrap_port = await start_site(bootstrap_app(kv_store), c.host, c.bootstrap_port)
            self._runners.append(runner)
        metrics = SimMetrics(c.served_name)
        self._engine = Engine(
            model,
            max_running=c.max_running_requests,
            random_seed=c.random_seed,
            prefill_ms_per_token=c.prefill_ms_per_token,
            decode_ms_per_step=c.decode_ms_per_step,
            publish_kv=kv_store.put_threadsafe if kv_store else None,
            profile=c.profile,
            prefix_cache=c.prefix_cache,
            weight_version=c.weight_version,
            capture_hidden_states=c.enable_return_hidden_states,
        )
        self._engine.on_finish = metrics.observe_finished
        self._session = aiohttp.ClientSession()
        service = SimService(
            c,
            model,
            self._engine,
            self._members,
            metrics,
            self._session,
            bootstrap_port=bootstrap_port,
            kv_store=kv_store,
        )
        loop = asyncio.get_running_loop()

        # A scheduler that cannot go on ends the process (exit 1), for its supervisor to restart it.
        def fatal(reason: str) -> None:  # on the scheduler thread
            loop.call_soon_threadsafe(self._cannot_serve, reason)

        self._engine.on_fatal = fatal
        self._engine.start()
        # handler_cancellation: a client that goes away cancels its handler, which aborts the request.
        runner, service.port = await start_site(self.app(service), c.host, c.port, handler_cancellation=True)
        self._runners.append(runner)
        self.service = service
        if self.failed.is_set():
            service.status = "failed"
            return
        if not c.skip_server_warmup:
            await service.one_token()
        service.status = "up"
        log.info(READY_LINE)

    async def stop(self) -> None:
        """Close the HTTP and bootstrap sites, the client session, the scheduler, the TP helpers and the peer hub,
        whichever were started."""
        if self.service is not None:
            self.service.status = "stopping"
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        if self._session:
            await self._session.close()
        if self._engine:
            await asyncio.to_thread(self._engine.stop)
        if self._members:
            await asyncio.to_thread(self._members.close)
        if self.hub:
            await self.hub.stop()

    def _cannot_serve(self, reason: str) -> None:
        if self.service is not None:
            self.service.status = "failed"
        log.error("%s: this engine cannot serve any more; exiting", reason)
        self.failed.set()

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- app ---------------------------------------------------------------------------
    def app(self, service: SimService) -> web.Application:
        """The aiohttp application serving ``service``: native, OpenAI, weight, role-switch and remote-instance routes
        behind the API key check, with unhandled SimErrors answered in SGLang's error shape."""
        app = web.Application(middlewares=[self._auth, _sim_errors], client_max_size=MAX_BODY_BYTES)
        native_http.add_routes(app, service)
        openai.add_routes(app, service)
        weights_http.add_routes(app, service)
        role_switch.add_routes(app, service)
        remote_instance.add_routes(app, service)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """SGLang's API key check (``sglang_key_refusal``)."""
        refused = sglang_key_refusal(request, self.config.api_key)
        return refused if refused is not None else await handler(request)


@web.middleware
async def _sim_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A SimError no route caught (a body that is not JSON, on the small routes) is the
    client's fault: its status with SGLang's error body for its stage, not a 500 and a
    traceback; one log line."""
    try:
        return await handler(request)
    except SimError as exc:
        log.info("%s refused: %s", request.path, exc)
        body = exc.body() if isinstance(exc, ValidationError | ContractError) else generate_error_body(str(exc))
        return web.json_response(body, status=exc.status)


def torch_threads(n: int) -> None:
    torch.set_num_threads(max(1, n))
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
