"""A lean HTTP/1.1 keep-alive client for the router's hot path (router -> engines).

aiohttp's client cost about 150 us of CPU per call in profiles, two calls per PD request;
this one (asyncio.Protocol + httptools, the parser uvicorn uses) does only what the
router needs: POST a JSON body, read a Content-Length or chunked response, whole or as a
stream; pooled connections per host; a connection that was reused and died before any
answer is retried once on a fresh one. Cancelling a request closes its connection, so the
engine sees the client go away and aborts the request.

Two ways in: ``post``, a coroutine (streams, and a request that must connect first), and
``send``, which starts a whole request on a pooled connection and has the connection's parser
callbacks answer it (no task or coroutine per request: the router's legs use it).

``Upstream`` is the interface the dispatcher uses; ``UpstreamPool`` is the real one and
``pdctl.router.mock_upstream.MockUpstream`` an in-memory one for tests.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import httptools

from pdctl.router.http1 import header_lines


class UpstreamError(ConnectionError):
    """The connection failed or closed before a complete response."""


class UpstreamTimeout(UpstreamError):
    """No complete answer within the request timeout."""


class BodySource(Protocol):
    """Where a streamed response's body comes from (a connection, or a test's chunks)."""

    def body_chunks(self, boundary: bytes = b"") -> AsyncIterator[bytes]:
        """The body's chunks as they arrive (cut as ``Response.chunks`` says); raises
        UpstreamError if it ends before complete."""
        ...

    def finished(self) -> bool:
        """True once the whole body was read."""
        ...

    def close(self) -> None:
        """Stop reading: the sender sees the reader go away."""
        ...

    def disarm(self) -> None:
        """The request timeout no longer applies to the rest of the body."""
        ...


@dataclass(slots=True)
class Response:
    status: int
    headers: dict[bytes, bytes]
    """As the engine sent them (names not case-folded); a repeated header keeps its last value."""
    body: bytes = b""
    content_type: str = "application/json"
    _source: BodySource | None = field(default=None, repr=False)

    def chunks(self, boundary: bytes = b"") -> AsyncIterator[bytes]:
        """The body as it arrives (streamed responses only; read once). With ``boundary``, each
        chunk ends with it: what comes after the last one waits for the rest (a tail with none
        comes last, at the end of the body)."""
        assert self._source is not None
        return self._source.body_chunks(boundary)

    async def read(self) -> bytes:
        """The rest of a streamed body, whole."""
        return b"".join([c async for c in self.chunks()])

    def close(self) -> None:
        """Drop the connection unless the response was read to the end (then it is pooled)."""
        if self._source is not None and not self._source.finished():
            self._source.close()

    def disarm(self) -> None:
        """A stream's first event came: the request timeout no longer bounds the rest of it."""
        if self._source is not None:
            self._source.disarm()


class Upstream(Protocol):
    """How the router talks to engines: POST a JSON body, get the answer (or its head)."""

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], *, stream: bool = False, timeout: float | None = None
    ) -> Response:
        """The whole response, or (``stream``) status and headers with ``chunks()`` to read.

        Raises UpstreamError when the connection fails, UpstreamTimeout when ``timeout`` passes:
        for the whole answer, or a stream's until ``Response.disarm()`` (then a stream's body
        raises it from ``chunks()``).
        Cancelling it closes the connection (the engine sees the client go away)."""
        ...

    def send(
        self, url: str, body: bytes, headers: dict[str, str], answered: Answered, *, timeout: float | None = None
    ) -> Sending:
        """Start a POST whose answer is read whole; ``answered`` is called once, with the Response
        or with the exception that ended it (UpstreamError, UpstreamTimeout past ``timeout``), and
        never after ``Sending.cancel()``, which closes the connection (the engine sees the client
        go away). No task or coroutine is made for it where a pooled connection is ready."""
        ...

    def close(self) -> None:
        """Close every connection."""
        ...


Answered = Callable[["Response | BaseException"], None]


class Sending(Protocol):
    """A request started by ``Upstream.send``."""

    def cancel(self) -> None:
        """Stop it: its connection is closed and ``answered`` is not called."""
        ...


