"""Small aiohttp helpers shared by the sim, the null engine and the router."""

from __future__ import annotations

from typing import Any

from aiohttp import web


async def start_site(app: web.Application, host: str, port: int, **runner_kwargs: Any) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on host:port (0 picks a free port); returns the runner and the bound port."""
    runner = web.AppRunner(app, access_log=None, **runner_kwargs)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = port
    server = getattr(site, "_server", None)
    if server is not None and server.sockets:
        bound = int(server.sockets[0].getsockname()[1])
    return runner, bound
