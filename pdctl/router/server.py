"""The router's HTTP/1.1 server: asyncio.Protocol + httptools (the parser uvicorn uses).

Why not aiohttp's server: in profiles of the router under load, aiohttp's request parsing,
handler dispatch and response writing were about 40% of the router's CPU per request. This
server does what the router needs and nothing more:

- keep-alive, and pipelined requests answered in order (reading pauses when 32 wait);
- request line + headers up to 64 KiB (431 beyond), bounded while they are read too (one
  endless header line is a 431, not memory without end);
- request bodies with Content-Length or chunked, ``Expect: 100-continue``, a size limit per
  request (413) and one on all the bodies it holds at once (503): a body counts from its first
  byte until its request is answered (a request waiting at a held router still holds its body);
- ``check_head(method, path, headers)`` runs once a request's headers are in, before any body
  byte is read or buffered (the router checks keys there): a refusal is answered and the
  connection closed, so a refused body costs nothing;
- a body is buffered in one growing buffer, so its memory is the payload's size (plus the
  buffer's slack) whatever the framing (1-byte chunks included);
- whole responses with Content-Length, or streamed ones with chunked encoding that wait
  for the client to drain (flow control); a streamed body that is a ``Pipe`` writes into the
  connection itself (an ``Outlet``), and is told when the client stops and resumes reading;
- a client that goes away cancels its handler (the router's contract: both legs of a PD
  request are cancelled, and the engines abort them);
- idle keep-alive connections, and clients that trickle headers (slowloris), closed after
  ``keepalive_timeout`` seconds; a request body must be in within ``body_timeout`` seconds
  of its headers.

Handlers take a ``Request`` and return a ``Reply`` or a ``StreamReply`` (pdctl.router.reply),
which the server writes. Routes are exact ``(method, path)`` pairs plus path prefixes.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import http
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import cast
from urllib.parse import unquote

import httptools

from pdctl.httputil import bound_port
from pdctl.router.cancels import cancel_requests, withdraw_cancel
from pdctl.router.http1 import header_lines
from pdctl.router.reply import Answer, Flow, Reply, StreamReply

log = logging.getLogger("pdctl.router.server")

MAX_HEAD_BYTES = 64 * 1024  # request line + headers (names and values); more is refused with a 431
HEAD_READ_BOUND = 4 * MAX_HEAD_BYTES  # bytes read of a head not complete yet (framing included); then a 431
MAX_PIPELINED = 32  # requests parsed ahead of their answers; then reading pauses
MAX_CORKED_BYTES = 64 * 1024  # a stream's writes gathered at most, before they go out at once
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in http.HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@dataclass(slots=True)
class Request:
    """One HTTP request as the server parsed it, its body read whole."""

    method: str
    path: str  # percent-decoding is left to the handler (only /workers/{key} needs it)
    query: str
    headers: dict[str, str]
    """Names lower-cased. A repeated header keeps its last value, unless its name came in
    different cases (X-A, x-a): then one of its values, not always the last (names are folded
    once the head is in, from a dict that the parser fills by C calls, one key per spelling)."""
    body: bytes
    keep_alive: bool
    http10: bool
    tail: str = ""  # the path after a prefix route's prefix, percent-decoded
    held: int = 0
    """Bytes of its body counted in the server's ``inflight_body`` until it is answered."""
    refusal: Reply | None = None
    """Refused at its head while earlier pipelined requests were unanswered: sent in its turn."""


Handler = Callable[[Request], Awaitable[Answer]]
HeadCheck = Callable[[str, str, dict[str, str], str], "Reply | None"]
"""``(method, path, headers, peer)`` -> a Reply that refuses the request, or None to read on
(``peer``: the client's address, as the socket says)."""


