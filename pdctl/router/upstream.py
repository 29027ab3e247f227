"""A lean HTTP/1.1 keep-alive client for the router's hot path (router -> engines).

aiohttp's client cost about 150 us of CPU per call in profiles, two calls per PD request;
this one (asyncio.Protocol + httptools, the parser uvicorn uses) does only what the
router needs: POST a JSON body, read a Content-Length or chunked response, whole or as a
stream; pooled connections per host; a connection that was reused and died before any
answer is retried once on a fresh one. Cancelling a request closes its connection, so the
engine sees the client go away and aborts the request.

Two ways in: ``send``, which starts a whole request on a pooled connection and has the
connection's parser callbacks answer it; and ``stream``, which does the same for a streamed
answer and hands its head and body to a ``StreamSink`` as they are read (no task, coroutine or
future per request or per read). A request that must connect first runs as a task.

``Upstream`` is the interface the dispatcher uses; ``UpstreamPool`` is the real one and
``pdctl.router.mock_upstream.MockUpstream`` an in-memory one for tests.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import httptools

from pdctl.router.http1 import header_lines


class UpstreamError(ConnectionError):
    """The connection failed or closed before a complete response."""


class UpstreamTimeout(UpstreamError):
    """No complete answer within the request timeout."""


class StreamSink(Protocol):
    """Who reads a streamed answer (``Upstream.stream``): called as it is read, never after the
    stream was cancelled; ``data`` with ``end`` or ``failed`` comes last, once."""

    def head(self, response: Response) -> None:
        """The status and headers (``response.body`` is empty)."""
        ...

    def data(self, chunk: bytes, end: bool) -> None:
        """Body bytes as they came in one read (all of its HTTP chunks joined; empty only with
        ``end``); ``end``: the body is complete after them."""
        ...

    def failed(self, error: BaseException) -> None:
        """The answer ended before it was complete: UpstreamError (UpstreamTimeout past the
        request timeout, unless disarmed), or an exception that is a bug."""
        ...


@dataclass(slots=True)
class Response:
    """An engine's answer: its status, headers, body (empty for a stream's head) and media type."""

    status: int
    headers: dict[bytes, bytes]
    """As the engine sent them (names not case-folded); a repeated header keeps its last value."""
    body: bytes = b""
    content_type: str = "application/json"


class Upstream(Protocol):
    """How the router talks to engines: POST a JSON body, get the answer whole or as it comes."""

    def send(
        self, url: str, body: bytes, headers: dict[str, str], answered: Answered, *, timeout: float | None = None
    ) -> Sending:
        """Start a POST whose answer is read whole; ``answered`` is called once, with the Response
        or with the exception that ended it (UpstreamError, UpstreamTimeout past ``timeout``), and
        never after ``Sending.cancel()``, which closes the connection (the engine sees the client
        go away). No task or coroutine is made for it where a pooled connection is ready."""
        ...

    def stream(
        self, url: str, body: bytes, headers: dict[str, str], sink: StreamSink, *, timeout: float | None = None
    ) -> Streaming:
        """Start a POST whose answer is read as it comes: ``sink`` gets its head, then its body
        read by read (``StreamSink``). ``timeout`` bounds the answer until ``Streaming.disarm()``.
        ``Streaming.cancel()`` closes the connection; ``pause()``/``resume()`` stop and restart
        reading it (flow control: the engine is held back by TCP, nothing piles up here)."""
        ...

    def fail_host(self, url: str, reason: str) -> None:
        """End every request in flight to ``url``'s server with UpstreamError(``reason``), not
        tried again on a fresh connection: its server is hung (it takes connections and answers
        nothing), so that the router fails them over as it does a dead engine's."""
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


class Streaming(Protocol):
    """A request started by ``Upstream.stream``."""

    def cancel(self) -> None:
        """Stop it: its connection is closed and its sink is not called again."""
        ...

    def pause(self) -> None:
        """Stop reading the answer until ``resume()``."""
        ...

    def resume(self) -> None: ...

    def disarm(self) -> None:
        """The request timeout no longer bounds the rest of the answer."""
        ...


