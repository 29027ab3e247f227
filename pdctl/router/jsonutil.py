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


def json_object(raw: bytes) -> tuple[dict[str, Any], str | None]:
    """A control route's body as a JSON object (an empty body is ``{}``), or why it is not one."""
    if not raw.strip():
        return {}, None
    try:
        body = loads(raw)
    except ValueError as exc:
        return {}, f"invalid JSON body: {exc}"
    if not isinstance(body, dict):
        return {}, "the body must be a JSON object"
    return body, None
