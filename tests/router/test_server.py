"""pdctl's HTTP/1.1 server (pdctl.router.server) over real sockets, byte for byte where it matters."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Callable

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdctl.router.errors import server_error
from pdctl.router.reply import Answer, Reply, StreamReply, json_reply, started
from pdctl.router.server import HttpServer, Request, Routes, _Connection

PAD = "x" * 4096


class App:
    """Handlers that show what the server handed them, plus ones that stream, hang and fail."""

    def __init__(self) -> None:
        self.routes = Routes()
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.body_closed = asyncio.Event()
        self.stream_ended = asyncio.Event()
        self.routes.add("POST", "/echo", self.echo)
        self.routes.add("GET", "/echo", self.echo)
        self.routes.add("POST", "/hang", self.hang)
        self.routes.add("GET", "/stream", self.stream)
        self.routes.add("GET", "/boom", self.boom)
        self.routes.add("GET", "/self-cancel", self.self_cancel)
        self.routes.add("GET", "/break-stream", self.break_stream)
        self.routes.add_prefix("DELETE", "/items/", self.delete)
        self.routes.add("GET", "/unwritable", self.unwritable)

    async def dispatch(self, request: Request) -> Answer:
        handler = self.routes.find(request)
        if handler is None:
            return server_error(404, "no route")
        if handler is False:
            return server_error(405, "wrong method")
        return await handler(request)

    async def echo(self, r: Request) -> Reply:
        return json_reply(
            {"method": r.method, "path": r.path, "query": r.query, "headers": r.headers, "body": r.body.decode()},
            headers={"X-Seen": "1"},
        )

    async def hang(self, r: Request) -> Reply:
        self.started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return Reply(200)

    async def stream(self, r: Request) -> Answer:
        self.written = 0
        count = int(r.query.split("=")[1]) if r.query else 3

        async def body() -> AsyncGenerator[bytes, None]:
            try:
                yield b""
                for i in range(count):
                    yield f"data: {i} {PAD}\n\n".encode()
                    self.written += 1
            finally:
                self.body_closed.set()

        reply = StreamReply(200, {"X-Stream": "1"}, await started(body()))
        reply.on_close.append(self.stream_ended.set)
        return reply

    async def boom(self, r: Request) -> Reply:
        raise RuntimeError("a bug")

    async def self_cancel(self, r: Request) -> Reply:
        """A handler whose own cancellation leaks out (the bug a PD race once had under load)."""
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)
        return Reply(200)

    async def break_stream(self, r: Request) -> Answer:
        async def body() -> AsyncGenerator[bytes, None]:
            yield b""
            yield b"data: 0\n\n"
            raise ConnectionError("upstream died")

        return StreamReply(200, None, await started(body()))

    async def delete(self, r: Request) -> Reply:
        return json_reply({"deleted": r.tail})

    async def unwritable(self, r: Request) -> Reply:
        """A bug's answer: a header value that is not a string cannot be written."""
        return Reply(200, b"{}", headers={"X-Count": 5})  # type: ignore[dict-item]


class MemoryTransport:
    """A connection's transport in memory: what the server writes is kept in ``out``."""

    def __init__(self) -> None:
        self.out, self.closed = b"", False
        self.wrote = asyncio.get_running_loop().create_future()  # done at the first write

    def write(self, data: bytes) -> None:
        self.out += data
        if not self.wrote.done():
            self.wrote.set_result(None)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def run(test: Callable[[App, int], Awaitable[None]], **server_kw) -> None:
    async def main() -> None:
        app = App()
        server = HttpServer(app.dispatch, server_error, **server_kw)
        port = await server.start("127.0.0.1", 0)
        try:
            await asyncio.wait_for(test(app, port), 30)
        finally:
            await server.stop()

    asyncio.run(main())