class Posting:
    """``Upstream.send`` over a ``post`` coroutine run as a task: for a request that must connect
    first, and for upstreams with no callback path of their own (MockUpstream)."""

    __slots__ = ("answered", "task")

    def __init__(self, post: Coroutine[Any, Any, Response], answered: Answered):
        self.answered: Answered | None = answered
        self.task = asyncio.ensure_future(post)
        self.task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Response]) -> None:
        answered, self.answered = self.answered, None
        if answered is None:
            return  # cancel() was called
        if task.cancelled():  # by someone else (the loop shutting down): an answer all the same
            answered(UpstreamError("the request was cancelled"))
            return
        exc = task.exception()
        answered(task.result() if exc is None else exc)

    def cancel(self) -> None:
        self.answered = None
        self.task.cancel()  # post closes its connection when cancelled


class _Sent:
    """A request started by ``UpstreamPool.send`` on a pooled connection: the connection calls
    ``finish`` when its answer is in or it failed."""

    __slots__ = ("answered", "conn", "data", "key", "retry", "timeout")

    def __init__(self, answered: Answered, conn: _Conn, key: tuple[str, int], data: bytes, timeout: float | None):
        self.answered: Answered | None = answered
        self.conn: _Conn | None = conn
        self.key, self.data, self.timeout = key, data, timeout
        self.retry: Posting | None = None  # on a fresh connection, after a kept-alive one had died

    def finish(self, got: Response | BaseException) -> None:
        self.conn = None
        answered, self.answered = self.answered, None
        if answered is not None:
            answered(got)

    def cancel(self) -> None:
        self.answered = None
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.sent = None
            conn.close()  # the engine sees the client go away
        if self.retry is not None:
            self.retry.cancel()