class Posting:
    """``Upstream.send`` over a coroutine, run as a task, that posts: for a request that must connect
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
        """See ``Sending.cancel``: ``answered`` is not called, and the posting task is cancelled (closing its
        connection)."""
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


class _Streamed:
    """A request started by ``UpstreamPool.stream``: on a pooled connection at once, else once a
    connection is made (a task); its connection hands the answer to ``sink`` as it reads it."""

    __slots__ = ("conn", "data", "key", "paused", "pool", "sink", "task", "timeout")

    def __init__(self, pool: UpstreamPool, key: tuple[str, int], data: bytes, sink: StreamSink, timeout: float | None):
        self.pool, self.key, self.data, self.timeout = pool, key, data, timeout
        self.sink: StreamSink | None = sink  # None once cancelled
        self.conn: _Conn | None = None
        self.task: asyncio.Task | None = None
        self.paused = False

    def go(self, conn: _Conn) -> None:
        """Send on ``conn``: from here on it calls the sink."""
        self.conn = conn
        conn.streamed = self
        conn.arm(self.timeout)
        if self.paused and conn.transport is not None:
            conn.transport.pause_reading()
        assert conn.transport is not None
        conn.transport.write(self.data)

    def connect(self) -> None:
        """Send on a new connection, once it is made."""
        self.task = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        try:
            conn = await self.pool._connect(self.key)
        except OSError as exc:
            self.failed(UpstreamError(f"cannot connect to {self.key[0]}:{self.key[1]}: {exc}"))
            return
        if self.sink is None:  # cancelled meanwhile
            conn.close()
            return
        self.go(conn)

    def failed(self, error: BaseException) -> None:
        sink, self.sink = self.sink, None
        self.conn = None
        if sink is not None:
            sink.failed(error)

    def cancel(self) -> None:
        self.sink = None
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.streamed = None
            conn.close()  # the engine sees the client go away
        if self.task is not None:
            self.task.cancel()

    def pause(self) -> None:
        self.paused = True
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.pause_reading()

    def resume(self) -> None:
        self.paused = False
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.resume_reading()

    def disarm(self) -> None:
        if self.conn is not None:
            self.conn.disarm()


class _Conn:
    """One pooled connection to an engine: an asyncio protocol (by its methods; no base class, so
    that each instance is a plain object)."""

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
        self.given_up = False  # its server was declared hung: a failure is not tried again
        self.deadline: float | None = None  # of the request in flight, on the loop's clock
        self.timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.sent: _Sent | None = None  # a request started by send(), answered through callbacks
        self.streamed: _Streamed | None = None  # a request started by stream(): its sink is fed
        self._reset()

    def _reset(self) -> None:
        self._raw_headers.clear()
        self.headers: dict[bytes, bytes] = {}
        self.content_type = b""
        self.status = 0
        self.body: list[bytes] = []  # a whole body; a stream's body not handed on yet
        self.got_bytes = False
        self.timed_out = False  # (a timeout is not a dead kept-alive connection: not tried again)
        self.complete = False  # the response was read whole
        self.keep_alive = False  # ... and the server keeps the connection open
        self.error: Exception | None = None  # what ended the response before it was complete
        self.done: asyncio.Future[None] | None = None  # made by _post(): it waits for the end

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
        self.pool._live[self.key].add(self)  # (once per connection, not per request)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"bad HTTP response: {exc}"))
            return
        streamed = self.streamed
        if streamed is not None and (self.body or self.complete):
            # A stream's body goes on once per read, all of its HTTP chunks together (one write
            # to the client, however many events the read held).
            body = self.body
            chunk = body[0] if len(body) == 1 else b"".join(body)
            body.clear()
            end = self.complete
            if end:
                self.streamed = None
                self.pool.release(self)
            sink = streamed.sink
            if sink is not None:
                if end:
                    streamed.sink = streamed.conn = None
                sink.data(chunk, end)

    def eof_received(self) -> None:
        pass  # (the transport closes; connection_lost follows)

    def pause_writing(self) -> None:
        pass  # a request is written whole, once: nothing to hold back

    def resume_writing(self) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._live[self.key].discard(self)
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
        streamed = self.streamed
        if streamed is not None and streamed.sink is not None:
            streamed.sink.head(Response(self.status, raw, content_type=_media_type(content_type)))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.deadline = None
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        if self.done is not None and not self.done.done():
            self.done.set_result(None)
        sent = self.sent
        if sent is not None:  # (whole, release and finish, inline: this runs for every leg)
            self.sent = None
            response = Response(self.status, self.headers, b"".join(self.body), _media_type(self.content_type))
            self.pool.release(self)
            sent.conn = None
            answered, sent.answered = sent.answered, None
            if answered is not None:
                answered(response)

    def _fail(self, exc: Exception) -> None:
        if not self.complete and self.error is None:
            self.error = exc
        done = self.done
        if done is not None and not done.done():
            done.set_exception(exc)
            done.exception()  # mark retrieved; the caller may be gone
        sent = self.sent
        if sent is not None:
            self.sent = None
            self.close()
            if self.died_idle:  # one try on a fresh connection
                sent.conn = None
                sent.retry = Posting(self.pool.on_fresh(sent.key, sent.data, sent.timeout), sent.finish)
            else:
                sent.finish(exc)
        streamed = self.streamed
        if streamed is not None:
            self.streamed = None
            self.close()
            if self.died_idle and streamed.sink is not None:  # one try on a fresh connection
                streamed.conn = None
                streamed.connect()
            else:
                streamed.failed(exc)

    @property
    def died_idle(self) -> bool:
        """A kept-alive connection the server had closed: it failed before any answer byte, and
        not by the request timeout (such a request is tried once more on a fresh connection)."""
        return self.reused and not self.got_bytes and not self.timed_out and not self.given_up

    def whole(self) -> Response:
        """The response read whole (status, headers, body)."""
        return Response(self.status, self.headers, b"".join(self.body), _media_type(self.content_type))

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None  # the handle holds a bound method of self

    def close(self) -> None:
        self.closed = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()


class UpstreamPool:
    """The real Upstream: pooled HTTP/1.1 keep-alive connections per host."""

    def __init__(self, *, max_idle_per_host: int = 256):
        self._idle: dict[tuple[str, int], collections.deque[_Conn]] = collections.defaultdict(collections.deque)
        self._live: dict[tuple[str, int], set[_Conn]] = collections.defaultdict(set)
        """Every open connection, by server (``fail_host`` reaches the busy ones)."""
        self.max_idle = max_idle_per_host
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}  # url -> (address, request-line prefix)
        # The header lines of the last headers sent: a PD request's two legs send the same dict.
        self._lines_of: dict[str, str] | None = None
        self._lines = b""

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
        # (made by the loop once connected: a refused connect leaves no _Conn, whose parser holds it in a cycle)
        _, conn = await loop.create_connection(lambda: cast(asyncio.Protocol, _Conn(self, key)), key[0], key[1])
        return cast(_Conn, conn)

    def release(self, conn: _Conn) -> None:
        """Take back ``conn`` once its request is done: kept idle for reuse when its answer was complete and it may be
        kept alive (up to ``max_idle`` per server), else closed."""
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
        if headers is not self._lines_of:
            self._lines, self._lines_of = header_lines(headers), headers
        return key, b"%bContent-Length: %d\r\n%b\r\n%b" % (prefix, len(body), self._lines, body)

    def send(
        self, url: str, body: bytes, headers: dict[str, str], answered: Answered, *, timeout: float | None = None
    ) -> Sending:
        """See ``Upstream.send``: on a pooled connection, the connection's callbacks answer it."""
        key, data = self._request(url, body, headers)
        conn = self._idle_conn(key)
        if conn is None:  # connecting is a coroutine: the request runs as one, in a task
            return Posting(self._post(key, data, timeout), answered)
        sent = conn.sent = _Sent(answered, conn, key, data, timeout)
        conn.arm(timeout)
        assert conn.transport is not None
        conn.transport.write(data)
        return sent

    def stream(
        self, url: str, body: bytes, headers: dict[str, str], sink: StreamSink, *, timeout: float | None = None
    ) -> Streaming:
        """See ``Upstream.stream``: the connection's callbacks feed ``sink``."""
        key, data = self._request(url, body, headers)
        streamed = _Streamed(self, key, data, sink, timeout)
        conn = self._idle_conn(key)
        if conn is None:
            streamed.connect()
        else:
            streamed.go(conn)
        return streamed

    def on_fresh(self, key: tuple[str, int], data: bytes, timeout: float | None) -> Coroutine[Any, Any, Response]:
        """A whole POST of ``data`` on a new connection (the retry of one whose kept-alive
        connection had died)."""
        return self._post(key, data, timeout, pooled=False)

    async def _post(self, key: tuple[str, int], data: bytes, timeout: float | None, *, pooled: bool = True) -> Response:
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

    def fail_host(self, url: str, reason: str) -> None:
        """See ``Upstream.fail_host``."""
        parts = urlsplit(url)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        for conn in list(self._live.get(key, ())):
            waiting = conn.done is not None and not conn.done.done()
            if conn.sent is not None or conn.streamed is not None or waiting:
                conn.given_up = True
                conn._fail(UpstreamError(reason))
                conn.close()

    def close(self) -> None:
        """Close every idle pooled connection; connections in use are not closed here."""
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