async def exchange(
    port: int, data: bytes, *, until_closed: bool = True, read_for: float = 2.0, half_close: bool = False
) -> bytes:
    """Send raw bytes; read until the server closes (or ``read_for`` seconds pass). With
    ``half_close`` the client ends its side after the bytes: the server must then close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    if half_close:
        writer.write_eof()
    await writer.drain()
    out = b""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), read_for)
            if not chunk:
                break
            out += chunk
    except asyncio.TimeoutError:
        if until_closed:
            raise
    writer.close()
    return out


def test_keep_alive_serves_many_requests_on_one_connection() -> None:
    async def test(app: App, port: int) -> None:
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as s:
            for i in range(20):
                async with s.post(f"http://127.0.0.1:{port}/echo?i={i}", json={"n": i}) as r:
                    body = await r.json()
                    assert r.status == 200 and r.headers["X-Seen"] == "1" and "Date" in r.headers
                    assert body["query"] == f"i={i}" and json.loads(body["body"]) == {"n": i}
                    assert body["headers"]["content-type"] == "application/json"  # names lower-cased
        # limit=1 and 20 answers: every request went over the same kept-alive connection
        assert len(connector._conns) <= 1

    run(test)


def test_pipelined_requests_are_answered_in_order() -> None:
    async def test(app: App, port: int) -> None:
        reqs = b"".join(
            f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {len(str(i))}\r\n\r\n{i}".encode() for i in range(5)
        )
        out = await exchange(port, reqs + b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        bodies = [json.loads(part.split(b"\r\n\r\n", 1)[1]) for part in out.split(b"HTTP/1.1 200 OK\r\n")[1:]]
        assert [b["body"] for b in bodies] == ["0", "1", "2", "3", "4", ""]
        assert out.count(b"Connection: close") == 1  # only the last one, then the server closed

    run(test)


def test_a_long_pipeline_pauses_reading_and_is_answered_in_full() -> None:
    async def test(app: App, port: int) -> None:
        # Far more than MAX_PIPELINED, and more bytes (800 KB) than one read: reading must pause
        # once the queue is full and resume as answers go out, or the rest is never read.
        n, size = 400, 2000
        reqs = b"".join(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (size, str(i).encode().ljust(size))
            for i in range(n)
        )
        out = await exchange(port, reqs + b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        bodies = [json.loads(part.split(b"\r\n\r\n", 1)[1]) for part in out.split(b"HTTP/1.1 200 OK\r\n")[1:]]
        assert [b["body"].strip() for b in bodies] == [*map(str, range(n)), ""]

    run(test)


def test_chunked_request_body_and_expect_100_continue() -> None:
    async def test(app: App, port: int) -> None:
        head = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n"
        body = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        out = await exchange(port, head + b"Connection: close\r\n\r\n" + body)
        assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
        assert json.loads(out.split(b"\r\n\r\n")[-1])["body"] == "hello world"

    run(test)


def test_http10_closes_unless_keep_alive_is_asked_for() -> None:
    async def test(app: App, port: int) -> None:
        out = await exchange(port, b"GET /echo HTTP/1.0\r\n\r\n")  # the server must close: exchange waits for it
        assert b"Connection: close" in out
        # Kept alive: a second request on the same connection is answered (no wait for a close
        # that must not come).
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(2):
            writer.write(b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            assert head.startswith(b"HTTP/1.1 200") and b"Connection: keep-alive" in head, head
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            await asyncio.wait_for(reader.readexactly(length), 30)
        writer.close()

    run(test)


def test_errors_found_by_the_server_share_the_error_shape() -> None:
    async def test(app: App, port: int) -> None:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/nope") as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
            async with s.put(f"http://127.0.0.1:{port}/echo") as r:
                assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
            async with s.get(f"http://127.0.0.1:{port}/boom") as r:  # a handler bug: 500, server keeps serving
                assert r.status == 500 and (await r.json())["error"]["code"] == "internal_error"
            async with s.delete(f"http://127.0.0.1:{port}/items/http%3A%2F%2Fa%3A1") as r:
                assert (await r.json())["deleted"] == "http://a:1"
        out = await exchange(port, b"GARBAGE\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400 Bad Request") and b"invalid_request" in out
        huge = b"".join(b"X-Pad-%d: %b\r\n" % (i, b"y" * 1000) for i in range(100))  # 100 KB of headers
        out = await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\n" + huge + b"\r\n")
        assert out.startswith(b"HTTP/1.1 431") and b"request_too_large" in out

    run(test)


def test_one_endless_header_line_is_refused_before_it_fills_memory() -> None:
    """The parser holds a header until its line ends, so a head is bounded as it is read: a
    client that sends one header value without end gets a 431 and the connection closes (it
    was read without limit until the idle timeout)."""

    async def test(app: App, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = asyncio.ensure_future(reader.read(4096))  # read while writing: the answer comes mid-send
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        with contextlib.suppress(ConnectionError):  # the server closed with our bytes unread (a reset)
            for _ in range(1000):  # 64 KiB a write until the server answers (64 MB at most)
                if answer.done():
                    break
                writer.write(b"y" * 65536)
                await asyncio.wait([answer, asyncio.ensure_future(writer.drain())], return_when="FIRST_COMPLETED")
        assert answer.done(), "64 MB of one header line and no answer"
        out = answer.result()
        writer.close()
        assert out.startswith(b"HTTP/1.1 431") and b"request_too_large" in out

    run(test, keepalive_timeout=600)


def test_an_endless_trailer_is_refused_and_a_large_body_after_a_split_head_is_served() -> None:
    """A chunked body's trailer is held by the parser like a header line: one without end is a
    431. A head that came in two reads, followed in one read by a ~250 KB body, is served (its body
    bytes were once counted as head and refused after the request was dispatched)."""

    async def test(app: App, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = asyncio.ensure_future(reader.read(4096))
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\nX-T: ")
        with contextlib.suppress(ConnectionError):
            for _ in range(1000):  # 64 MB at most
                if answer.done():
                    break
                writer.write(b"y" * 65536)
                await asyncio.wait([answer, asyncio.ensure_future(writer.drain())], return_when="FIRST_COMPLETED")
        assert answer.done(), "64 MB of one trailer line and no answer"
        assert answer.result().startswith(b"HTTP/1.1 431")
        writer.close()

        # In memory, so that the reads are exactly these two (uvloop reads up to 256000 bytes).
        conn, transport = _Connection(HttpServer(app.dispatch, server_error)), MemoryTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        body = b"z" * 250_000
        conn.data_received(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 8000)
        conn.data_received(b"\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        await transport.wrote
        assert transport.out.startswith(b"HTTP/1.1 200") and not transport.closed, transport.out[:200]
        conn.connection_lost(None)  # (its task waits for a next request: it ends with the connection)

    run(test)


def test_a_request_whose_client_left_before_it_was_answered_gives_back_its_body_bytes() -> None:
    """A request read whole whose connection is lost in the same turn of the loop (before its
    handler started) no longer counts in the bodies the server holds: were it to, enough such
    clients would make the server refuse every body (503) for good."""

    async def test(app: App, port: int) -> None:
        server = HttpServer(app.dispatch, server_error)
        for _ in range(3):
            conn, transport = _Connection(server), MemoryTransport()
            conn.connection_made(transport)  # type: ignore[arg-type]
            conn.data_received(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"b" * 5000)
            assert server.inflight_body == 5000
            conn.connection_lost(None)
            for _ in range(3):
                await asyncio.sleep(0)  # the connection's task ends (cancelled)
            assert server.inflight_body == 0 and transport.out == b""

    run(test)


def test_a_head_under_the_limit_is_served_however_it_is_split() -> None:
    async def test(app: App, port: int) -> None:
        pads = b"".join(b"X-Pad-%d: %b\r\n" % (i, b"y" * 500) for i in range(100))  # 50 KB of headers
        raw = b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + pads + b"\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in range(0, len(raw), 997):  # many reads, cut anywhere
            writer.write(raw[i : i + 997])
            await writer.drain()
        out = await reader.read()
        writer.close()
        assert out.startswith(b"HTTP/1.1 200")
        assert json.loads(out.partition(b"\r\n\r\n")[2])["headers"]["x-pad-99"] == "y" * 500

    run(test)


def test_body_over_the_limit_is_a_413_and_the_connection_closes() -> None:
    async def test(app: App, port: int) -> None:
        out = await exchange(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n" + b"x" * 2000)
        assert out.startswith(b"HTTP/1.1 413") and b"request_too_large" in out
        chunked = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"400\r\n" + b"y" * 1024
        out = await exchange(port, chunked + b"\r\n400\r\n" + b"y" * 1024 + b"\r\n0\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 413")

    run(test, max_body=1500)


def test_streamed_reply_is_chunked_and_flow_controlled() -> None:
    async def test(app: App, port: int) -> None:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/stream?n=4000") as r:  # 16 MB
            assert r.headers["Transfer-Encoding"] == "chunked"
            assert r.headers["Content-Type"] == "text/event-stream" and r.headers["X-Stream"] == "1"
            await asyncio.sleep(0.5)  # not reading: the writer must wait, not buffer without bound
            assert app.written < 4000
            text = (await r.read()).decode()
        assert text == "".join(f"data: {i} {PAD}\n\n" for i in range(4000))
        await app.stream_ended.wait()
        assert app.body_closed.is_set()

    run(test)


def test_a_stream_whose_client_leaves_before_its_body_closes_the_body() -> None:
    """The client goes away with the head in hand: the body (started, never read to its end) is
    closed, so its cleanup runs, and the reply's on_close callbacks run once."""

    async def test(app: App, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream?n=100000 HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
        writer.close()  # gone, with the body unread: the server's writes back up, then fail
        await app.stream_ended.wait()
        assert app.body_closed.is_set() and app.written < 100000

    run(test)


def test_a_stream_that_breaks_half_way_closes_the_connection() -> None:
    async def test(app: App, port: int) -> None:
        out = await exchange(port, b"GET /break-stream HTTP/1.1\r\nHost: x\r\n\r\n")  # returns: the server closed
        assert out.startswith(b"HTTP/1.1 200 OK") and b"data: 0" in out
        assert b"0\r\n\r\n" not in out.split(b"data: 0")[1]  # no clean end of body: the client sees it broke

    run(test)


def test_client_that_goes_away_cancels_its_handler() -> None:
    async def test(app: App, port: int) -> None:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /hang HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        await app.started.wait()
        writer.close()
        await asyncio.wait_for(app.cancelled.wait(), 5)

    run(test)


def test_idle_keep_alive_connections_and_trickled_headers_are_closed() -> None:
    async def test(app: App, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server, nothing sent
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # a body slower than idle is not cut
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
        await asyncio.sleep(0.6)
        writer.write(b"cd")
        answer = await asyncio.wait_for(reader.read(), 5)  # then idle again: closed after the answer
        assert answer.startswith(b"HTTP/1.1 200 OK") and b'"body":"abcd"' in answer
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # but a body has its own limit
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 408") and b"request_body_timeout" in answer
        writer.close()

    run(test, keepalive_timeout=0.3, body_timeout=1.5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_break_the_server(garbage: bytes) -> None:
    async def test(app: App, port: int) -> None:
        out = await exchange(port, garbage, half_close=True, read_for=30)  # (the server closes: no window)
        assert out == b"" or out.startswith(b"HTTP/1.1 ")
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/echo") as r:
            assert r.status == 200  # and it still serves the next client

    run(test)


def test_a_stray_cancellation_is_answered_and_the_connection_serves_on() -> None:
    """A handler ended by a cancellation that is not the client's leaving: the client gets a 500
    at once (it had waited for ever on an open connection) and the connection serves on."""

    async def test(app: App, port: int) -> None:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/self-cancel") as r:
                assert r.status == 500 and "cancelled" in (await r.json())["error"]["message"]
            async with session.get(f"http://127.0.0.1:{port}/echo") as r:
                assert r.status == 200

    run(test)


def test_a_request_refused_at_its_head_is_answered_in_its_pipelined_turn() -> None:
    """Found by a probe: a refused request pipelined behind a good one got its refusal written at
    once, ahead of the good one's answer, which the client then read as its own."""

    def check_head(method: str, path: str, headers: dict[str, str], peer: str) -> Reply | None:
        return server_error(401, "refused") if path == "/refused" else None

    async def test(app: App, port: int) -> None:
        out = await exchange(
            port, b"GET /echo?first HTTP/1.1\r\nHost: x\r\n\r\nGET /refused HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        first, second = out.find(b"HTTP/1.1 200"), out.find(b"HTTP/1.1 401")
        assert 0 <= first < second, out[:400]
        assert b'"query":"first"' in out[:second]

    run(test, check_head=check_head)


def test_an_answer_that_cannot_be_written_closes_the_connection_rather_than_leaving_it_hung() -> None:
    """Found by a review: an exception past the handler (here an answer with a header value that is
    not a string) ended the connection's task and left the connection open with nobody to answer
    the requests behind it: the client waited for ever."""

    async def test(app: App, port: int) -> None:
        out = await exchange(
            port, b"GET /unwritable HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n", read_for=30
        )
        assert out == b"", out[:300]  # closed: the client sees the connection end, not silence

    run(test)


def test_an_error_the_server_finds_in_a_pipelined_request_is_answered_in_its_turn() -> None:
    """Found by a review: a body over the limit pipelined behind a good request got its 413 at once
    (the client took it for the first request's answer) and the first request was cancelled."""

    async def test(app: App, port: int) -> None:
        out = await exchange(
            port,
            b"GET /echo?first HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 100,
            read_for=30,
        )
        first, second = out.find(b"HTTP/1.1 200"), out.find(b"HTTP/1.1 413")
        assert 0 <= first < second, out[:400]
        assert b'"query":"first"' in out[:second]

    run(test, max_body=10)


def test_100_continue_is_not_written_into_the_answer_before_it() -> None:
    """Found by a review: the interim 100 of a pipelined request that asked for one was written at
    once, inside (or ahead of) the answer to the request before it."""

    async def test(app: App, port: int) -> None:
        out = await exchange(
            port,
            b"GET /stream?n=3 HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n"
            b"Connection: close\r\n\r\nhello",
            read_for=30,
        )
        assert b"100 Continue" not in out, out[:400]
        stream_end, echo = out.find(b"\r\n0\r\n\r\n"), out.find(b'"body":"hello"')
        assert 0 < stream_end < echo, out[:400]

    run(test)