class _Conn(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool, key: tuple[str, int]):
        self.pool, self.key = pool, key
        # Cached: on Python 3.11 each asyncio.get_running_loop() is a getpid() syscall.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        # httptools calls on_header(name, value) once per header: stored straight into a dict (a
        # C call, no Python frame per header), as the router's server does. The parser takes the
        # attribute when it is made, so this dict is cleared per response and copied at its head.
        self._raw_headers: dict[bytes, bytes] = {}
        self.on_header: Callable[[bytes, bytes], None] = self._raw_headers.__setitem__
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.deadline: float | None = None  # of the request in flight, on the loop's clock
        self.timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.sent: _Sent | None = None  # a request started by send(), answered through callbacks
        self._reset()

    def _reset(self) -> None:
        self._raw_headers.clear()
        self.headers: dict[bytes, bytes] = {}
        self.content_type = b""
        self.status = 0
        self.body: list[bytes] = []  # a whole body; a stream's chunks not read yet
        self.got_bytes = False
        self.timed_out = False  # (a timeout is not a dead kept-alive connection: not tried again)
        self.complete = False  # the response was read whole
        self.keep_alive = False  # ... and the server keeps the connection open
        self.error: Exception | None = None  # what ended the response before it was complete
        self.waiter: asyncio.Future | None = None  # a stream's reader, waiting for more
        self.head: asyncio.Future[int] | None = None  # made for streams: their reader waits for the head
        self.done: asyncio.Future[None] | None = None  # made by post(): it waits for the end

    def arm(self, timeout: float | None) -> None:
        """Fail this request with UpstreamTimeout after ``timeout`` seconds.

        One timer per connection, not per request: a request moves the deadline, and the timer,
        when it fires, waits on for a later deadline or finds none (the request ended). Arming
        and cancelling a timer per request cost microseconds on the hot path; timeouts are rare."""
        if timeout is None:
            self.deadline = None
            return
        deadline = self.deadline = self.loop.time() + timeout
        if self.timer is None or deadline < self._timer_at:
            self._cancel_timer()
            self._timer_at = deadline
            self.timer = self.loop.call_at(deadline, self._check_deadline)

    def disarm(self) -> None:
        self.deadline = None  # the timer finds nothing to do when it fires

    def _check_deadline(self) -> None:
        self.timer = None
        if self.deadline is None or self.closed:
            return
        if self.deadline > self.loop.time():
            self._timer_at = self.deadline
            self.timer = self.loop.call_at(self.deadline, self._check_deadline)
            return
        self.timed_out = True
        self._fail(UpstreamTimeout("no answer within the request timeout"))
        self.close()

    # -- asyncio.Protocol / httptools callbacks ----------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP connection's transport: it reads and writes (uvloop's subclasses no asyncio class).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"bad HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.parser = None  # type: ignore[assignment]  # it holds bound methods of self: a cycle (never used again)
        self._cancel_timer()
        self._fail(UpstreamError(f"connection closed: {exc or 'by peer'}"))

    def on_headers_complete(self) -> None:
        raw = self.headers = dict(self._raw_headers)
        content_type = raw.get(b"Content-Type") or raw.get(b"content-type")
        if content_type is None:  # another spelling, or none
            content_type = next((v for k, v in raw.items() if k.lower() == b"content-type"), b"")
        self.content_type = content_type
        self.status = self.parser.get_status_code()
        if self.head is not None and not self.head.done():
            self.head.set_result(self.status)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        if self.waiter is not None:
            self._wake()

    def on_message_complete(self) -> None:
        self.deadline = None
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        if self.done is not None and not self.done.done():
            self.done.set_result(None)
        if self.waiter is not None:
            self._wake()
        sent = self.sent
        if sent is not None:
            self.sent = None
            response = self.whole()
            self.pool.release(self)
            sent.finish(response)

    def _fail(self, exc: Exception) -> None:
        if not self.complete and self.error is None:
            self.error = exc
        for fut in (self.head, self.done):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
                fut.exception()  # mark retrieved; the caller may be gone
        if self.waiter is not None:
            self._wake()
        sent = self.sent
        if sent is not None:
            self.sent = None
            self.close()
            if self.died_idle:  # one try on a fresh connection
                sent.conn = None
                sent.retry = Posting(self.pool.on_fresh(sent.key, sent.data, sent.timeout), sent.finish)
            else:
                sent.finish(exc)

    @property
    def died_idle(self) -> bool:
        """A kept-alive connection the server had closed: it failed before any answer byte, and
        not by the request timeout (such a request is tried once more on a fresh connection)."""
        return self.reused and not self.got_bytes and not self.timed_out

    def whole(self) -> Response:
        """The response read whole (status, headers, body)."""
        return Response(self.status, self.headers, b"".join(self.body), _media_type(self.content_type))

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- use -------------------------------------------------------------------------------
    async def body_chunks(self, boundary: bytes = b"") -> AsyncIterator[bytes]:
        """A stream's body: each time, all that has arrived since the last (one chunk however
        many reads or HTTP chunks it came in, so that the client gets it in one write), up to
        its last ``boundary`` if given (cut here rather than by a generator over this one: a
        layer less on every event of a stream)."""
        body = self.body
        held = b""  # (with a boundary) what came after the last one
        try:
            while True:
                if body:
                    chunk = body[0] if len(body) == 1 else b"".join(body)
                    body.clear()
                    if boundary:
                        chunk, held = cut_after_last(held + chunk if held else chunk, boundary)
                        if not chunk:
                            continue
                    yield chunk
                elif self.complete:
                    if held:
                        yield held
                    break
                elif self.error is not None:
                    raise self.error  # the connection died mid-body
                else:
                    self.waiter = self.loop.create_future()
                    await self.waiter
        finally:
            self.pool.release(self)

    def finished(self) -> bool:
        return self.complete or self.error is not None

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None  # the handle holds a bound method of self

    def close(self) -> None:
        self.closed = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()


def cut_after_last(data: bytes, boundary: bytes) -> tuple[bytes, bytes]:
    """``data`` cut after its last ``boundary``: (what ends with it, what comes after it)."""
    cut = data.rfind(boundary) + len(boundary)
    if cut < len(boundary):
        return b"", data
    return (data, b"") if cut == len(data) else (data[:cut], data[cut:])


