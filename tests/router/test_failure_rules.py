"""The router's PD failure rules (``pdctl.router.dispatch``'s docstring), one fast in-process test each.

The router is real (a RouterServer on port 0, real HTTP from the client); its engines are a
MockUpstream of toy engines that follow SGLang's PD protocol as far as these rules need: a
prefill answers and hands its KV over by bootstrap room; a decode waits for its room's KV, then
answers; a streamed decode sends its head at once (SGLang's StreamingResponse does, before the
request reaches the scheduler) and its first event once the KV came. Each test injects one
failure and checks what the client got, which legs the router abandoned (the engine sees the
connection go away), which worker the circuit breaker blamed, and that every worker's load
returns to zero. The slow tests with real sims (test_pd_routing, test_overload) stay for what
only real processes show: the wire format, kills, and load.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from pdctl.roles import Role
from pdctl.router.app import RouterServer
from pdctl.router.config import AdmissionConfig, BreakerConfig, HealthConfig, RetryConfig, RouterConfig, WorkerSpec
from pdctl.router.mock_upstream import MockReply, MockUpstream, UpstreamRequest
from pdctl.router.upstream import UpstreamError

# Loopback addresses where nothing listens: the router's one health round at start-up is
# refused at once (health checks are disabled, so the workers stay in rotation).
P1, P2 = "http://127.0.0.2:1", "http://127.0.0.3:1"
D1, D2 = "http://127.0.0.4:1", "http://127.0.0.5:1"
PROMPT = "The quick brown fox"
pytestmark = pytest.mark.timeout(60)  # a rule that regresses into a hang fails instead
Behaviour = Callable[["Engines", UpstreamRequest, dict], Awaitable[MockReply]]


def continuation(prompt: str, n: int) -> str:
    """What the toy model generates: the same letters for the same prompt (greedy)."""
    return "".join(chr(97 + (len(prompt) + i) % 26) for i in range(n))


def tokens_wanted(body: dict) -> int:
    return int(body.get("sampling_params", {}).get("max_new_tokens", 8))


def output(body: dict, text: str, finished: bool, *, logprobs: bool = False) -> dict:
    meta: dict[str, Any] = {
        "id": "rid-1",
        "prompt_tokens": len(body["text"]),
        "completion_tokens": len(text),
        "finish_reason": {"type": "length", "length": len(text)} if finished else None,
    }
    if logprobs:
        meta["input_token_logprobs"] = [[-1.0, i, None] for i in range(len(body["text"]))]
    return {"text": text, "output_ids": [ord(c) for c in text], "meta_info": meta}


def sse(*events: Any) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


class Engines:
    """The toy fleet behind a MockUpstream: a behaviour per worker URL, and what happened."""

    def __init__(self, **behaviours: Behaviour):
        self.behaviours = {globals()[name]: fn for name, fn in behaviours.items()}  # P1=..., D2=...
        self.kv: dict[int, asyncio.Future[bool]] = {}
        self.abandoned: list[str] = []  # workers whose request the router gave up on
        self.mock = MockUpstream(self.handle)

    def room(self, body: dict) -> asyncio.Future[bool]:
        return self.kv.setdefault(body["bootstrap_room"], asyncio.get_running_loop().create_future())

    async def handle(self, request: UpstreamRequest) -> MockReply:
        body = request.json()
        default = prefill_ok if request.base in (P1, P2) else decode_ok
        try:
            return await self.behaviours.get(request.base, default)(self, request, body)
        except asyncio.CancelledError:
            self.abandoned.append(request.base)
            raise

    def bodies(self, base: str) -> list[dict]:
        return [r.json() for r in self.mock.requests if r.base == base]

    def mock_streams(self) -> list:
        """The streamed answers the mock is feeding now (mock_upstream._Stream: ``reading`` is
        cleared while the router holds the stream back)."""
        return [s for s in self.mock.streams if not s.task.done()]


async def prefill_ok(engines: Engines, request: UpstreamRequest, body: dict) -> MockReply:
    answer = output(body, "", True, logprobs=bool(body.get("return_logprob")))
    engines.room(body).set_result(True)  # the KV is on its way to the decode
    return MockReply(body=sse(answer)) if body.get("stream") else MockReply(json=answer)


def decode_stream(engines: Engines, base: str, body: dict, *, die_after: int | None = None) -> AsyncIterator[bytes]:
    async def events() -> AsyncIterator[bytes]:
        try:
            await engines.room(body)  # no event before the KV
            text = continuation(body["text"], tokens_wanted(body))
            for i in range(1, len(text) + 1):
                if die_after is not None and i > die_after:
                    raise UpstreamError("connection reset by peer")
                yield sse(output(body, text[:i], i == len(text)))[: -len(b"data: [DONE]\n\n")]
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            engines.abandoned.append(base)
            raise

    return events()


async def decode_ok(engines: Engines, request: UpstreamRequest, body: dict) -> MockReply:
    if body.get("stream"):
        return MockReply(chunks=decode_stream(engines, request.base, body), content_type="text/event-stream")
    await engines.room(body)
    return MockReply(json=output(body, continuation(body["text"], tokens_wanted(body)), True))


async def answers(status: int, error: str) -> MockReply:
    return MockReply(status=status, json={"error": {"message": error, "code": status}})


def config(prefills: tuple[str, ...], decodes: tuple[str, ...], **groups: Any) -> RouterConfig:
    workers = [WorkerSpec(url=p, role=Role.PREFILL, bootstrap_port=8998) for p in prefills]
    workers += [WorkerSpec(url=d, role=Role.DECODE) for d in decodes]
    groups.setdefault("breaker", BreakerConfig(failure_threshold=1, timeout_duration_secs=600))
    groups.setdefault("retry", RetryConfig(initial_backoff_ms=1, max_backoff_ms=20))
    # no wait for a worker to come back: nothing brings one back here (tests/router/test_dispatcher.py has the wait)
    groups.setdefault("admission", AdmissionConfig(request_timeout_secs=30, worker_wait_secs=0))
    return RouterConfig(
        host="127.0.0.1",
        port=0,
        pd_disaggregation=True,
        workers=tuple(workers),
        policy="round_robin",
        health=HealthConfig(disabled=True),
        **groups,
    )


class Run:
    """One router over ``engines``, a client, and what the test reads back."""

    def __init__(self, server: RouterServer, engines: Engines, client: aiohttp.ClientSession):
        self.server, self.engines, self.client = server, engines, client

    async def generate(self, *, stream: bool = False, tokens: int = 8, **extra: Any) -> tuple[int, Any]:
        """(status, JSON body) or, streamed, (status, the data events: dicts and "[DONE]")."""
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}, "stream": stream}
        async with self.client.post(self.server.url + "/generate", json={**body, **extra}) as resp:
            raw = await resp.read()
        if not stream or resp.status != 200:
            return resp.status, json.loads(raw)
        events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
        return resp.status, [e if e == "[DONE]" else json.loads(e) for e in events]

    def circuit_open(self, url: str) -> bool:
        return bool(self.server.registry.workers[url].to_dict()["circuit_open"])


def run(engines: Engines, scenario: Callable[[Run], Awaitable[Any]], prefills=(P1,), decodes=(D1,), **groups):
    async def main() -> Any:
        async with (
            RouterServer(config(prefills, decodes, **groups), upstream=engines.mock) as server,
            aiohttp.ClientSession() as client,
        ):
            result = await scenario(Run(server, engines, client))
            workers = server.registry.workers.values()
            for _ in range(500):  # legs the reply did not wait for end on their own
                if all(w.load == 0 for w in workers):
                    break
                await asyncio.sleep(0.01)
            assert {w.url: w.load for w in workers} == {w.url: 0 for w in workers}
            return result

    return asyncio.run(main())


def text_of(stream: bool, answer: Any) -> str:
    if not stream:
        return answer["text"]
    assert answer[-1] == "[DONE]" and not any("error" in e for e in answer[:-1]), answer
    return answer[-2]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_prefill_abandons_its_decode_and_retries_on_a_fresh_pair(stream):
    async def broken(engines, request, body):
        return await answers(500, "prefill broke")

    async def scenario(r: Run):
        status, answer = await r.generate(stream=stream)
        assert status == 200 and text_of(stream, answer) == continuation(PROMPT, 8)
        first, second = r.engines.bodies(D1)
        assert first["bootstrap_room"] != second["bootstrap_room"]  # a new room per attempt
        assert r.engines.abandoned == [D1]  # its KV would never come: not left waiting for it
        assert r.circuit_open(P1) and not r.circuit_open(D1) and not r.circuit_open(P2)

    run(Engines(P1=broken), scenario, prefills=(P1, P2))


@pytest.mark.parametrize(
    ("status", "answer"),
    [
        (200, {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "client aborted"}}}),
        (400, {"error": {"message": "the prompt is too long", "code": 400}}),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_abort_or_4xx_is_the_clients_answer_and_not_retried(status, answer, stream):
    async def refuses(engines, request, body):
        if stream and status == 200:  # SGLang streams its abort
            return MockReply(body=sse(answer), content_type="text/event-stream")
        return MockReply(status=status, json=answer)

    async def scenario(r: Run):
        got_status, got = await r.generate(stream=stream)
        assert (got_status, got) == (status, [answer, "[DONE]"] if stream and status == 200 else answer)
        assert len(r.engines.bodies(P1)) == 1 and not r.engines.bodies(P2)
        assert r.engines.abandoned == [D1]
        assert not any(r.circuit_open(u) for u in (P1, P2, D1))  # the client's business, not a failure

    run(Engines(P1=refuses), scenario, prefills=(P1, P2))


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_that_fails_after_its_prefill_answered_takes_the_blame(stream):
    async def broken(engines, request, body):
        await engines.room(body)
        if stream:  # the head went out at once; the connection dies before the first event
            return MockReply(chunks=decode_stream(engines, request.base, body, die_after=0))
        return await answers(500, "decode broke")

    async def scenario(r: Run):
        status, answer = await r.generate(stream=stream)
        assert status == 200 and text_of(stream, answer) == continuation(PROMPT, 8)
        assert r.circuit_open(D1) and not r.circuit_open(P1)

    run(Engines(D1=broken), scenario, decodes=(D1, D2))


def test_a_decode_that_only_followed_its_failing_prefill_is_not_blamed():
    decode_failed = asyncio.Event()

    async def prefill_dying(engines, request, body):
        await decode_failed.wait()  # the decode notices first (its KV transfer broke)
        return await answers(500, "prefill died")

    async def decode_following(engines, request, body):
        decode_failed.set()
        return await answers(500, "KV transfer from the prefill failed")

    async def scenario(r: Run):
        status, answer = await r.generate()
        assert status == 200 and answer["text"] == continuation(PROMPT, 8)
        assert r.circuit_open(P1) and not r.circuit_open(D1)

    run(Engines(P1=prefill_dying, D1=decode_following), scenario, prefills=(P1, P2), decodes=(D1, D2))


def test_backpressure_waits_for_capacity_without_using_the_retry_budget():
    busy_left = [3]

    async def full_then_free(engines, request, body):
        if busy_left[0]:
            busy_left[0] -= 1
            return await answers(503, "no free KV slot")
        return await decode_ok(engines, request, body)

    async def scenario(r: Run):
        status, answer = await r.generate()
        assert status == 200 and answer["text"] == continuation(PROMPT, 8)
        assert len(r.engines.bodies(D1)) == 4  # 3 busy answers, then served: no 502 after one try
        assert not r.circuit_open(D1)

    run(Engines(D1=full_then_free), scenario, retry=RetryConfig(max_retries=0, initial_backoff_ms=1))


def test_connection_failures_are_retried_on_new_rooms_at_most_max_retries_times():
    async def refused(engines, request, body):
        raise UpstreamError("cannot connect to 127.0.0.2:1: connection refused")

    async def scenario(r: Run):
        status, answer = await r.generate()
        assert status == 502 and "after 3 attempt(s)" in answer["error"]["message"], answer
        rooms = [b["bootstrap_room"] for b in r.engines.bodies(P1)]
        assert len(rooms) == 3 == len(set(rooms))
        assert r.engines.abandoned == [D1, D1, D1]

    run(
        Engines(P1=refused),
        scenario,
        retry=RetryConfig(max_retries=2, initial_backoff_ms=1),
        breaker=BreakerConfig(disabled=True),
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_that_never_answers_is_a_504_and_not_retried(stream):
    async def silent(engines, request, body):
        if stream:  # a head at once, then no event (as a stuck SGLang decode)
            forever = asyncio.get_running_loop().create_future()

            async def nothing() -> AsyncIterator[bytes]:
                await forever
                yield b""

            return MockReply(chunks=nothing(), content_type="text/event-stream")
        await asyncio.get_running_loop().create_future()
        raise AssertionError("unreachable")

    async def scenario(r: Run):
        status, answer = await r.generate(stream=stream)
        assert status == 504, answer
        assert len(r.engines.bodies(D1)) == 1  # another try would wait as long again

    run(Engines(D1=silent), scenario, decodes=(D1, D2), admission=AdmissionConfig(request_timeout_secs=0.5))


def test_a_workers_4xx_is_passed_on_and_counts_as_success_for_the_breaker():
    async def refuses(engines, request, body):
        await engines.room(body)
        return await answers(400, "unknown field max_tokens")

    async def scenario(r: Run):
        status, answer = await r.generate()
        assert (status, answer["error"]["message"]) == (400, "unknown field max_tokens")
        assert len(r.engines.bodies(D1)) == 1 and not r.circuit_open(D1)

    run(Engines(D1=refuses), scenario, decodes=(D1, D2))


def test_a_stream_whose_decode_dies_midway_continues_on_another_pair():
    async def dies(engines, request, body):
        return MockReply(chunks=decode_stream(engines, request.base, body, die_after=3))

    async def scenario(r: Run):
        status, events = await r.generate(stream=True, tokens=8)
        assert status == 200
        texts = [e["text"] for e in events[:-1]]
        assert texts == [continuation(PROMPT, i) for i in range(1, 9)]  # one stream, as if nothing happened
        assert events[-2]["meta_info"]["completion_tokens"] == 8 and events[-1] == "[DONE]"
        (rest,) = r.engines.bodies(D2)
        assert rest["text"] == PROMPT + continuation(PROMPT, 3)
        assert rest["sampling_params"]["max_new_tokens"] == 5

    run(Engines(D1=dies), scenario, decodes=(D1, D2))


def test_a_stream_that_cannot_continue_ends_with_an_error_event_and_done():
    async def dies(engines, request, body):
        return MockReply(chunks=decode_stream(engines, request.base, body, die_after=3))

    async def scenario(r: Run):
        status, events = await r.generate(stream=True)
        assert status == 200 and [e["text"] for e in events[:3]] == [continuation(PROMPT, i) for i in (1, 2, 3)]
        assert "failed mid-stream" in events[3]["error"]["message"] and events[4:] == ["[DONE]"]

    run(Engines(D1=dies), scenario)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_abandons_both_legs(stream):
    async def stuck(engines, request, body):
        await asyncio.get_running_loop().create_future()
        raise AssertionError("unreachable")

    async def scenario(r: Run):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r.generate(stream=stream), 0.5)
        for _ in range(500):
            if len(r.engines.abandoned) == 2:
                break
            await asyncio.sleep(0.01)
        assert sorted(r.engines.abandoned) == sorted([P1, D1])

    run(Engines(P1=stuck), scenario)


class ChoosesNone:
    """A policy that accepts none of the workers it is offered (a manual policy whose key
    names no worker, for instance)."""

    name = "chooses_none"
    needs_text = False

    def select(self, workers: list, ctx: Any) -> None:
        return None


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_a_policy_that_chooses_no_worker_is_a_503_not_the_first_worker(role: Role) -> None:
    """Issue 14 P1: a policy returning None used to become the first pairable worker silently."""
    engines = Engines()

    async def scenario(r: Run) -> tuple[int, Any]:
        setattr(r.server.dispatcher.select, f"{role.value}_policy", ChoosesNone())
        return await r.generate()

    status, body = run(engines, scenario)
    assert status == 503
    assert f"the {role.value} policy chose no worker" in json.dumps(body)
    assert engines.mock.requests == []  # nothing was sent to any engine


def aborted(body: dict, message: str, status: int) -> MockReply:
    """A streamed request SGLang 0.5.23 aborts: a 200 head, then one output whose finish_reason is
    the abort with its status code (``_handle_abort_finish_reason`` yields it for streams), then
    [DONE]."""
    out = output(body, "", True)
    out["meta_info"]["finish_reason"] = {"type": "abort", "message": message, "status_code": status, "err_type": None}
    return MockReply(body=sse(out), content_type="text/event-stream")


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_that_lost_its_prefill_blames_the_prefill_not_itself(stream) -> None:
    """A decode that cannot reach its prefill's bootstrap server fails the room with SGLang's
    "Lost connection with prefill instance (bootstrap_addr: HOST:PORT)": a 500 (not streamed) or,
    streamed, a 200 whose first event is that abort. That is the prefill's failure: the request
    is retried on the other prefill, and the decode, the only one, stays in rotation (blaming it
    opened its circuit: a kill -9 of a prefill under bench_serving then failed 133 of 1000
    requests with no decode left; a streamed abort went to the client as its answer)."""

    async def loses_p1(engines: Engines, request: UpstreamRequest, body: dict) -> MockReply:
        if body["bootstrap_host"] == "127.0.0.2":  # P1's rooms
            message = "Lost connection with prefill instance (bootstrap_addr: 127.0.0.2:8998)"
            return aborted(body, message, 500) if stream else await answers(500, message)
        return await decode_ok(engines, request, body)

    engines = Engines(D1=loses_p1)

    async def scenario(r: Run) -> tuple[int, Any, bool, bool]:
        status, body = await r.generate(stream=stream)
        return status, body, r.circuit_open(P1), r.circuit_open(D1)

    status, body, p1_open, d1_open = run(engines, scenario, prefills=(P1, P2))
    assert status == 200 and text_of(stream, body) == continuation(PROMPT, 8)
    assert p1_open and not d1_open


def test_a_streamed_server_abort_is_retried_and_a_client_abort_is_the_answer() -> None:
    """A first event that aborts with a 5xx (nothing has reached the client) is the decode's
    failure, retried on another pair; one that aborts with a 4xx is the client's answer, passed
    on as SGLang sent it."""

    async def fails(engines: Engines, request: UpstreamRequest, body: dict) -> MockReply:
        await engines.room(body)
        return aborted(body, "CUDA out of memory", 500)

    async def refuses(engines: Engines, request: UpstreamRequest, body: dict) -> MockReply:
        await engines.room(body)
        return aborted(body, "input is longer than the context", 400)

    async def retried(r: Run) -> None:
        status, events = await r.generate(stream=True)
        assert status == 200 and text_of(True, events) == continuation(PROMPT, 8)
        assert r.circuit_open(D1) and not r.circuit_open(D2) and not r.circuit_open(P1)

    run(Engines(D1=fails), retried, decodes=(D1, D2))

    async def answered(r: Run) -> None:
        status, events = await r.generate(stream=True)
        assert status == 200 and events[0]["meta_info"]["finish_reason"]["status_code"] == 400
        assert events[1:] == ["[DONE]"]
        assert len(r.engines.bodies(D1)) + len(r.engines.bodies(D2)) == 1  # not retried
        assert not r.circuit_open(D1) and not r.circuit_open(D2)

    run(Engines(D1=refuses, D2=refuses), answered, decodes=(D1, D2))


def test_a_client_that_leaves_is_counted_as_499_not_as_a_server_error():
    """A request whose client went away ends under nginx's 499 in the router's request counter,
    so that dashboards' 5xx rates count only the router's and the engines' failures."""

    async def stuck(engines, request, body):
        await asyncio.get_running_loop().create_future()
        raise AssertionError("unreachable")

    async def scenario(r: Run):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r.generate(), 0.5)
        requests = r.server.metrics.hot.requests
        for _ in range(500):  # the handler ends once the router sees the client leave
            if requests:
                break
            await asyncio.sleep(0.01)
        return dict(requests)

    assert run(Engines(P1=stuck), scenario) == {("/generate", 499): 1}


