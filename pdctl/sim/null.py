"""``python -m pdctl.sim.null``: a null SGLang engine that answers at once.

For router benchmarks and contract tests: no model, no KV; /generate (single, batch, stream),
the OpenAI routes, /health, /model_info and /server_info answer immediately with
SGLang-shaped bodies. ``--record FILE`` appends every request body (JSON lines), so tests
can check what a router sends. A prefill role also answers on its bootstrap port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import orjson
from aiohttp import web

from pdctl.httputil import add_site, sglang_key_refusal, start_site, write_port_file
from pdctl.sglang import SPOKEN_VERSION, Endpoint, batch_size_of
from pdctl.signals import stop_event

_dumps = orjson.dumps


def _item(i: int = 0) -> dict[str, Any]:
    return {
        "text": "ok",
        "output_ids": [111, 107],
        "meta_info": {
            "id": f"null-{i}",
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 1,
            "completion_tokens": 2,
            "cached_tokens": 0,
            "weight_version": "default",
        },
    }


def _stream_events(n: int) -> list[bytes]:
    """A /generate stream of ``n`` events of one token each (cumulative counts, as SGLang's),
    then [DONE]: each is written as its own chunk, as an engine writes tokens as they come."""
    out = []
    for k in range(1, n + 1):
        item = _item()
        item["text"] = "x" * k
        item["output_ids"] = [120] * k
        item["meta_info"] = {**item["meta_info"], "completion_tokens": k, "finish_reason": None}
        if k == n:
            item["meta_info"]["finish_reason"] = {"type": "length", "length": n}
        out.append(b"data: " + _dumps(item) + b"\n\n")
    return [*out, b"data: [DONE]\n\n"]


def make_app(
    role: str,
    record: str | None,
    busy: bool = False,
    stream_tokens: int = 0,
    *,
    api_key: str | None = None,
    weight_version: str = "default",
) -> web.Application:
    """The null engine's routes. ``api_key``: checked as SGLang checks its ``--api-key``;
    ``weight_version``: what ``/model_info`` says it holds."""
    # A PD prefill runs the prompt and returns one token, streamed or not (SGLang's; the sim's
    # PREFILL mode too): its stream is that token's event and [DONE], not the decode's tokens.
    streamed = _stream_events(1 if role == "prefill" else stream_tokens) if stream_tokens else None
    log = open(record, "a") if record else None  # noqa: SIM115 - lives as long as the app

    async def generate(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if busy:  # SGLang's answer when --max-queued-requests is reached
            return web.json_response({"error": {"message": "The request queue is full.", "code": 503}}, status=503)
        if log:
            log.write(raw.decode() + "\n")
            log.flush()
        body = json.loads(raw)
        n = batch_size_of(body) if request.path == Endpoint.GENERATE.value else None
        out: Any = [_item(i) for i in range(n)] if n else _item()
        if request.path == Endpoint.CHAT_COMPLETIONS.value:
            out = {
                "id": "x",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
            }
        elif request.path == Endpoint.COMPLETIONS.value:
            out = {
                "id": "x",
                "object": "text_completion",
                "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
            }
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if streamed is not None and request.path == Endpoint.GENERATE.value and not n:
                for event in streamed:
                    await resp.write(event)
            else:
                await resp.write(b"data: " + _dumps(out) + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.Response(body=_dumps(out), content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def info(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "null",
                "weight_version": weight_version,
                "disaggregation_mode": role,
                "version": SPOKEN_VERSION,
                "internal_states": [],
            }
        )

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "null", "object": "model", "owned_by": "pdctl"}]})

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        refused = sglang_key_refusal(request, api_key)
        return refused if refused is not None else await handler(request)

    app = web.Application(middlewares=[auth] if api_key else [])
    app.router.add_get("/v1/models", models)  # bench_serving waits for it
    for path in (Endpoint.GENERATE, Endpoint.COMPLETIONS, Endpoint.CHAT_COMPLETIONS):
        app.router.add_post(path.value, generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    for path in (Endpoint.MODEL_INFO, Endpoint.SERVER_INFO, Endpoint.GET_SERVER_INFO, Endpoint.GET_MODEL_INFO):
        app.router.add_get(path.value, info)
    return app


async def _bootstrap_health(_: web.Request) -> web.Response:
    return web.Response(text="OK")


async def serve(args: argparse.Namespace) -> None:
    await serve_null(
        args.host,
        args.port,
        args.role,
        args.bootstrap_port,
        args.port_file,
        record=args.record,
        busy=args.busy,
        stream_tokens=args.stream_tokens,
        listen=args.listen,
    )


async def serve_null(
    host: str,
    port: int,
    role: str,
    bootstrap_port: int | None,
    port_file: str | None,
    *,
    record: str | None = None,
    busy: bool = False,
    stream_tokens: int = 0,
    listen: int = 1,
    api_key: str | None = None,
    weight_version: str = "default",
) -> None:
    """Serve until SIGTERM/SIGINT (``make_app``'s routes; a prefill's bootstrap port too, when
    given); the bound ports go to ``port_file`` once every one listens."""
    app = make_app(role, record, busy, stream_tokens, api_key=api_key, weight_version=weight_version)
    runner, port = await start_site(app, host, port)
    line = f"pdctl.sim.null ({role}) on http://{host}:{port}"
    more = [await add_site(runner, host, 0) for _ in range(listen - 1)]
    if more:
        line += f" and {len(more)} more port(s)"
    bound_bootstrap = None
    if role == "prefill" and bootstrap_port is not None:
        boot = web.Application()
        boot.router.add_get("/health", _bootstrap_health)
        _, bound_bootstrap = await start_site(boot, host, bootstrap_port)
        line += f", bootstrap port {bound_bootstrap}"
    print(line, flush=True)
    write_port_file(port_file, port=port, bootstrap_port=bound_bootstrap, more_ports=more or None)
    await stop_event().wait()
    await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m pdctl.sim.null", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="0: any free port (printed on start).")
    p.add_argument("--role", choices=["regular", "prefill", "decode"], default="regular")
    p.add_argument("--bootstrap-port", type=int, help="A prefill's bootstrap port; 0: any free port.")
    p.add_argument("--record", help="Append every request body to this file (JSON lines).")
    p.add_argument("--busy", action="store_true", help="Answer every generation with 503 (a full queue).")
    p.add_argument("--stream-tokens", type=int, default=0, help="Streamed /generate: this many one-token chunks.")
    p.add_argument("--port-file", help="Once listening, write the bound ports here as JSON (port 0 picks any).")
    p.add_argument(
        "--listen",
        type=int,
        default=1,
        help="Answer on this many ports, the others any free ones (one process as a fleet of workers: "
        "router benchmarks at 1024 workers); the port file lists them as more_ports.",
    )
    args = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