class UpstreamPool:
    """The real Upstream: pooled HTTP/1.1 keep-alive connections per host."""

    def __init__(self, *, max_idle_per_host: int = 256):
        self._idle: dict[tuple[str, int], collections.deque[_Conn]] = collections.defaultdict(collections.deque)
        self.max_idle = max_idle_per_host
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}  # url -> (address, request-line prefix)

    def _idle_conn(self, key: tuple[str, int]) -> _Conn | None:
        """A pooled connection, ready for a new request (synchronous: no coroutine on the hot path)."""
        idle = self._idle[key]
        while idle:
            conn = idle.pop()
            if not conn.closed:
                conn.reused = True
                conn._reset()
                return conn
        return None

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: _Conn(self, key), key[0], key[1])
        return conn

    def release(self, conn: _Conn) -> None:
        keep = conn.complete and conn.keep_alive and not conn.closed
        if keep and len(self._idle[conn.key]) < self.max_idle:
            self._idle[conn.key].append(conn)
        else:
            conn.close()

    def _target(self, url: str) -> tuple[tuple[str, int], bytes]:
        """``url``'s address and request head up to its Content-Length (remembered: the router
        posts to a handful of URLs)."""
        parts = urlsplit(url)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        prefix = f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        target = self._targets[url] = (key, prefix.encode())
        return target

    def _request(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[tuple[str, int], bytes]:
        """The address and the bytes of a POST of ``body`` to ``url`` with ``headers``."""
        key, prefix = self._targets.get(url) or self._target(url)
        if not headers:
            return key, b"%bContent-Length: %d\r\n\r\n%b" % (prefix, len(body), body)
        return key, b"%bContent-Length: %d\r\n%b\r\n%b" % (prefix, len(body), header_lines(headers), body)

    def send(
        self, url: str, body: bytes, headers: dict[str, str], answered: Answered, *, timeout: float | None = None
    ) -> Sending:
        """See ``Upstream.send``: on a pooled connection, the connection's callbacks answer it."""
        key, data = self._request(url, body, headers)
        conn = self._idle_conn(key)
        if conn is None:  # connecting is a coroutine: the request runs as one, in a task
            return Posting(self._post(key, data, False, timeout), answered)
        sent = conn.sent = _Sent(answered, conn, key, data, timeout)
        conn.arm(timeout)
        assert conn.transport is not None
        conn.transport.write(data)
        return sent

    def on_fresh(self, key: tuple[str, int], data: bytes, timeout: float | None) -> Coroutine[Any, Any, Response]:
        """A whole POST of ``data`` on a new connection (the retry of one whose kept-alive
        connection had died)."""
        return self._post(key, data, False, timeout, pooled=False)

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], *, stream: bool = False, timeout: float | None = None
    ) -> Response:
        """See ``Upstream.post``."""
        key, data = self._request(url, body, headers)
        return await self._post(key, data, stream, timeout)

    async def _post(
        self, key: tuple[str, int], data: bytes, stream: bool, timeout: float | None, *, pooled: bool = True
    ) -> Response:
        """``data`` sent to ``key`` on a pooled connection (``pooled``), tried once more on a fresh
        one when a kept-alive connection had died before any answer, else on a fresh one."""
        for attempt in range(2):
            conn = self._idle_conn(key) if pooled else None
            if conn is None:
                try:
                    conn = await self._connect(key)
                except OSError as exc:
                    raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
            conn.arm(timeout)
            try:
                assert conn.transport is not None
                if conn.error is not None:  # it died before this request began (it would wait for ever)
                    raise conn.error
                if stream:
                    head = conn.head = conn.loop.create_future()
                    conn.transport.write(data)
                    status = await head
                    return Response(status, conn.headers, content_type=_media_type(conn.content_type), _source=conn)
                done = conn.done = conn.loop.create_future()
                conn.transport.write(data)
                await done  # one wake-up per request: the head is complete when the message is
            except UpstreamError:
                conn.close()
                if attempt == 0 and pooled and conn.died_idle:
                    continue  # one fresh try
                raise
            except BaseException:
                conn.close()  # cancelled: the engine must see the client leave
                raise
            response = conn.whole()
            self.release(conn)
            return response
        raise AssertionError("unreachable")

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


@functools.lru_cache(maxsize=64)  # engines send a handful of values: parsed once each
def _media_type(content_type: bytes) -> str:
    """A Content-Type header's media type (its parameters dropped)."""
    if not content_type:
        return "application/octet-stream"
    return content_type.decode("latin-1").split(";")[0].strip()
