"""The sim's SGLang-native routes: /generate, health, info, cache, pause/continue, abort, metrics
(sglang-protocol.md sections 2 and 5). Failures answer ``{"error": {"message": ...}}`` as SGLang's do."""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any

from aiohttp import web

from pdctl.errors import SimError
from pdctl.sglang import SPOKEN_VERSION, Endpoint, generate_error_body, server_flags
from pdctl.sglang.control import memory_tags
from pdctl.sglang.protocol import resolve_server_args
from pdctl.sim.body import ContractError, ValidationError, read_json, read_object
from pdctl.sim.engine import Mode, first_failure
from pdctl.sim.requests import GenerateBody, Limits, failed_output, generate_output, parse_generate
from pdctl.sim.service import Running, SimService
from pdctl.sim.sse import EventStream

log = logging.getLogger("pdctl.sim")


def add_routes(app: web.Application, service: SimService) -> None:
    routes = NativeRoutes(service)
    r = app.router
    r.add_post(Endpoint.GENERATE.value, routes.generate)
    r.add_get(Endpoint.HEALTH.value, routes.health)
    r.add_get(Endpoint.HEALTH_GENERATE.value, routes.health)
    r.add_get("/ready", routes.ready)
    for path in (Endpoint.MODEL_INFO, Endpoint.GET_MODEL_INFO):
        r.add_get(path.value, routes.model_info)
    for path in (Endpoint.SERVER_INFO, Endpoint.GET_SERVER_INFO):
        r.add_get(path.value, routes.server_info)
    r.add_route("*", Endpoint.FLUSH_CACHE.value, routes.flush_cache)
    r.add_post(Endpoint.PAUSE_GENERATION.value, routes.pause_generation)
    r.add_post(Endpoint.CONTINUE_GENERATION.value, routes.continue_generation)
    r.add_post(Endpoint.ABORT_REQUEST.value, routes.abort_request)
    r.add_route("*", Endpoint.RELEASE_MEMORY_OCCUPATION.value, routes.release_memory)
    r.add_route("*", Endpoint.RESUME_MEMORY_OCCUPATION.value, routes.resume_memory)
    r.add_get(Endpoint.METRICS.value, routes.metrics)
    r.add_get(Endpoint.LOADS.value, routes.loads)


