"""The router's PD failure rules (``pdctl.router.dispatch``'s docstring), one fast in-process test each.

The router is real (a RouterServer on port 0, real HTTP from the client); its engines are the toy
PD fleet of tests/router/mock_fleet.py, a MockUpstream of toy engines that follow SGLang's PD
protocol as far as these rules need. Each test injects one failure and checks what the client
got, which legs the router abandoned (the engine sees the connection go away), which worker the
circuit breaker blamed, and that every worker's load returns to zero. The rules test_refit_rules
checks again after an interrupt are mock_fleet's ``check_*`` functions, run here as they are. The
slow tests with real sims (test_pd_routing, test_overload) stay for what only real processes
show: the wire format, kills, and load.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pdctl.roles import Role
from pdctl.router.config import AdmissionConfig, BreakerConfig, RetryConfig
from pdctl.router.mock_upstream import MockReply
from pdctl.router.upstream import UpstreamError
from tests.router.mock_fleet import (
    D1,
    D2,
    P1,
    P2,
    PROMPT,
    Engines,
    Run,
    answers,
    check_a_decode_that_fails_after_its_prefill_answered_takes_the_blame,
    check_a_decode_that_lost_its_prefill_blames_the_prefill_not_itself,
    check_a_decode_that_never_answers_is_a_504_and_not_retried,
    check_a_streamed_server_abort_is_retried_and_a_client_abort_is_the_answer,
    continuation,
    decode_ok,
    decode_stream,
    run,
    sse,
    text_of,
)

pytestmark = pytest.mark.timeout(60)  # a rule that regresses into a hang fails instead


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
    check_a_decode_that_fails_after_its_prefill_answered_takes_the_blame(stream)


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
    check_a_decode_that_never_answers_is_a_504_and_not_retried(stream)


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


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_that_lost_its_prefill_blames_the_prefill_not_itself(stream) -> None:
    """A decode that cannot reach its prefill's bootstrap server fails the room with SGLang's
    "Lost connection with prefill instance (bootstrap_addr: HOST:PORT)": a 500 (not streamed) or,
    streamed, a 200 whose first event is that abort. That is the prefill's failure: the request
    is retried on the other prefill, and the decode, the only one, stays in rotation (blaming it
    opened its circuit: a kill -9 of a prefill under bench_serving then failed 133 of 1000
    requests with no decode left; a streamed abort went to the client as its answer)."""
    check_a_decode_that_lost_its_prefill_blames_the_prefill_not_itself(stream)


def test_a_streamed_server_abort_is_retried_and_a_client_abort_is_the_answer() -> None:
    """A first event that aborts with a 5xx (nothing has reached the client) is the decode's
    failure, retried on another pair; one that aborts with a 4xx is the client's answer, passed
    on as SGLang sent it."""
    check_a_streamed_server_abort_is_retried_and_a_client_abort_is_the_answer()


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
