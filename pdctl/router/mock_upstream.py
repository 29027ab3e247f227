"""An in-memory ``Upstream`` for tests, modelled on httpx's ``MockTransport``: every POST the
router would send to an engine goes to an async handler instead.

    async def engines(request: UpstreamRequest) -> MockReply:
        if request.base == PREFILL:
            raise UpstreamError("connection refused")      # the engine is down
        return MockReply(json={"text": "hi", "meta_info": {...}})

    server = RouterServer(config, upstream=MockUpstream(engines))

What a handler can do, and what the router sees:
- return a ``MockReply``: an answer (``json`` or ``body``), or for a stream ``chunks``, an async
  iterator of body chunks, each read by the router as a read of its own; an UpstreamError raised
  by the iterator is a connection dying mid-body;
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
from pdctl.router.upstream import (
    Answered,
    Posting,
    Response,
    Sending,
    Streaming,
    StreamSink,
    UpstreamError,
    UpstreamTimeout,
)


@dataclass(frozen=True)
class UpstreamRequest:
    """A request the router sent to a mock engine, as recorded (``MockUpstream.requests``)."""

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
        """The URL's path, without its query."""
        return urlsplit(self.url).path

    def json(self) -> Any:
        """The body parsed as JSON; raises ValueError when it is not JSON."""
        return loads(self.body)


@dataclass
class MockReply:
    """What a mock engine answers: a status, and a body given as JSON, bytes or chunks."""

    status: int = 200
    json: Any = None
    """Sent JSON-encoded unless ``body`` or ``chunks`` is given."""
    body: bytes | None = None
    chunks: AsyncIterator[bytes] | None = None
    """A body sent chunk by chunk (a stream); an UpstreamError from it ends the body early."""
    content_type: str = "application/json"
    headers: dict[bytes, bytes] = field(default_factory=dict)

    def body_parts(self) -> AsyncIterator[bytes]:
        """The body's parts: ``chunks`` when given, else ``body`` (or ``json`` encoded) in one part."""
        if self.chunks is not None:
            return self.chunks
        return _once(self.body if self.body is not None else dumps(self.json))


Handler = Callable[[UpstreamRequest], Awaitable[MockReply]]


class MockUpstream:
    """An ``Upstream`` whose engines are ``handler``."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.requests: list[UpstreamRequest] = []
        self.streams: list[_Stream] = []
        """Every streamed answer, in order (a test reads whether the router holds one back)."""
        self.closed = False
        self._hung: dict[str, list[asyncio.Future[str]]] = {}
        """Per server (``scheme://host:port``), a future for each whole request in flight that
        ``fail_host`` sets to end it."""

    async def _post(self, url: str, body: bytes, headers: dict[str, str], timeout: float | None) -> Response:
        request = UpstreamRequest(url, body, dict(headers), False)
        self.requests.append(request)
        hung: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        waiting = self._hung.setdefault(request.base, [])
        waiting.append(hung)
        whole = asyncio.ensure_future(self._whole(request))
        try:
            either: set[asyncio.Future[Any]] = {whole, hung}
            done, _ = await asyncio.wait(either, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if whole in done:
                return whole.result()
            if hung in done:
                raise UpstreamError(hung.result())
            raise UpstreamTimeout("no answer within the request timeout")
        finally:
            whole.cancel()
            waiting.remove(hung)

    def send(
        self, url: str, body: bytes, headers: dict[str, str], answered: Answered, *, timeout: float | None = None
    ) -> Sending:
        """See ``Upstream.send``: the handler's whole answer, recorded in ``requests``, failed by ``fail_host`` or the
        timeout."""
        return Posting(self._post(url, body, headers, timeout), answered)

    def stream(
        self, url: str, body: bytes, headers: dict[str, str], sink: StreamSink, *, timeout: float | None = None
    ) -> Streaming:
        """See ``Upstream.stream``: the handler's answer fed to ``sink``, recorded in ``requests`` and ``streams``."""
        request = UpstreamRequest(url, body, dict(headers), True)
        self.requests.append(request)
        stream = _Stream(self.handler(request), sink, timeout)
        stream.base = request.base
        self.streams.append(stream)
        return stream

    def fail_host(self, url: str, reason: str) -> None:
        """See ``Upstream.fail_host``."""
        base = UpstreamRequest(url, b"", {}, False).base
        for hung in self._hung.get(base, []):
            if not hung.done():
                hung.set_result(reason)
        for stream in self.streams:
            if stream.base == base and stream.sink is not None:
                stream.fail(UpstreamError(reason))

    async def _whole(self, request: UpstreamRequest) -> Response:
        reply = await self.handler(request)
        body = b"".join([part async for part in reply.body_parts()])
        head = {b"content-type": reply.content_type.encode(), **reply.headers}
        return Response(reply.status, head, body, reply.content_type)

    def close(self) -> None:
        """Mark the upstream closed (``closed``); requests in flight are not ended."""
        self.closed = True


class _Stream:
    """A streamed answer fed to its sink by a task, as the real pool's connection does: the head,
    then each of the reply's chunks as a read of its own, then the end (or the failure). The
    timeout covers the head and the body until disarmed; cancelling it closes the handler's
    chunks (the engine sees the reader go away)."""

    def __init__(self, reply: Awaitable[MockReply], sink: StreamSink, timeout: float | None):
        loop = asyncio.get_running_loop()
        self.sink: StreamSink | None = sink
        self.base = ""
        self.deadline = None if timeout is None else loop.time() + timeout
        self.reading = asyncio.Event()
        self.reading.set()
        self.task = asyncio.ensure_future(self._run(reply))

    def _left(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - asyncio.get_running_loop().time(), 0)

    async def _run(self, answer: Awaitable[MockReply]) -> None:
        try:
            reply = await asyncio.wait_for(answer, self._left())
            head = {b"content-type": reply.content_type.encode(), **reply.headers}
            if self.sink is None:
                return
            self.sink.head(Response(reply.status, head, content_type=reply.content_type))
            parts = reply.body_parts().__aiter__()
            try:
                while self.sink is not None:
                    await self.reading.wait()
                    try:
                        part = await asyncio.wait_for(parts.__anext__(), self._left())
                    except StopAsyncIteration:
                        break
                    if part and self.sink is not None:
                        self.sink.data(part, False)
            except asyncio.CancelledError:
                close = getattr(parts, "aclose", None)
                if close is not None:
                    await close()  # (one waiting at a yield sees GeneratorExit)
                raise
            if self.sink is not None:
                sink, self.sink = self.sink, None
                sink.data(b"", True)
        except asyncio.TimeoutError:
            self._failed(UpstreamTimeout("no answer within the request timeout"))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # an UpstreamError: the connection died; anything else: a bug
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.failed(exc)

    def cancel(self) -> None:
        self.sink = None
        self.task.cancel()  # (the handler, or its chunks' generator, sees CancelledError)

    def fail(self, exc: BaseException) -> None:
        """Its connection broke: the sink hears it, the handler sees the reader go away."""
        self._failed(exc)
        self.task.cancel()

    def pause(self) -> None:
        self.reading.clear()

    def resume(self) -> None:
        self.reading.set()

    def disarm(self) -> None:
        self.deadline = None


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data
