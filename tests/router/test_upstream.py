"""The router's upstream client (``UpstreamPool``) against a real HTTP server on loopback: a
request started with ``send`` is answered through its connection's callbacks, reuses pooled
connections, is tried once more on a fresh connection when a kept-alive one had died, times
out without a second try, and closes its connection when cancelled (the engine sees the client
go away). A request started with ``stream`` feeds its sink read by read, the same way; a
``StreamLeg`` cuts what it is fed into whole SSE events."""

from __future__ import annotations

import asyncio

import pytest

from pdctl.roles import Role
from pdctl.router.config import RouterConfig
from pdctl.router.gate import RefitGate
from pdctl.router.legs import Leg, Legs, StreamLeg
from pdctl.router.shaping import Headers
from pdctl.router.upstream import Response, UpstreamPool, UpstreamTimeout
from pdctl.router.workers import WorkerRegistry

ANSWER = b'{"text": "hi"}'


class Engine:
    """A keep-alive HTTP/1.1 server that answers every request whole, or (``hang``) never; it
    counts connections and notices connections closed by the client."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests = 0
        self.hang = False
        self.stream: list[bytes] | None = None  # answer with these HTTP chunks (an SSE stream) instead
        self.type_header = b"Content-Type"  # the name its whole answers spell it with
        self.status = b"200 OK"  # of its whole answers
        self.heads: list[bytes] = []  # every request's head, as received
        self.hung = asyncio.Event()  # a request is being held (``hang``)
        self.streamed = asyncio.Event()  # a whole stream was written
        self.client_left = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []
        self.handlers: set[asyncio.Task] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        handler = asyncio.current_task()
        assert handler is not None
        self.handlers.add(handler)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                self.requests += 1
                if self.hang:
                    self.hung.set()
                    await reader.read()  # returns at EOF: the client closed the connection
                    self.client_left.set()
                    return
                if self.stream is not None:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                    )
                    for part in self.stream:
                        writer.write(b"%x\r\n%b\r\n" % (len(part), part))
                        await writer.drain()
                        await asyncio.sleep(0)  # (the parts mostly come in reads of their own)
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
                    self.streamed.set()
                    continue
                writer.write(
                    b"HTTP/1.1 %b\r\n%b: application/json; charset=utf-8\r\nContent-Length: %d\r\n\r\n%b"
                    % (self.status, self.type_header, len(ANSWER), ANSWER)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    def drop_idle_connections(self) -> None:
        """Close every connection server-side, as an engine does with idle keep-alive ones."""
        for writer in self.writers:
            writer.close()
        self.writers.clear()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        self.drop_idle_connections()
        await asyncio.gather(*self.handlers)  # each ends once its connection is closed


def send(pool: UpstreamPool, url: str, timeout: float | None = 30) -> asyncio.Future[Response | BaseException]:
    """``pool.send``'s answer as a future (the callback called more than once would fail it)."""
    got: asyncio.Future[Response | BaseException] = asyncio.get_running_loop().create_future()
    pool.send(url + "/generate", b"{}", {"X-Request-ID": "t"}, got.set_result, timeout=timeout)
    return got


def run(scenario) -> None:
    async def main() -> None:
        engine = Engine()
        url = await engine.start()
        pool = UpstreamPool()
        try:
            await scenario(engine, url, pool)
        finally:
            pool.close()
            await engine.stop()

    asyncio.run(main())


def test_send_answers_through_callbacks_and_reuses_the_connection() -> None:
    async def scenario(engine: Engine, url: str, pool: UpstreamPool) -> None:
        for _ in range(3):
            got = await send(pool, url)
            assert isinstance(got, Response), got
            assert (got.status, got.body, got.content_type) == (200, ANSWER, "application/json")
        assert engine.connections == 1, "the first request connects, the next ones reuse its connection"

    run(scenario)


