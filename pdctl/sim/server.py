"""The sim's HTTP server: SGLang's API over the Engine (sglang-protocol.md sections 2, 4, 5).

Native routes return ``{"error": {"message": ...}}`` on failure as SGLang does; OpenAI
routes live in openai.py. ``SimServer`` has ``start()``/``stop()`` and ``async with``; port
0 binds a free port (tests), reported by ``.port``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch
from aiohttp import web

from pdctl.errors import SimError
from pdctl.httputil import start_site
from pdctl.sglang import FAKE_BOOTSTRAP_HOST, Endpoint, generate_error_body, stream_error_chunk
from pdctl.sim import openai, weights_http
from pdctl.sim.body import MAX_BODY_BYTES, read_json
from pdctl.sim.engine import Engine, Mode, Request
from pdctl.sim.kv import KVStore, bootstrap_app, fetch_kv, waiting_timeout_secs
from pdctl.sim.metrics import SimMetrics
from pdctl.sim.model import TinyLM, resolve_model
from pdctl.sim.multinode import NodeLayout, PeerHub
from pdctl.sim.requests import GenerateBody, ItemSpec, generate_output, parse_generate
from pdctl.sim.sampling import SamplingOptions
from pdctl.sim.weights import WeightGroupMember

log = logging.getLogger("pdctl.sim")
SGLANG_VERSION = "0.5.23"  # the SGLang whose API the sim speaks (begin/end weight sessions exist)
DEFAULT_BOOTSTRAP_PORT = 8998
READY_LINE = "The server is fired up and ready to roll!"


@dataclass(frozen=True)
class SimConfig:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    tp_size: int = 1
    disaggregation_mode: str = "null"
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    load_format: str = "auto"
    random_seed: int = 0
    weight_version: str = "default"
    enable_metrics: bool = False
    api_key: str | None = None
    skip_server_warmup: bool = False
    context_length: int | None = None
    max_running_requests: int = 64
    max_queued_requests: int | None = None
    """SGLang: beyond this many waiting requests new ones get 503; ignored in PD modes."""
    prefill_ms_per_token: float = 0.0
    decode_ms_per_step: float = 0.0
    weight_digest: str = "full"
    """How TP ranks compare a weight update (``--sim-weight-digest``; sim/weights.py ``Digest``)."""
    layout: NodeLayout | None = None
    """Node rank 0 of a multi-node engine (multinode.py); None on one node."""
    dist_timeout_secs: float = 600.0
    server_args: tuple[tuple[str, Any], ...] = ()
    """Every parsed flag, reported by /server_info."""
    launch_command: str = ""

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model_path


class SimServer:
    """One sim engine: HTTP API, scheduler thread, optional bootstrap server and TP helpers."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.status = "starting"
        self.started_at = time.time()
        self.model: TinyLM | None = None
        self.engine: Engine | None = None
        self.members: WeightGroupMember | None = None
        self.kv_store: KVStore | None = None
        self.metrics = SimMetrics(config.served_name)
        self.session: aiohttp.ClientSession | None = None
        self.weight_session_open = False
        self._runners: list[web.AppRunner] = []
        self.port = config.port
        self.bootstrap_port = config.bootstrap_port
        self._prealloc_line = asyncio.Lock()  # FIFO: decode requests waiting for a KV slot, in arrival order
        self._slot_freed = asyncio.Event()  # set by the engine when a slot or a reservation frees
        self.prealloc_waiting = 0
        self.hub: PeerHub | None = None
        self.failed = asyncio.Event()
        """Set when the engine can no longer serve (a TP peer node died); the process then exits."""

    @property
    def weight_version(self) -> str:
        assert self.engine is not None
        return self.engine.weight_version

    @property
    def mode(self) -> str:
        return self.config.disaggregation_mode

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        c = self.config
        loop = asyncio.get_running_loop()
        peers: list = []
        if c.layout is not None:  # every TP rank rendezvouses before anything loads, as in SGLang
            self.hub = PeerHub(c.layout, c.model_path, self._peer_lost)
            peers = await self.hub.start(c.dist_timeout_secs)
        self.model = await asyncio.to_thread(resolve_model, c.model_path, c.load_format, c.context_length)
        local_ranks = c.layout.tp_per_node if c.layout else c.tp_size
        self.members = await asyncio.to_thread(WeightGroupMember, local_ranks, peers, c.weight_digest)
        if self.mode == "prefill":
            self.kv_store = KVStore(loop)
            runner, self.bootstrap_port = await start_site(bootstrap_app(self.kv_store), c.host, c.bootstrap_port)
            self._runners.append(runner)
        self.engine = Engine(
            self.model,
            max_running=c.max_running_requests,
            random_seed=c.random_seed,
            prefill_ms_per_token=c.prefill_ms_per_token,
            decode_ms_per_step=c.decode_ms_per_step,
            publish_kv=self.kv_store.put_threadsafe if self.kv_store else None,
            weight_version=c.weight_version,
        )
        self.engine.on_finish = self.metrics.observe_finished
        self.engine.on_capacity = lambda: loop.call_soon_threadsafe(self._slot_freed.set)
        self.engine.start()
        self.session = aiohttp.ClientSession()
        # handler_cancellation: a client that goes away cancels its handler, which aborts the request.
        runner, self.port = await start_site(self.app(), c.host, c.port, handler_cancellation=True)
        self._runners.append(runner)
        if not c.skip_server_warmup:
            await self._one_token()
        self.status = "up"
        log.info(READY_LINE)

    async def stop(self) -> None:
        self.status = "stopping"
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        if self.session:
            await self.session.close()
        if self.engine:
            await asyncio.to_thread(self.engine.stop)
        if self.members:
            await asyncio.to_thread(self.members.close)
        if self.hub:
            await self.hub.stop()

    def _peer_lost(self, reason: str) -> None:
        self.status = "failed"
        log.error("%s: this engine cannot serve any more; exiting", reason)
        self.failed.set()

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    # -- app ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth, _sim_errors], client_max_size=MAX_BODY_BYTES)
        r = app.router
        r.add_post(Endpoint.GENERATE.value, self.generate)
        r.add_get(Endpoint.HEALTH.value, self.health)
        r.add_get(Endpoint.HEALTH_GENERATE.value, self.health)
        r.add_get("/ready", self.ready)
        for path in (Endpoint.MODEL_INFO, Endpoint.GET_MODEL_INFO):
            r.add_get(path.value, self.model_info)
        for path in (Endpoint.SERVER_INFO, Endpoint.GET_SERVER_INFO):
            r.add_get(path.value, self.server_info)
        r.add_route("*", Endpoint.FLUSH_CACHE.value, self.flush_cache)
        r.add_post(Endpoint.PAUSE_GENERATION.value, self.pause_generation)
        r.add_post(Endpoint.CONTINUE_GENERATION.value, self.continue_generation)
        r.add_post(Endpoint.ABORT_REQUEST.value, self.abort_request)
        r.add_get(Endpoint.METRICS.value, self.metrics_endpoint)
        openai.add_routes(app, self)
        weights_http.add_routes(app, self)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        key = self.config.api_key
        path = request.path
        # SGLang leaves health, readiness and metrics open for probes (utils/auth.py).
        open_path = path.startswith(("/health", "/ready", "/metrics"))
        if key and not open_path and request.headers.get("Authorization", "") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    # -- generation core ---------------------------------------------------------------------
    async def submit_items(self, items: list[ItemSpec]) -> list[tuple[Request, asyncio.Queue]]:
        """Create and submit one engine Request per item (PD legs resolved here).

        For a decode leg this reserves a KV slot and fetches the KV from the prefill first.
        Raises SimError (400) for bad PD fields, or for a KV fetch that times out (500).
        """
        assert self.engine is not None
        loop = asyncio.get_running_loop()
        out = []
        try:
            for item in items:
                queue: asyncio.Queue = asyncio.Queue()

                def emit(req: Request, q: asyncio.Queue = queue) -> None:
                    loop.call_soon_threadsafe(q.put_nowait, (len(req.output_ids), req.finish is not None))

                req = Request(
                    rid=item.rid or self.engine.new_rid(),
                    input_ids=item.input_ids,
                    sampling=item.sampling,
                    emit=emit,
                    return_logprob=item.return_logprob,
                    top_logprobs_num=item.top_logprobs_num,
                )
                await self._resolve_pd(req, item)
                out.append((req, queue))
        except BaseException:
            for req, _ in out:
                self.engine.abort(req.rid, "batch failed")
            raise
        limit = self.config.max_queued_requests
        if limit is not None and self.mode == "null" and self.engine.stats()["num_queue_reqs"] + len(out) > limit:
            raise SimError("The request queue is full.", status=503)  # SGLang's words and status
        for req, _ in out:
            self.engine.submit(req)
        self.metrics.requests_started(len(out))
        return out

    async def _reserve_decode_slot(self) -> None:
        """Wait, in arrival order, for a KV slot (SGLang's decode prealloc queue: a full decode
        queues its requests, it does not refuse them). A client that goes away leaves the line."""
        assert self.engine is not None
        if self.prealloc_waiting == 0 and self.engine.reserve_slot():
            return
        self.prealloc_waiting += 1
        try:
            async with self._prealloc_line:
                while True:
                    self._slot_freed.clear()
                    if self.engine.reserve_slot():
                        break
                    with contextlib.suppress(asyncio.TimeoutError):  # a safety net: frees wake it at once
                        await asyncio.wait_for(self._slot_freed.wait(), 0.1)
        finally:
            self.prealloc_waiting -= 1

    async def _resolve_pd(self, req: Request, item: ItemSpec) -> None:
        assert self.engine is not None and self.session is not None
        if self.mode == "null":
            return
        fake = item.bootstrap_host == FAKE_BOOTSTRAP_HOST
        if not fake and (item.bootstrap_host is None or item.bootstrap_room is None):
            raise SimError(
                f"this is a PD {self.mode} server: requests need bootstrap_host and bootstrap_room "
                "(send them through a PD router)"
            )
        if self.mode == "prefill":
            req.mode = Mode.PREFILL
            req.room = None if fake else item.bootstrap_room
            return
        if fake:  # SGLang moves no KV for 2.2.2.2 (warm-up, /health); the sim runs the prompt itself
            return
        await self._reserve_decode_slot()
        req.reserved, req.mode = True, Mode.DECODE
        port = item.bootstrap_port if item.bootstrap_port is not None else self.config.bootstrap_port
        started = time.monotonic()
        try:
            payload = await fetch_kv(
                self.session, item.bootstrap_host, port, item.bootstrap_room, waiting_timeout_secs()
            )
            if payload.prompt_ids != req.input_ids:
                raise SimError(f"KV of bootstrap_room {item.bootstrap_room} belongs to another prompt")
        except BaseException as exc:  # the reserved slot is given back on every failure
            self.engine.release_slot()
            req.reserved = False
            if isinstance(exc, SimError):
                self.metrics.transfer_failed()
                raise SimError(str(exc), status=500) from exc
            raise
        self.metrics.kv_transferred(time.monotonic() - started, payload.kv.numel() * payload.kv.element_size())
        req.kv = payload

    async def events(self, req: Request, queue: asyncio.Queue) -> AsyncIterator[int]:
        """Yield the token count after each update until the request finishes."""
        while True:
            n, done = await queue.get()
            while not queue.empty():  # coalesce: each chunk carries the cumulative text
                n, done = queue.get_nowait()
            yield n
            if done:
                return

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_generate(await read_json(request))
        except SimError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        try:
            pairs = await self.submit_items(body.items)
        except SimError as exc:
            return web.json_response(generate_error_body(str(exc)), status=exc.status)
        try:
            if body.stream:
                return await self._stream_generate(request, body, pairs)
            results = []
            for req, queue in pairs:
                async for n in self.events(req, queue):
                    last = n
                results.append(generate_output(req, last, self.weight_version, pd_decode=req.mode is Mode.DECODE))
            return web.json_response(results if body.is_batch else results[0])
        finally:
            for req, _ in pairs:
                if not req.finished:
                    self.engine.abort(req.rid, "client disconnected")  # type: ignore[union-attr]

    async def _stream_generate(
        self, request: web.Request, body: GenerateBody, pairs: list[tuple[Request, asyncio.Queue]]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunks: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, req: Request, queue: asyncio.Queue) -> None:
            async for n in self.events(req, queue):
                out = generate_output(req, n, self.weight_version, pd_decode=req.mode is Mode.DECODE)
                if body.is_batch:
                    out["index"] = index
                await chunks.put(out)
            await chunks.put(None)

        tasks = [asyncio.ensure_future(pump(i, r, q)) for i, (r, q) in enumerate(pairs)]
        try:
            remaining = len(tasks)
            while remaining:
                chunk = await chunks.get()
                if chunk is None:
                    remaining -= 1
                    continue
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        finally:
            for task in tasks:
                task.cancel()
        for req, _ in pairs:
            if req.finish and req.finish.get("type") == "abort":
                error = stream_error_chunk(str(req.finish.get("message")), status=500)
                await resp.write(b"data: " + json.dumps(error).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _one_token(self, timeout_secs: float = 20.0) -> None:
        """SGLang's health probe: one token for input_ids [0] (fake bootstrap host in PD)."""
        pd = {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 0} if self.mode != "null" else {}
        item = ItemSpec(
            None,
            [0],
            SamplingOptions(max_new_tokens=1, temperature=0.0),
            False,
            pd.get("bootstrap_host"),
            None,
            pd.get("bootstrap_room"),
        )
        ((req, queue),) = await self.submit_items([item])

        async def drain() -> None:
            async for _ in self.events(req, queue):
                pass

        try:
            await asyncio.wait_for(drain(), timeout_secs)
        except asyncio.TimeoutError:
            self.engine.abort(req.rid, "health check timed out")  # type: ignore[union-attr]
            raise

    # -- small routes --------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.status != "up":
            return web.Response(status=503)
        try:
            await self._one_token()
        except (asyncio.TimeoutError, SimError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def ready(self, _: web.Request) -> web.Response:
        status = 200 if self.status == "up" else 503
        return web.json_response({"status": "ready" if status == 200 else self.status}, status=status)

    async def model_info(self, _: web.Request) -> web.Response:
        c = self.config
        return web.json_response(
            {
                "model_path": c.model_path,
                "served_model_name": c.served_name,
                "tokenizer_path": c.tokenizer_path or c.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "load_format": c.load_format,
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": self.mode,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "pdctl-sim",
                "architectures": ["TinyLM"],
            }
        )

    async def server_info(self, _: web.Request) -> web.Response:
        assert self.engine is not None and self.model is not None
        c = self.config
        stats = self.engine.stats()
        info = dict(c.server_args)
        info.update(
            {
                "model_path": c.model_path,
                "port": self.port,
                "host": c.host,
                "tp_size": c.tp_size,
                "disaggregation_mode": self.mode,
                "disaggregation_bootstrap_port": self.bootstrap_port,
                "weight_version": self.weight_version,
                "launch_command": c.launch_command,
                "max_total_num_tokens": c.max_running_requests * self.model.config.max_positions,
                "max_req_input_len": self.model.config.max_positions - 1,
                "internal_states": [
                    {
                        "last_gen_throughput": self.metrics.last_gen_throughput(),
                        **stats,
                        "num_decode_prealloc_queue_reqs": self.prealloc_waiting,
                    }
                ],
                "startup_time": self.started_at,
                "version": SGLANG_VERSION,
                "frontend": "python",
                "engine": "pdctl-sim",
            }
        )
        return web.json_response(info)

    async def flush_cache(self, _: web.Request) -> web.Response:
        assert self.engine is not None
        if self.engine.busy():
            return web.Response(
                status=400,
                text="Cache not flushed. Please check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n",
            )
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )

    async def pause_generation(self, request: web.Request) -> web.Response:
        assert self.engine is not None
        body = await read_json(request, default={})
        try:
            self.engine.pause(str(body.get("mode", "abort")))
        except SimError as exc:
            return web.json_response(generate_error_body(str(exc)), status=400)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        assert self.engine is not None
        self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        assert self.engine is not None
        body = await read_json(request, default={})
        self.engine.abort(None if body.get("abort_all") else str(body.get("rid")), "Abort requested")
        return web.Response(status=200)

    async def metrics_endpoint(self, _: web.Request) -> web.Response:
        if not self.config.enable_metrics:
            return web.json_response({"detail": "Not Found"}, status=404)
        assert self.engine is not None
        stats = {**self.engine.stats(), "num_decode_prealloc_queue_reqs": self.prealloc_waiting}
        return web.Response(body=self.metrics.render(stats), content_type="text/plain")


@web.middleware
async def _sim_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """A SimError no route caught (a body that is not JSON, on the small routes) is the
    client's fault: its status with SGLang's error body, not a 500 and a traceback."""
    try:
        return await handler(request)
    except SimError as exc:
        return web.json_response(generate_error_body(str(exc)), status=exc.status)


def torch_threads(n: int) -> None:
    torch.set_num_threads(max(1, n))
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