@dataclass
class Routes:
    """Exact (method, path) routes, prefix routes, and what to answer when nothing matches."""

    exact: dict[tuple[str, str], Handler] = field(default_factory=dict)
    prefixes: list[tuple[str, str, Handler]] = field(default_factory=list)

    def add(self, method: str, path: str, handler: Handler) -> None:
        """Route ``method`` ``path`` exactly to ``handler`` (replacing any handler it had)."""
        self.exact[(method, path)] = handler

    def add_prefix(self, method: str, prefix: str, handler: Handler) -> None:
        """Route ``method`` on any path longer than ``prefix`` that begins with it to ``handler``; the rest of the path
        reaches it percent-decoded as ``Request.tail``. Exact routes win; the first matching prefix wins among prefixes.
        """
        self.prefixes.append((method, prefix, handler))

    def find(self, request: Request) -> Handler | bool | None:
        """The handler; False when the path exists under another method (405); None (404)."""
        handler = self.exact.get((request.method, request.path))
        if handler is not None:
            return handler
        other_method = False
        for method, prefix, prefixed in self.prefixes:
            if request.path.startswith(prefix) and len(request.path) > len(prefix):
                if method == request.method:
                    request.tail = unquote(request.path[len(prefix) :])
                    return prefixed
                other_method = True
        if other_method or any(path == request.path for _, path in self.exact):
            return False
        return None