def test_header_values_go_out_as_the_bytes_they_came_in_as_and_any_spelling_of_content_type_is_read() -> None:
    """The router's server decodes header values as latin-1: the pool sends them back as the same
    bytes (they were UTF-8-encoded once more before). An answer's Content-Type is found whatever
    the case of its name. A value latin-1 cannot hold goes out as UTF-8."""

    async def scenario(engine: Engine, url: str, pool: UpstreamPool) -> None:
        for spelling in (b"Content-Type", b"content-type", b"CONTENT-TYPE"):
            engine.type_header = spelling
            got: asyncio.Future[Response | BaseException] = asyncio.get_running_loop().create_future()
            value = "00-caf\xe9-01"  # a client's bytes 30 30 2d 63 61 66 e9 ..., decoded as latin-1
            pool.send(url + "/generate", b"{}", {"traceparent": value, "X-Request-ID": "r"}, got.set_result)
            answer = await got
            assert isinstance(answer, Response), answer
            assert answer.content_type == "application/json", spelling
            assert b"\r\ntraceparent: 00-caf\xe9-01\r\nX-Request-ID: r\r\n" in engine.heads[-1]
        got = asyncio.get_running_loop().create_future()
        pool.send(url + "/generate", b"{}", {"Authorization": "Bearer \u043a\u043b\u044e\u0447"}, got.set_result)
        assert isinstance(await got, Response)
        assert "\r\nAuthorization: Bearer \u043a\u043b\u044e\u0447\r\n".encode() in engine.heads[-1]

    run(scenario)


def test_a_kept_alive_connection_that_died_is_tried_once_more_on_a_fresh_one() -> None:
    async def scenario(engine: Engine, url: str, pool: UpstreamPool) -> None:
        assert isinstance(await send(pool, url), Response)
        engine.drop_idle_connections()  # the pooled connection dies while idle
        got = await send(pool, url)
        assert isinstance(got, Response) and got.body == ANSWER, got
        assert engine.connections == 2

    run(scenario)


def test_a_request_past_its_timeout_fails_and_is_not_sent_again() -> None:
    async def scenario(engine: Engine, url: str, pool: UpstreamPool) -> None:
        assert isinstance(await send(pool, url), Response)  # a pooled connection to time out on
        engine.hang = True
        got = await send(pool, url, timeout=0.05)
        assert isinstance(got, UpstreamTimeout), got
        await engine.client_left.wait()  # the timed-out request's connection was closed
        assert engine.requests == 2, "a timed-out request is not tried again"

    run(scenario)


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled-connection", "while-connecting"])
def test_cancelling_a_sent_request_closes_its_connection_and_answers_nothing(pooled: bool) -> None:
    async def scenario(engine: Engine, url: str, pool: UpstreamPool) -> None:
        if pooled:
            assert isinstance(await send(pool, url), Response)
        engine.hang = True
        answers: list[object] = []
        sending = pool.send(url + "/generate", b"{}", {}, answers.append, timeout=30)
        await engine.hung.wait()  # the engine has the request
        sending.cancel()
        await engine.client_left.wait()  # the engine sees the client go away
        assert answers == [], "a cancelled request's callback is never called"

    run(scenario)


EVENTS = [b'data: {"text": "%s"}\n\n' % (b"x" * k) for k in range(1, 9)] + [b"data: [DONE]\n\n"]


class Sink:
    """A StreamSink that keeps what it is fed; ``done`` once the answer ended."""

    def __init__(self) -> None:
        self.heads: list[Response] = []
        self.chunks: list[bytes] = []
        self.failure: BaseException | None = None
        self.done = asyncio.get_running_loop().create_future()

    def head(self, response: Response) -> None:
        self.heads.append(response)

    def data(self, chunk: bytes, end: bool) -> None:
        self.chunks.append(chunk)
        if end:
            self.done.set_result(None)

    def failed(self, error: BaseException) -> None:
        self.failure = error
        self.done.set_result(None)


def test_a_stream_feeds_its_sink_read_by_read_and_pools_its_connection() -> None:
    async def scenario(engine: Engine, url: str, pool: UpstreamPool) -> None:
        body = b"".join(EVENTS)
        engine.stream = [body[i : i + 7] for i in range(0, len(body), 7)]
        for _ in range(2):
            sink = Sink()
            pool.stream(url + "/generate", b"{}", {}, sink, timeout=30)
            await sink.done
            assert [h.status for h in sink.heads] == [200] and sink.heads[0].content_type == "text/event-stream"
            assert sink.failure is None and b"".join(sink.chunks) == body
        assert engine.connections == 1, "a stream read to its end leaves its connection pooled"

    run(scenario)


