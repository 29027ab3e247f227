"""What a router handler returns: a whole ``Reply`` or a ``StreamReply``; the HTTP server writes it.

Handlers (and the dispatcher under them) never touch the client's socket: a stream's body is an
async iterator of chunks, which the server writes as they come (chunked encoding, waiting while
the client does not read) and closes however the stream ends, the client going away included.

A body may also be a ``Pipe``: then the server hands it an ``Outlet`` (the client's connection
as a write-only seam) and the body writes into it from wherever its bytes come (the router's
relay writes each engine block from the engine connection's read callback: no task is woken per
event), telling the outlet when the body ends, and being told when the client stops and resumes
reading.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdctl.router.jsonutil import dumps


@dataclass(slots=True)
class Reply:
    """A whole response. ``headers`` are extra headers (Content-Type/Length are written for you)."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] | None = None
    reason: str | None = None
    """The status line's reason phrase instead of the standard one: clients that print only the
    phrase (AReaL: ``status=400, message='Bad Request'``) then print why. Sanitized when written."""


class StreamBody(Protocol):
    """A stream's body: its chunks as they come (``async for``); ``aclose()`` ends it and frees
    what it holds, whether or not it was read."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    def __anext__(self) -> Awaitable[bytes]: ...

    def aclose(self) -> Awaitable[None]: ...


class Flow(Protocol):
    """Who an outlet tells that the client stopped (``pause``) and went on (``resume``) reading."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class Outlet(Protocol):
    """Where a ``Pipe`` writes its body: the client's connection."""

    paused: bool
    """The client is not reading what was written (its writer should stop reading its source)."""
    flow: Flow | None
    """Told when ``paused`` changes."""

    def write(self, chunk: bytes, end: bool = False) -> None:
        """Send ``chunk`` (nothing when empty) now; ``end``: the body ends with it (one write with
        the end's framing). Writes after the end, or once the client has gone, are dropped."""
        ...


class Pipe(Protocol):
    """A body that writes itself into an outlet: ``pipe`` returns once the body has ended (its
    ``end`` written); it raises what broke it. The server prefers it to reading chunk by chunk."""

    def pipe(self, outlet: Outlet) -> Awaitable[None]: ...


@dataclass(slots=True)
class StreamReply:
    """A streamed response: the head now, then ``body``'s chunks (empty ones are skipped).

    ``body`` is an async iterator that closing frees (``aclose``): a generator must be a
    *started* one (see ``started``), so that closing it runs its cleanup even when not one chunk
    was read (the client left first). A body that is also a ``Pipe`` is piped. The server calls
    ``aclose()`` on it and then every ``on_close`` callback, once, however the stream ended."""

    status: int
    headers: dict[str, str] | None
    body: StreamBody
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