class HttpServer:
    """Serve ``dispatch`` (which sees every request) on host:port; port 0 picks a free one.

    ``dispatch`` must return a Reply or a StreamReply; an exception it raises is logged and
    answered with a 500. ``on_error(status, message)`` builds the Reply for the server's own
    errors (bad request, too large, not found, 500) so that they share the app's error shape.
    """

    def __init__(
        self,
        dispatch: Handler,
        on_error: Callable[[int, str], Reply],
        *,
        max_body: int = 512 * 1024 * 1024,
        max_inflight_body: int = 1024 * 1024 * 1024,
        keepalive_timeout: float = 75.0,
        body_timeout: float = 120.0,
        check_head: HeadCheck | None = None,
    ):
        self.dispatch = dispatch
        self.on_error = on_error
        self.check_head = check_head
        self.max_body = max_body
        self.max_inflight_body = max_inflight_body
        self.inflight_body = 0
        """Bytes of request bodies held now over every connection: being read, or read and waiting
        for their answer."""
        self.keepalive_timeout = keepalive_timeout
        self.body_timeout = body_timeout
        self._server: asyncio.base_events.Server | None = None
        self.stopping = False
        self._connections: set[_Connection] = set()
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host``:``port``; the port bound (a free one for 0). Raises OSError when it cannot bind."""
        loop = asyncio.get_running_loop()

        def connection() -> asyncio.Protocol:
            return cast(asyncio.Protocol, _Connection(self))

        self._server = await loop.create_server(connection, host, port, backlog=1024, reuse_address=True)
        self.port = bound_port(self._server)
        return self.port

    async def stop(self) -> None:
        """Stop listening and close every connection; nothing when not started."""
        if self._server is None:
            return
        self.stopping = True
        self._server.close()
        for conn in list(self._connections):
            conn.close()
        await self._server.wait_closed()
        self._server = None


class _Connection:
    """One client connection: an asyncio protocol (by its methods; no base class, so that it
    stays a plain object)."""

    def __init__(self, server: HttpServer):
        self.server = server
        # Cached: on Python 3.11 each asyncio.get_running_loop() is a getpid() syscall.
        self.loop = asyncio.get_running_loop()
        # httptools calls on_header(name, value) once per header: storing it straight into one
        # dict (a C call, no Python frame per header) was a few percent of the router's CPU per
        # request; the names are lower-cased and decoded once the head is complete. The parser
        # takes the attribute when it is made, so the dict is cleared per message, never replaced.
        self._raw_headers: dict[bytes, bytes] = {}
        self.on_header: Callable[[bytes, bytes], None] = self._raw_headers.__setitem__
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        """The client's address (for the keys' network rules)."""
        self.pending: collections.deque[Request] = collections.deque()
        self.task: asyncio.Task | None = None  # the connection's: it answers its requests in order
        self._cancels = 0  # the task's cancel requests when the current request was dispatched
        self._next: asyncio.Future[None] | None = None
        """While no request is being answered: what the task waits on for the next one (in ``pending``)."""
        self.idle_timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0
        self.body_timer: asyncio.TimerHandle | None = None
        self._writable: asyncio.Future | None = None  # set while the client is not reading
        self._outlet: _Outlet | None = None  # a piped stream's, while it is written
        self._corked: list[bytes] | None = None  # a stream's writes, gathered until the loop's next turn
        self._corked_bytes = 0
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: bytes | bytearray = b""
        self._size = 0  # of the body being read (counted in the server's inflight_body until it is in)
        self._head_bytes = 0  # read while a head was coming (bounded by HEAD_READ_BOUND)
        self._body_read = 0  # read while a body was coming (framing and trailers included)
        self._refused = False  # a request was refused: the connection ends with that answer
        self._in_body = False  # between a request's headers and its end

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP connection's transport: it reads and writes (uvloop's subclasses no asyncio class).
        self.transport = cast(asyncio.Transport, transport)
        extra = getattr(transport, "get_extra_info", None)  # (the tests' in-memory transport has none)
        peer = extra("peername") if extra is not None else None
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.server._connections.add(self)
        self._next = self.loop.create_future()
        self.task = self.loop.create_task(self._serve(self._next))
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._connections.discard(self)
        self._forget_body()
        self.transport = None
        # The parser and the idle timer hold bound methods of self: drop them so that a closed
        # connection is freed by reference counting, not left for a full GC (the router runs
        # the GC rarely, see pdctl.router.cli).
        self.parser = None  # type: ignore[assignment]  # never used again; typed as always there for the hot path
        for timer in (self.idle_timer, self.body_timer):
            if timer is not None:
                timer.cancel()
        self.idle_timer = self.body_timer = None
        task, self.task = self.task, None  # (a cancelled task's error would hold this connection: a cycle)
        if task is not None and not task.done():
            task.cancel()  # the client went away: its handler (and the engines' work) stops
        for request in self.pending:
            self._release(request)
        self.pending.clear()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._in_body:
            self._body_read += len(data)
        else:
            self._head_bytes += len(data)  # (a message that begins in this read starts again from 0)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")  # (nothing when refused already)
        else:
            if self._in_body:
                if self.body_timer is None:  # armed only when a body spans reads
                    self.body_timer = self.loop.call_later(self.server.body_timeout, self._body_too_slow)
                if self._body_read - 8 * self._size > HEAD_READ_BOUND:
                    # Far more bytes than the body has: a chunked body's trailer (held by the parser
                    # until its line ends, like a header) without end. Chunk framing is at most a
                    # few bytes per body byte (1-byte chunks: 5).
                    self._refuse(431, f"request trailers are over {HEAD_READ_BOUND} bytes")
            elif self._head_bytes > HEAD_READ_BOUND:
                # A head still coming: bounded here, since the parser holds a header until its
                # end (one endless header line would otherwise grow without limit).
                self._refuse(431, f"request line and headers are over {MAX_HEAD_BYTES} bytes")

    def _body_too_slow(self) -> None:
        self.body_timer = None
        self._refuse(408, f"request body not received within {self.server.body_timeout:g} s of its headers")

    def eof_received(self) -> None:
        pass  # (the transport closes; connection_lost follows)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = self.loop.create_future()
        if self._outlet is not None:
            self._outlet.pause()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        if self._outlet is not None:
            self._outlet.resume()

    def close(self) -> None:
        if self.transport is not None:
            self._uncork()
            self.transport.close()

    def _send(self, data: bytes) -> None:
        """Write ``data`` once this turn of the event loop ends, with all else written in it.

        A stream's head, blocks and end often come in one turn (an engine's events arrive
        together): they go out in one system call, not one each (the writes were most of a
        streamed request's CPU)."""
        corked = self._corked
        if corked is None:
            self._corked = [data]
            self._corked_bytes = len(data)
            self.loop.call_soon(self._uncork)
        else:
            corked.append(data)
            self._corked_bytes += len(data)
            if self._corked_bytes > MAX_CORKED_BYTES:
                self._uncork()  # now: a body that comes faster than the client reads meets flow control

    def _write(self, data: bytes) -> None:
        """Write ``data`` now, or behind what a stream has gathered (answers keep their order)."""
        if self._corked is not None:
            self._corked.append(data)
        elif self.transport is not None:
            self.transport.write(data)

    def _uncork(self) -> None:
        corked, self._corked = self._corked, None
        if corked and self.transport is not None:
            self.transport.write(corked[0] if len(corked) == 1 else b"".join(corked))

    # -- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._raw_headers.clear()
        self._forget_body()
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_headers_complete(self) -> None:
        # The idle clock runs until a request's headers are in: a client that trickles
        # headers (slowloris) is closed like an idle one; a body may take its time.
        self._in_body = True
        self._head_bytes = self._body_read = 0  # (the read that ended the head may hold body bytes)
        raw = self._raw_headers
        if len(self._url) + sum(map(len, raw)) + sum(map(len, raw.values())) > MAX_HEAD_BYTES:
            self._refuse(431, f"request line and headers are over {MAX_HEAD_BYTES} bytes")
            raise httptools.HttpParserError("head too large")  # stop parsing this connection
        names = _HEADER_NAMES  # (a comprehension: twice as fast as map/zip over str(value, "latin-1") here)
        self._headers = {(names.get(k) or _header_name(k)): v.decode("latin-1") for k, v in raw.items()}
        if self.server.check_head is not None:
            url = self._url.partition(b"?")[0].decode("latin-1")
            refusal = self.server.check_head(self.parser.get_method().decode("ascii"), url, self._headers, self.peer)
            if refusal is not None:  # answered before any body byte is read: a refused body costs nothing
                self._refuse_with(refusal)  # (in its turn, behind earlier pipelined requests)
                raise httptools.HttpParserError("refused")  # stop parsing this connection
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body:
            self._refuse(413, f"request body of {length} bytes is over the {self.server.max_body}-byte limit")
            raise httptools.HttpParserError("body too large")  # stop parsing this connection
        # Not behind an answer being sent (it would land inside it): the client then sends its body
        # after its own wait.
        expects = self._headers.get("expect", "").lower() == "100-continue"
        if expects and self._next is not None and self.transport is not None:
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        server = self.server
        server.inflight_body += len(body)
        if self._size > server.max_body:
            self._refuse(413, f"request body is over the {server.max_body}-byte limit")
            raise httptools.HttpParserError("body too large")  # stop parsing this connection
        if server.inflight_body > server.max_inflight_body:
            self._refuse(503, f"the router is reading {server.max_inflight_body} bytes of request bodies; retry later")
            raise httptools.HttpParserError("too many bodies")
        if not self._body:
            self._body = body  # the common case, one piece: kept as is, no copy
        elif isinstance(self._body, bytes):
            self._body = bytearray(self._body) + body  # one growing buffer from the second piece on
        else:
            self._body += body

    def _forget_body(self) -> None:
        self.server.inflight_body -= self._size
        self._body = b""
        self._size = 0

    def on_message_complete(self) -> None:
        self._in_body = False
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        url = self._url
        path, _, query = url.partition(b"?")
        body = self._body if isinstance(self._body, bytes) else bytes(self._body)
        held, self._body, self._size = self._size, b"", 0  # counted until the request is answered
        request = Request(
            method=self.parser.get_method().decode("ascii"),
            path=path.decode("latin-1"),
            query=query.decode("latin-1"),
            headers=self._headers,
            body=body,
            keep_alive=self.parser.should_keep_alive(),
            http10=self.parser.get_http_version() == "1.0",
            held=held,
        )
        self.pending.append(request)  # answered in order after those before it
        waiting = self._next
        if waiting is not None:  # the task waits for it
            self._next = None
            waiting.set_result(None)
        elif len(self.pending) >= MAX_PIPELINED and self.transport is not None:
            self.transport.pause_reading()  # bounded memory: read on once answers catch up

    # -- answering -------------------------------------------------------------------------
    async def _serve(self, first: asyncio.Future[None]) -> None:
        """Answer the connection's requests in order as they come, from ``first`` on: dispatch each
        and write its answer. One task per connection, not one per request (a task's making and
        ending, with its registration, was a measurable share of a request's CPU); it ends with
        the connection, or is cancelled when the client goes away."""
        waiting: asyncio.Future[None] | None = first
        while True:
            if waiting is not None:
                await waiting
            request = self.pending.popleft()  # (until it is taken, connection_lost gives back its body)
            if len(self.pending) == MAX_PIPELINED // 2 and self.transport is not None:
                self.transport.resume_reading()
            try:
                if request.refusal is not None:  # refused at its head behind earlier pipelined requests
                    reply: Answer = request.refusal
                    request.keep_alive = False
                else:
                    self._cancels = cancel_requests(self.task)  # (the task serves many requests: counts carry over)
                    try:
                        reply = await self.server.dispatch(request)
                    except asyncio.CancelledError as exc:
                        if self._client_cancelled():
                            raise  # the client went away, or the server stops: the handler's work ends
                        # A cancellation the handler made itself leaked out of it: a bug, but the client
                        # must not wait for ever on an open connection.
                        what = f"handler for {request.method} {request.path}"
                        log.error("%s ended by a stray cancellation", what, exc_info=exc)
                        reply = self.server.on_error(500, "internal error: the request was cancelled")
                    except Exception:  # a bug: 500, keep serving
                        log.exception("handler for %s %s failed", request.method, request.path)
                        reply = self.server.on_error(500, "internal error")
                if isinstance(reply, StreamReply):
                    ended_whole = await self._stream(request, reply)
                else:
                    self._write(_whole(reply, request.keep_alive, request.http10))
                    ended_whole = True
            except Exception:  # a bug past the handler (an answer that cannot be written, a failing
                # on_close): the connection is closed rather than left with no task to answer it
                log.exception("the answer to %s %s could not be written", request.method, request.path)
                ended_whole = False
            finally:
                self._release(request)
            if not ended_whole or not request.keep_alive:
                self.close()  # half a stream was sent (closing is the only honest end), or the client asked
                return
            if self.transport is None:
                return
            if self.pending:
                waiting = None
            else:
                waiting = self._next = self.loop.create_future()
                self._arm_idle()

    async def _stream(self, request: Request, reply: StreamReply) -> bool:
        """Write ``reply``'s head, then its body in chunks as they come (waiting while the client
        does not read); whether the stream ended whole. Its body is closed, and its ``on_close``
        callbacks run, however it ends."""
        body = reply.body
        try:
            if self.transport is None:
                return False
            head = b"%bContent-Type: %b\r\nTransfer-Encoding: chunked\r\n\r\n" % (
                _head(reply.status, reply.headers, request.keep_alive, request.http10),
                reply.content_type.encode("latin-1"),
            )
            pipe = getattr(body, "pipe", None)  # (a reply.Pipe)
            if pipe is not None:
                outlet = self._outlet = _Outlet(self, head)
                await pipe(outlet)
                if not outlet.ended:  # (a pipe ends its body itself: this one did not)
                    outlet.write(b"", True)
                return self.transport is not None
            self._send(head)
            async for chunk in body:
                if self.transport is None:
                    return False
                if chunk:
                    self._send(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                    if self._writable is not None and not self._writable.done():
                        await self._writable  # flow control: the client is not reading
            if self.transport is None:
                return False
            self._send(b"0\r\n\r\n")
            return True
        except asyncio.CancelledError as exc:
            if self._client_cancelled():
                raise
            log.error("stream for %s %s ended by a stray cancellation", request.method, request.path, exc_info=exc)
            return False
        except Exception as exc:
            log.warning("stream for %s %s broke: %s: %s", request.method, request.path, type(exc).__name__, exc)
            return False
        finally:
            self._outlet = None
            try:
                await body.aclose()
            finally:
                for done in reply.on_close:
                    done()

    def _client_cancelled(self) -> bool:
        """Whether the cancellation being handled came from outside the handler: the client went
        away or the server stops (withdrawn here if it was the handler's own, Python 3.11+)."""
        return self.transport is None or self.server.stopping or withdraw_cancel(asyncio.current_task(), self._cancels)

    def _release(self, request: Request) -> None:
        """``request``'s body no longer counts against the bodies the server holds."""
        self.server.inflight_body -= request.held
        request.held = 0

    def _arm_idle(self) -> None:
        """Start the idle clock: closed if no request's headers are in within ``keepalive_timeout``.

        One timer per connection, not per request (arming and cancelling one per request cost
        microseconds on the hot path): when it fires it closes the connection if it has been
        idle that long, waits on if it went idle later, and goes away if a request is being
        served (answering re-arms it)."""
        if self.transport is not None and self._next is not None and not self._in_body:
            self._idle_since = self.loop.time()
            if self.idle_timer is None:
                self.idle_timer = self.loop.call_later(self.server.keepalive_timeout, self._check_idle)

    def _check_idle(self) -> None:
        self.idle_timer = None
        if self.transport is None or self._next is None or self._in_body:
            return
        left = self._idle_since + self.server.keepalive_timeout - self.loop.time()
        if left > 0:
            self.idle_timer = self.loop.call_later(left, self._check_idle)
        else:
            self.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer an error the server found itself, then close the connection."""
        self._refuse_with(self.server.on_error(status, message))

    def _refuse_with(self, reply: Reply) -> None:
        """Answer ``reply`` and close: now when no request is being answered, else in its turn
        after the requests before it (their client matches answers to requests by order)."""
        if self._refused:
            return  # (refused once: the connection ends with that answer)
        self._refused = True
        self._forget_body()
        if self.transport is None or self.transport.is_closing():
            return
        if self._next is None:  # a request is being answered: the refusal waits its turn
            self.pending.append(Request("", "", "", {}, b"", False, False, refusal=reply))
            self.transport.pause_reading()
            return
        self._write(_whole(reply, False, False))
        self.close()


class _Outlet:
    """A piped stream's way into its client connection (``reply.Outlet``): each write goes out at
    once, chunk-framed, the head in front of the first; the end's framing goes with the last."""

    __slots__ = ("conn", "ended", "flow", "head", "paused")

    def __init__(self, conn: _Connection, head: bytes):
        self.conn = conn
        self.head = head
        self.ended = False
        self.flow: Flow | None = None
        self.paused = conn._writable is not None and not conn._writable.done()

    def write(self, chunk: bytes, end: bool = False) -> None:
        if self.ended:
            return
        data = b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunk else b""
        if end:
            self.ended = True
            data += b"0\r\n\r\n"
        if self.head:
            data, self.head = self.head + data, b""
        conn = self.conn
        if conn._corked is not None:  # (behind what an earlier answer gathered: answers keep their order)
            conn._corked.append(data)
        elif conn.transport is not None:
            conn.transport.write(data)

    def pause(self) -> None:
        self.paused = True
        if self.flow is not None:
            self.flow.pause()

    def resume(self) -> None:
        self.paused = False
        if self.flow is not None:
            self.flow.resume()


_HEADER_NAMES: dict[bytes, str] = {}
"""Header names as sent -> lower-cased str, learnt as they come (clients send a handful)."""


def _header_name(name: bytes) -> str:
    """``name`` lower-cased as str (remembered for the next time: up to 256 names of up to 64 bytes)."""
    lowered = name.decode("latin-1").lower()
    if len(_HEADER_NAMES) < 256 and len(name) <= 64:  # (clients choose names: a bounded, small cache)
        _HEADER_NAMES[name] = lowered
    return lowered


_date: tuple[int, bytes] = (0, b"")  # (second, its Date line): formatted once a second, not once per answer


def _date_line() -> bytes:
    global _date
    now = int(time.time())
    if now != _date[0]:
        _date = (now, f"Date: {formatdate(now, usegmt=True)}\r\n".encode())
    return _date[1]


def _connection_line(keep_alive: bool, http10: bool) -> bytes:
    if not keep_alive:
        return b"Connection: close\r\n"
    return b"Connection: keep-alive\r\n" if http10 else b""


REASON_LIMIT = 480
"""Longest reason phrase written (a status line is one header line; proxies cap those near 8 KiB)."""


def _status_line(status: int, reason: str | None) -> bytes:
    if reason is None:
        return _STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n".encode()
    # RFC 9112 allows tab, space and visible octets: no CR, LF or other control byte reaches the wire.
    phrase = "".join(ch if ch == "\t" or " " <= ch <= "~" else " " for ch in reason)[:REASON_LIMIT].strip()
    return f"HTTP/1.1 {status} {phrase or 'Unknown'}\r\n".encode("ascii")


def _head(status: int, headers: dict[str, str] | None, keep_alive: bool, http10: bool) -> bytes:
    """The status line and the headers every answer carries (the caller adds its framing)."""
    return b"%b%b%b%b" % (
        _STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n".encode(),
        _date_line(),
        header_lines(headers) if headers else b"",
        _connection_line(keep_alive, http10),
    )


def _whole(reply: Reply, keep_alive: bool, http10: bool) -> bytes:
    """A whole answer's bytes: one format, no intermediate head (an answer per request)."""
    headers, body = reply.headers, reply.body
    return b"%b%b%b%bContent-Type: %b\r\nContent-Length: %d\r\n\r\n%b" % (
        (reply.reason is None and _STATUS_LINES.get(reply.status)) or _status_line(reply.status, reply.reason),
        _date_line(),
        header_lines(headers) if headers else b"",
        b"" if keep_alive and not http10 else _connection_line(keep_alive, http10),
        _media(reply.content_type),
        len(body),
        body,
    )


@functools.lru_cache(maxsize=64)  # handlers answer with a handful of media types
def _media(content_type: str) -> bytes:
    return content_type.encode("latin-1")