class NativeRoutes:
    """The handlers of SGLang's native routes over one SimService; each answers as SGLang 0.5.23 does
    (sglang-protocol.md sections 2 and 5)."""

    def __init__(self, service: SimService):
        self.s = service
        self.limits = Limits.of(service.config, service.model.config.vocab_size, service.engine.context)

    def _output(self, running: Running, tokens: int) -> dict:
        req = running.request
        return generate_output(req, tokens, self.s.weight_version, pd_decode=req.mode is Mode.DECODE)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``POST /generate``: one prompt or a batch, as one JSON answer or an SSE stream. A refused body gets SGLang's
        400 for its stage; a request that fails gets its status with SGLang's error body (in a stream, an output
        event ending in an abort)."""
        raw = await read_json(request)
        try:
            body = parse_generate(raw, self.limits)
        except SimError as exc:
            return await refuse(request, raw, exc)
        if body.stream:  # SGLang sends a stream's head at once: what fails later is an event in it
            return await self._stream(request, body)
        try:
            batch = await self.s.submit(body.items)
        except SimError as exc:
            return web.json_response(generate_error_body(str(exc)), status=exc.status)
        with self.s.aborting_unfinished(batch):
            results = [self._output(running, await self.s.finished(running)) for running in batch]
        failure = first_failure(r.request for r in batch)
        if failure is not None:
            return web.json_response(generate_error_body(failure[0]), status=failure[1])
        return web.json_response(results if body.is_batch else results[0])

    async def _stream(self, request: web.Request, body: GenerateBody) -> web.StreamResponse:
        """Each update is an output event; a request that ends in an abort ends with its output
        (finish_reason abort, with the status when it failed), as SGLang 0.5.23 streams it: no
        separate error event. A request that fails before its first token (a decode whose KV
        cannot come) is one such output after a 200 head."""
        stream = await EventStream.open(request)
        try:
            batch = await self.s.submit(body.items, stream=True)
        except SimError as exc:
            for index, item in enumerate(body.items):
                rid = item.rid or self.s.engine.new_rid()
                out = failed_output(item, rid, exc, self.s.weight_version, pd_decode=self.s.mode == "decode")
                if body.is_batch:
                    out["index"] = index
                await stream.send(out)
            return await stream.close()
        with self.s.aborting_unfinished(batch):
            async for index, tokens, _ in self.s.interleaved(batch):
                out = self._output(batch[index], tokens)
                if body.is_batch:
                    out["index"] = index
                await stream.send(out)
        return await stream.close()

    async def health(self, _: web.Request) -> web.Response:
        """``GET /health`` and ``/health_generate``: 200 once a one-token generation completes, 503 while the server is
        not up or when that generation fails or times out, as SGLang's shared handler answers."""
        if self.s.status != "up":
            return web.Response(status=503)
        try:
            await self.s.one_token()
        except (asyncio.TimeoutError, SimError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def ready(self, _: web.Request) -> web.Response:
        """``GET /ready``: 200 ``{"status": "ready"}`` once up, else 503 with the current status."""
        status = 200 if self.s.status == "up" else 503
        return web.json_response({"status": "ready" if status == 200 else self.s.status}, status=status)

    async def model_info(self, _: web.Request) -> web.Response:
        """``GET /model_info`` (and ``/get_model_info``): SGLang's model info fields, with the current weight version
        and role."""
        c = self.s.config
        return web.json_response(
            {
                "model_path": c.model_path,
                "served_model_name": c.served_name,
                "tokenizer_path": c.tokenizer_path or c.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.s.weight_version,
                "load_format": c.load_format,
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": self.s.mode,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "pdctl-sim",
                "architectures": ["TinyLM"],
            }
        )

    async def server_info(self, _: web.Request) -> web.Response:
        """``GET /server_info`` (and ``/get_server_info``): every server arg at its start-up value (flags not given at
        SGLang's default), scheduler figures, and ``internal_states`` with the current load and role."""
        s, c = self.s, self.s.config
        stats = s.engine.stats()  # (one reading: the totals and the counts agree)
        # The top level is the start-up configuration (a role switch shows in internal_states only).
        # A flag not given is reported at SGLang's default, as SGLang reports it (slime asserts
        # enable_memory_saver is False and a prefill's load_balance_method resolved from 'auto').
        defaults = {f.dest: f.default for f in server_flags().flags}
        given = {k: v for k, v in c.server_args if v is not None or k not in defaults}
        info = resolve_server_args({**defaults, **given, "disaggregation_mode": c.disaggregation_mode})
        info.update(
            {
                "model_path": c.model_path,
                "port": s.port,
                "host": c.host,
                "tp_size": c.tp_size,
                "disaggregation_mode": c.disaggregation_mode,
                "disaggregation_bootstrap_port": s.bootstrap_port,
                "weight_version": s.weight_version,
                "launch_command": c.launch_command,
                "max_total_num_tokens": stats["kv_total_tokens"],
                "max_req_input_len": s.engine.context - 1,
                "internal_states": [
                    {
                        "last_gen_throughput": s.metrics.last_gen_throughput(),
                        **stats,
                        "num_decode_prealloc_queue_reqs": s.prealloc_waiting,
                        "num_prefill_prealloc_queue_reqs": s.bootstrap_waiting,
                        **(
                            {
                                "disaggregation_mode": s.mode,
                                # the batch sizes it captured: none on a prefill never switched to decode
                                "decode_cuda_graph_bs": decode_graph_batch_sizes(s.engine.capacity)
                                if s.decode_graphs
                                else [],
                                "decode_cuda_graph_memory_gb": 0.0,  # no GPU: no graph memory
                            }
                            if s.mode != "null"
                            else {}
                        ),
                    }
                ],
                "startup_time": s.started_at,
                "version": SPOKEN_VERSION,
                "frontend": "python",
                "engine": "pdctl-sim",
            }
        )
        return web.json_response(info)

    async def flush_cache(self, _: web.Request) -> web.Response:
        """``/flush_cache``: SGLang's ``Cache flushed.`` text, or 400 while requests are running or waiting. The sim has
        no cache to flush."""
        if self.s.engine.busy():
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
        """``POST /pause_generation``: pause in the body's ``mode`` (default ``abort``) and answer SGLang's success body
        once the scheduler has acted; 400 for an unknown mode."""
        body = await read_object(request, default={})
        mode = str(body.get("mode", "abort"))
        try:
            self.s.engine.pause(mode)
        except SimError as exc:
            return web.json_response(generate_error_body(str(exc)), status=400)
        if mode == "abort":
            self.s.abort_epoch += 1
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, _: web.Request) -> web.Response:
        """``POST /continue_generation``: undo a pause and answer SGLang's success body."""
        self.s.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        """``POST /abort_request``: abort the request ``rid``, or every request with ``abort_all``; always 200 with an
        empty body, as SGLang answers."""
        body = await read_object(request, default={})
        if body.get("abort_all"):
            self.s.abort_epoch += 1
        self.s.engine.abort(None if body.get("abort_all") else str(body.get("rid")), "Abort requested")
        return web.Response(status=200)

    async def release_memory(self, request: web.Request) -> web.Response:
        """200 with ``null`` as SGLang answers (its handler returns nothing); its error body otherwise."""
        try:
            tags = memory_tags(await read_json(request, default={}))
            await asyncio.to_thread(self.s.engine.release_memory, tags)
        except (SimError, ValueError) as exc:
            return web.json_response(generate_error_body(str(exc)), status=400)
        return web.Response(body=b"null", content_type="application/json")

    async def resume_memory(self, request: web.Request) -> web.Response:
        """``/resume_memory_occupation``: 200 with ``null`` as SGLang answers; 400 with its error body for bad tags."""
        try:
            tags = memory_tags(await read_json(request, default={}))
            await asyncio.to_thread(self.s.engine.resume_memory, tags)
        except (SimError, ValueError) as exc:
            return web.json_response(generate_error_body(str(exc)), status=400)
        return web.Response(body=b"null", content_type="application/json")

    async def loads(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's ``GET /v1/loads`` (``entrypoints/v1_loads.py``) for one DP rank: the core
        scalars always (slime reads ``num_running_reqs`` + ``num_waiting_reqs`` after its abort
        until they are 0), and ``disaggregation`` and ``queues`` unless ``include`` is ``core`` only.
        An ``include`` section SGLang does not know fails as SGLang's does (an unhandled error: 500)."""
        asked = request.query.get("include")
        include = {part.strip() for part in asked.split(",")} if asked else None
        if include is not None and not include <= LOAD_SECTIONS:
            return web.Response(status=500, text="Internal Server Error")
        s, c = self.s, self.s.config
        stats = s.engine.stats()
        running, waiting = stats["num_running_reqs"], stats["num_queue_reqs"] + s.prealloc_waiting
        total, used = stats["kv_total_tokens"], stats["kv_used_tokens"]
        costed = s.engine.costed
        load: dict[str, Any] = {
            "timestamp": time.time(), "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": 0, "num_used_tokens": used, "num_total_tokens": total,
            "num_active_tokens": 0, "num_prealloc_ready_tokens": 0, "max_total_num_tokens": total,
            "max_running_requests": s.engine.capacity, "token_usage": round(used / total, 4) if total else 0.0,
            "gen_throughput": s.metrics.last_gen_throughput(),
            "cache_hit_rate": round(costed.hit_rate, 4) if costed is not None else 0.0, "utilization": 0.0,
            "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0, "decode_moments": None,
        }  # fmt: skip
        if include is None or "all" in include or "disagg" in include:
            load["disaggregation"] = {"mode": s.mode, "decode_prealloc_queue_reqs": s.prealloc_waiting}
        if include is None or "all" in include or "queues" in include:
            load["queues"] = {"waiting": stats["num_queue_reqs"], "paused": 0, "retracted": 0}
        return web.json_response(
            {
                "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "version": SPOKEN_VERSION,
                "accelerator": None,
                "num_accelerators": c.tp_size,
                "loads": [load],
            }
        )

    async def metrics(self, _: web.Request) -> web.Response:
        """``GET /metrics``: the Prometheus text of SGLang's ``sglang:`` metrics; 404 unless ``--enable-metrics``, as in
        SGLang."""
        if not self.s.config.enable_metrics:
            return web.json_response({"detail": "Not Found"}, status=404)
        stats = {
            **self.s.engine.stats(),
            "num_decode_prealloc_queue_reqs": self.s.prealloc_waiting,
            "num_decode_transfer_queue_reqs": self.s.transferring,
            "num_prefill_prealloc_queue_reqs": self.s.bootstrap_waiting,
        }
        return web.Response(body=self.s.metrics.render(stats), content_type="text/plain")


LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
"""``include`` sections SGLang 0.5.23's ``/v1/loads`` knows (``LoadSnapshot.VALID_SECTIONS``)."""


async def refuse(request: web.Request, raw: Any, exc: SimError) -> web.StreamResponse:
    """A /generate body SGLang refuses, answered as it answers: the parse stages' 400 (their
    shapes), a later stage's 400 ``{"error": {"message"}}``, or for ``stream: true`` that error
    as the one event of a 200 stream (``serve_generate_request``). One log line, no traceback."""
    log.info("%s refused: %s", request.path, exc)
    if isinstance(exc, ValidationError | ContractError):
        return web.json_response(exc.body(), status=exc.status)
    if isinstance(raw, dict) and raw.get("stream") is True:
        stream = await EventStream.open(request)
        error = {"message": str(exc), "type": "invalid_request_error", "code": exc.status, "retryable": False}
        await stream.send({"error": error})
        return await stream.close()
    return web.json_response(generate_error_body(str(exc)), status=exc.status)


def decode_graph_batch_sizes(max_bs: int) -> list[int]:
    """The decode CUDA graph batch sizes SGLang captures by default for at most ``max_bs`` running
    requests (``arg_groups/cuda_graph_hook.py`` ``generate_decode_cuda_graph_batch_sizes``, no
    speculative decoding): what its ``/server_info`` reports as ``decode_cuda_graph_bs``."""
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    return sorted({bs for bs in sizes if bs <= max_bs} | {max_bs})
