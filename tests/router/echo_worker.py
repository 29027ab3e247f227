"""A worker for compatibility tests: ``python -m tests.router.echo_worker --port P [--api-key K] [--fail]``.

Answers /health and SGLang's info routes; /generate answers with the headers it received (names in
lower case), 401 without the right key when it has one, 500 with --fail."""

from __future__ import annotations

import argparse

from aiohttp import web


def make_app(api_key: str | None, fail: bool) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        if api_key and request.headers.get("Authorization") != f"Bearer {api_key}":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        if fail:
            return web.json_response({"error": {"message": "worker broke", "code": 500}}, status=500)
        seen = {k.lower(): v for k, v in request.headers.items()}
        return web.json_response({"text": "ok", "headers": seen, "meta_info": {"finish_reason": {"type": "stop"}}})

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def info(_: web.Request) -> web.Response:
        # As minimal mock workers do: JSON text without a JSON content type, and no weight version.
        return web.Response(text='{"model_path": "echo", "is_generation": true}')

    app = web.Application()
    app.router.add_post("/generate", generate)
    for path in ("/health", "/health_generate", "/liveness", "/readiness"):
        app.router.add_get(path, ok)
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        app.router.add_get(path, info)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key")
    parser.add_argument("--fail", action="store_true")
    args = parser.parse_args()
    web.run_app(make_app(args.api_key, args.fail), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
