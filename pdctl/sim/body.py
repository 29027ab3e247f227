"""Request bodies of the sim's routes: JSON parsed with orjson, whose nesting limit (1024)
and UTF-8 check turn hostile bodies into a 400, never a RecursionError."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from pdctl.errors import SimError

MAX_BODY_BYTES = 512 * 1024 * 1024
"""The sim's aiohttp ``client_max_size``: larger bodies get 413 before they are read."""


async def read_json(request: web.Request, default: Any = None) -> Any:
    """The parsed body; ``default`` when there is none (SimError 400 when none is allowed).

    Raises SimError (400) for bodies that are not JSON, not UTF-8 or nested too deep."""
    if not request.can_read_body:
        if default is not None:
            return default
        raise SimError("request body must be JSON")
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise SimError(f"invalid JSON: {exc}") from exc
