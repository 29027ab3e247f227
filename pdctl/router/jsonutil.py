"""Fast JSON for the request path (orjson, a dependency) and SSE events."""

from __future__ import annotations

from typing import Any

import orjson


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


def sse_data(event: bytes) -> dict | None:
    """The JSON object of an SSE ``data: {...}`` event; None for anything else ([DONE], junk)."""
    if not event.startswith(b"data: {"):
        return None
    try:
        value = loads(event[6:].strip())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def sse_event(value: Any) -> bytes:
    return b"data: " + dumps(value) + b"\n\n"
