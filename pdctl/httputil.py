"""Small aiohttp helpers shared by the sim, the null engine and the router."""

from __future__ import annotations

from typing import Any

from aiohttp import web


async def start_site(app: web.Application, host: str, port: int, **runner_kwargs: Any) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on host:port (0 picks a free port); returns the runner and the bound port."""
    runner = web.AppRunner(app, access_log=None, **runner_kwargs)
    await runner.setup()
    return runner, await add_site(runner, host, port)


async def add_site(runner: web.AppRunner, host: str, port: int) -> int:
    """Serve ``runner``'s app on one more host:port (0 picks a free port); returns the bound port."""
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    server = getattr(site, "_server", None)
    return bound_port(server) if server is not None and server.sockets else port


def bound_port(server: Any) -> int:
    """The port an asyncio server listens on (its first socket's). ``server`` is untyped on purpose:
    uvloop's ``sockets`` is a list where asyncio's is a tuple."""
    return int(server.sockets[0].getsockname()[1])


def write_port_file(path: str | None, **ports: int | list[int] | None) -> None:
    """Write the ports a server bound (port 0 picks any) to ``path`` as JSON, atomically (a reader
    never sees half a file), 0600: how tests and tools learn them, rather than from log text."""
    if not path:
        return
    import json
    import os

    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({k: v for k, v in ports.items() if v is not None}, out)
    os.replace(tmp, path)


def bearer_matches(header: str | None, key: str) -> bool:
    """Whether ``header`` is ``Bearer <key>`` (scheme in any case), compared in constant time."""
    import hmac

    parts = (header or "").split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    # As bytes: SGLang's secrets.compare_digest on str raises for non-ASCII text (a 500 there).
    return hmac.compare_digest(parts[1].encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape"))


def sglang_key_refusal(request: web.Request, key: str | None) -> web.Response | None:
    """SGLang's API key check (utils/auth.py ``decide_request_auth``): health, readiness and
    metrics (by prefix) and OPTIONS are open; everything else, unknown paths included, needs
    ``Authorization: Bearer <key>``. The 401 to send, or None to go on."""
    open_path = request.method == "OPTIONS" or request.path.startswith(("/health", "/ready", "/metrics"))
    if key and not open_path and not bearer_matches(request.headers.get("Authorization"), key):
        return web.json_response({"error": "Unauthorized"}, status=401)
    return None
