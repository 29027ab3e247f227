"""What a router handler returns: a whole ``Reply`` or a ``StreamReply``; the HTTP server writes it.

Handlers (and the dispatcher under them) never touch the client's socket: a stream is an async
generator of body chunks, which the server writes as they come (chunked encoding, waiting while
the client does not read) and closes however the stream ends, the client going away included.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from pdctl.router.jsonutil import dumps


@dataclass(slots=True)
class Reply:
    """A whole response. ``headers`` are extra headers (Content-Type/Length are written for you)."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] | None = None


@dataclass(slots=True)
class StreamReply:
    """A streamed response: the head now, then ``body``'s chunks (empty ones are skipped).

    ``body`` is a *started* async generator (see ``started``), so that closing it runs its
    cleanup even when not one chunk was read (the client left first). The server calls
    ``aclose()`` on it and then every ``on_close`` callback, once, however the stream ended."""

    status: int
    headers: dict[str, str] | None
    body: AsyncGenerator[bytes, None]
    content_type: str = "text/event-stream"
    on_close: list[Callable[[], None]] = field(default_factory=list)


Answer = Reply | StreamReply


async def started(body: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """``body`` run up to its first ``yield b""`` (a stream generator opens its ``try`` with it):
    from here on, ``aclose()`` runs its ``finally`` blocks. A generator never started would skip
    them, leaving its legs, loads and connections behind."""
    first = await body.__anext__()
    assert first == b"", "a stream body starts with yield b''"
    return body


def json_reply(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
    return Reply(status, dumps(value), "application/json", headers)


def text_reply(text: str, status: int = 200, content_type: str = "text/plain; charset=utf-8") -> Reply:
    return Reply(status, text.encode(), content_type)
