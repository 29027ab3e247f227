"""An in-memory ``Upstream`` for tests, modelled on httpx's ``MockTransport``: every POST the
router would send to an engine goes to an async handler instead.

    async def engines(request: UpstreamRequest) -> MockReply:
        if request.base == PREFILL:
            raise UpstreamError("connection refused")      # the engine is down
        return MockReply(json={"text": "hi", "meta_info": {...}})

    server = RouterServer(config, upstream=MockUpstream(engines))

What a handler can do, and what the router sees:
- return a ``MockReply``: an answer (``json`` or ``body``), or for a stream ``chunks``, an async
  iterator of body chunks; an UpstreamError raised by the iterator is a connection dying mid-body;
- raise UpstreamError: no answer (a refused or reset connection);
- wait: a slow engine; past the request's timeout the router gets UpstreamTimeout;
- see ``asyncio.CancelledError``: the router gave up on the request (an engine would abort it).
Every request is kept in ``requests``, in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pdctl.router.jsonutil import dumps, loads
from pdctl.router.upstream import Answered, Posting, Response, Sending, UpstreamTimeout, cut_after_last


@dataclass(frozen=True)
class UpstreamRequest:
    url: str
    body: bytes
    headers: Mapping[str, str]
    stream: bool

    @property
    def base(self) -> str:
        """``scheme://host:port``: which worker it was sent to."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def path(self) -> str:
        return urlsplit(self.url).path

    def json(self) -> Any:
        return loads(self.body)


@dataclass
class MockReply:
    status: int = 200
    json: Any = None
    """Sent JSON-encoded unless ``body`` or ``chunks`` is given."""
    body: bytes | None = None
    chunks: AsyncIterator[bytes] | None = None
    """A body sent chunk by chunk (a stream); an UpstreamError from it ends the body early."""
    content_type: str = "application/json"
    headers: dict[bytes, bytes] = field(default_factory=dict)

    def body_parts(self) -> AsyncIterator[bytes]:
        if self.chunks is not None:
            return self.chunks
        return _once(self.body if self.body is not None else dumps(self.json))


Handler = Callable[[UpstreamRequest], Awaitable[MockReply]]


class MockUpstream:
    """An ``Upstream`` whose engines are ``handler``."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.requests: list[UpstreamRequest] = []
        self.closed = False
        self._closing: set[asyncio.Task] = set()  # streams the router stopped reading, being closed

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], *, stream: bool = False, timeout: float | None = None
    ) -> Response:
        request = UpstreamRequest(url, body, dict(headers), stream)
        self.requests.append(request)
        try:
            if stream:  # as the real pool does: the timeout covers the head and the body until disarmed
                deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
                reply = await asyncio.wait_for(self.handler(request), timeout)
                head = {b"content-type": reply.content_type.encode(), **reply.headers}
                source = _Chunks(reply, self._closing, deadline)
                return Response(reply.status, head, content_type=reply.content_type, _source=source)
            return await asyncio.wait_for(self._whole(request), timeout)
        except asyncio.TimeoutError:
            raise UpstreamTimeout("no answer within the request timeout") from None

    def send(
        self, url: str, body: bytes, headers: dict[str, str], answered: Answered, *, timeout: float | None = None
    ) -> Sending:
        return Posting(self.post(url, body, headers, timeout=timeout), answered)

    async def _whole(self, request: UpstreamRequest) -> Response:
        reply = await self.handler(request)
        body = b"".join([part async for part in reply.body_parts()])
        head = {b"content-type": reply.content_type.encode(), **reply.headers}
        return Response(reply.status, head, body, reply.content_type)

    def close(self) -> None:
        self.closed = True


class _Chunks:
    """A streamed reply's body, read once."""

    def __init__(self, reply: MockReply, closing: set[asyncio.Task], deadline: float | None):
        self._parts = reply.body_parts()
        self._finished = False
        self._closing = closing
        self._deadline = deadline

    async def body_chunks(self, boundary: bytes = b"") -> AsyncIterator[bytes]:
        parts = self._parts.__aiter__()
        held = b""
        while True:
            try:
                if self._deadline is None:
                    part = await parts.__anext__()
                else:
                    remaining = self._deadline - asyncio.get_running_loop().time()
                    part = await asyncio.wait_for(parts.__anext__(), max(remaining, 0))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise UpstreamTimeout("no answer within the request timeout") from None
            if boundary:
                part, held = cut_after_last(held + part, boundary)
            if part:
                yield part
        if held:
            yield held
        self._finished = True

    def disarm(self) -> None:
        self._deadline = None

    def finished(self) -> bool:
        return self._finished

    def close(self) -> None:
        """The reader went away: the sender's generator is closed (it sees GeneratorExit)."""
        close = getattr(self._parts, "aclose", None)
        if close is not None:
            task = asyncio.ensure_future(close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data