def test_a_client_that_stops_reading_holds_back_the_engine_and_then_gets_the_whole_stream() -> None:
    """Flow control reaches the engine: while a client does not read, the router stops reading the
    decode's stream (the engine is held back) instead of piling it up; once the client reads on,
    the whole stream arrives, in order."""
    events = 400  # 40 MB: far more than the sockets' buffers hold
    produced: list[int] = []
    event = b'data: {"text": "' + b"x" * 100_000 + b'", "meta_info": {"finish_reason": null}}\n\n'

    async def big(engines, request, body):
        async def chunks() -> AsyncIterator[bytes]:
            await engines.room(body)
            for i in range(events):
                produced.append(i)
                yield event
            yield b"data: [DONE]\n\n"

        return MockReply(chunks=chunks(), content_type="text/event-stream")

    async def scenario(r: Run):
        host, port = r.server.url.split("//")[1].split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, (host, int(port)))
        body = json.dumps({"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 8}}).encode()
        head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        await loop.sock_sendall(sock, head % len(body) + body)
        deadline = time.monotonic() + 60
        while len(produced) < events:  # until the router holds the engine's stream back (or it all went)
            assert time.monotonic() < deadline, "the engine's stream neither held back nor all sent in 60 s"
            stream = r.engines.mock_streams()
            if stream and not stream[0].reading.is_set():
                break
            await asyncio.sleep(0.01)
        assert len(produced) < events, "the engine was held back before its stream ended"
        parts, tail = [], b""
        while not tail.endswith(b"0\r\n\r\n"):
            chunk = await loop.sock_recv(sock, 1 << 20)
            assert chunk, "the connection closed before the stream ended"
            parts.append(chunk)
            tail = (tail + chunk)[-16:]
        sock.close()
        data = b"".join(parts)
        assert data.count(b"data: {") == events and data.rstrip().endswith(b"0"), "every event, then the end"
        assert b"data: [DONE]" in data

    run(Engines(D1=big), scenario)


def test_a_breaker_opened_by_5xx_answers_is_a_503_at_once_not_a_wait():
    """Drop-in with sglang-router 0.3.2 (found by a probe): a worker whose circuit opened on its
    own 5xx answers is out until the breaker's timeout, and a request then gets a 503 at once;
    the wait for a worker (--worker-wait-secs) is for one restarting or unreachable, which would
    come back by itself (here the wait is 600 s: a request that waited would time the test out)."""

    async def broken(engines, request, body):
        await engines.room(body)
        return await answers(500, "decode broke")

    async def scenario(r: Run):
        status, answer = await r.generate()
        assert status == 500, answer  # its own 500, once retries are spent
        assert r.circuit_open(D1)
        status, answer = await r.generate()
        assert status == 503 and answer["error"]["code"] == "no_decode_servers", answer

    run(
        Engines(D1=broken),
        scenario,
        retry=RetryConfig(max_retries=0),
        admission=AdmissionConfig(request_timeout_secs=30, worker_wait_secs=600),
    )


def test_a_keyless_worker_gets_the_clients_authorization_and_a_keyed_one_its_own_key():
    """A standalone router that holds no key for its workers (engines started with the clients'
    own --api-key, as people run sglang-router) passes the client's Authorization on, as
    sglang-router and smg do; a worker the router holds a key for gets that key, never the client's."""

    async def scenario(r: Run):
        r.server.registry.workers[D1].auth = {"Authorization": "Bearer engine-key"}  # as POST /workers with api_key
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        async with r.client.post(r.server.url + "/generate", json=body, headers={"Authorization": "bearer K"}) as resp:
            assert resp.status == 200
        sent = {req.base: dict(req.headers) for req in r.engines.mock.requests}
        assert sent[P1].get("Authorization") == "bearer K", sent[P1]
        assert sent[D1].get("Authorization") == "Bearer engine-key", sent[D1]

    run(Engines(), scenario)