def test_a_stream_on_a_kept_alive_connection_that_died_is_tried_once_more_on_a_fresh_one() -> None:
    async def scenario(engine: Engine, url: str, pool: UpstreamPool) -> None:
        assert isinstance(await send(pool, url), Response)
        engine.drop_idle_connections()
        engine.stream = list(EVENTS)
        sink = Sink()
        pool.stream(url + "/generate", b"{}", {}, sink, timeout=30)
        await sink.done
        assert sink.failure is None and b"".join(sink.chunks) == b"".join(EVENTS)
        assert engine.connections == 2

    run(scenario)


def test_a_cancelled_stream_closes_its_connection_and_feeds_nothing_more() -> None:
    async def scenario(engine: Engine, url: str, pool: UpstreamPool) -> None:
        engine.hang = True
        sink = Sink()
        streaming = pool.stream(url + "/generate", b"{}", {}, sink, timeout=30)
        await engine.hung.wait()
        streaming.cancel()
        await engine.client_left.wait()
        assert (sink.heads, sink.chunks, sink.failure, sink.done.done()) == ([], [], None, False)

    run(scenario)


def test_a_paused_stream_is_not_read_until_it_is_resumed() -> None:
    """Flow control: a paused stream's connection is not read (the engine is held back by TCP);
    nothing piles up in the router while its client does not read."""

    async def scenario(engine: Engine, url: str, pool: UpstreamPool) -> None:
        engine.stream = list(EVENTS)
        sink = Sink()
        streaming = pool.stream(url + "/generate", b"{}", {}, sink, timeout=30)
        streaming.pause()
        await engine.streamed.wait()  # the whole stream is on its way
        witness = Sink()  # a second stream, sent after it and read: the loop has read its sockets since
        pool.stream(url + "/generate", b"{}", {}, witness, timeout=30)
        await witness.done
        assert sink.chunks == [] and sink.heads == [], "nothing read while paused"
        streaming.resume()
        await sink.done
        assert b"".join(sink.chunks) == b"".join(EVENTS)

    run(scenario)


class Reader:  # a legs.StreamReader
    def __init__(self) -> None:
        self.blocks: list[bytes] = []
        self.ended = asyncio.get_running_loop().create_future()

    def block(self, block: bytes, end: bool) -> None:
        self.blocks.append(block)
        if end:
            self.ended.set_result(None)

    def broke(self, error: BaseException) -> None:
        self.ended.set_exception(error)


def test_a_stream_leg_cuts_what_it_reads_into_whole_events() -> None:
    """HTTP chunks that cut events anywhere come out as blocks of whole events; the worker's
    load counts the leg until its end."""

    async def scenario(engine: Engine, url: str, pool: UpstreamPool) -> None:
        body = b"".join(EVENTS)
        engine.stream = [body[i : i + 7] for i in range(0, len(body), 7)]
        registry = WorkerRegistry(RouterConfig())
        worker = registry.add(url, Role.DECODE)
        legs = Legs(pool, registry, RefitGate(), 30)
        opened = await legs.open_one(legs.claim(worker), "/generate", b"{}", Headers({}, {}))
        assert isinstance(opened, StreamLeg), opened
        reader = Reader()
        opened.attach(reader)
        await reader.ended
        assert b"".join(reader.blocks) == body and all(block.endswith(b"\n\n") for block in reader.blocks if block)
        assert worker.load == 0 and engine.requests == 1

    run(scenario)


def test_a_stream_leg_with_an_error_status_is_a_leg_with_its_body() -> None:
    async def scenario(engine: Engine, url: str, pool: UpstreamPool) -> None:
        registry = WorkerRegistry(RouterConfig())
        worker = registry.add(url, Role.DECODE)
        legs = Legs(pool, registry, RefitGate(), 30)
        engine.status = b"503 Service Unavailable"
        got = await legs.open_one(legs.claim(worker), "/generate", b"{}", Headers({}, {}))
        assert isinstance(got, Leg) and (got.status, got.body) == (503, ANSWER), got
        assert worker.load == 0

    run(scenario)
