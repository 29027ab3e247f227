"""The dispatcher through its seam, in-process: no HTTP server, no sockets.

A ``Dispatcher`` over the toy PD fleet of tests/router/mock_fleet.py (a ``MockUpstream``) answers with
a ``Reply`` or a ``StreamReply`` whose body the test reads (or abandons) itself, as the server
would. The retry policy runs on a fake clock: its sleeps are recorded, never slept, so that the
budget and the backoff are checked exactly.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest

from pdctl.refit import RefitMode
from pdctl.router.config import AdmissionConfig, BreakerConfig, RetryConfig, RouterConfig
from pdctl.router.dispatch import Dispatcher
from pdctl.router.errors import RouteError
from pdctl.router.metrics import RouterMetrics
from pdctl.router.mock_upstream import MockReply
from pdctl.router.reply import Reply, StreamReply
from pdctl.router.retry import Retry, RetryPolicy
from pdctl.router.shaping import Headers
from pdctl.router.upstream import UpstreamError
from pdctl.router.workers import WorkerRegistry
from tests.helpers import eventually_async
from tests.router.mock_fleet import (
    D1,
    D2,
    P1,
    P2,
    PROMPT,
    Engines,
    answers,
    config,
    continuation,
    decode_stream,
    output,
    sse,
)

pytestmark = pytest.mark.timeout(60)
RETRY = RetryConfig(max_retries=3, initial_backoff_ms=100, backoff_multiplier=2, max_backoff_ms=250, jitter_factor=0.2)


class FakeClock:
    """The retry policy's clock and sleep: time moves only when the policy sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.during_sleep: list[Callable[[], None]] = []  # called (once each) while the policy sleeps

    def __call__(self) -> float:
        return self.now

    async def sleep(self, secs: float) -> None:
        self.sleeps.append(secs)
        self.now += secs
        while self.during_sleep:
            self.during_sleep.pop(0)()
        await asyncio.sleep(0)


class Fleet:
    """A dispatcher over ``engines``, with the fake clock; ``load()`` reads every worker's load."""

    def __init__(self, engines: Engines, router: RouterConfig, clock: FakeClock):
        self.engines, self.clock = engines, clock
        self.registry = WorkerRegistry(router)
        for w in router.workers:
            self.registry.add(w.url, w.role, w.bootstrap_port, healthy=True)
        policy = RetryPolicy(router.retry, 30.0, clock=clock, sleep=clock.sleep, uniform=lambda a, b: 0.0)
        self.dispatcher = Dispatcher(router, self.registry, RouterMetrics(), engines.mock, retry=policy)

    async def generate(self, *, stream: bool = False, tokens: int = 8) -> Reply | StreamReply:
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}, "stream": stream}
        return await self.dispatcher.pd_request("/generate", body, None, Headers({"X-Request-ID": "r1"}, {}))

    def load(self) -> dict[str, int]:
        return {url: w.load for url, w in self.registry.workers.items()}


def run(
    engines: Engines,
    scenario: Callable[[Fleet], Awaitable[Any]],
    *,
    prefills: tuple[str, ...] = (P1,),
    decodes: tuple[str, ...] = (D1,),
    **groups: Any,
) -> Any:
    groups.setdefault("retry", RETRY)
    clock = FakeClock()

    async def main() -> Any:
        fleet = Fleet(engines, config(prefills, decodes, **groups), clock)
        try:
            return await scenario(fleet)
        finally:
            await fleet.dispatcher.close()

    return asyncio.run(main())


async def read(reply: StreamReply) -> list[Any]:
    """A stream's data events (dicts, "[DONE]"), read as the server would, body closed after."""
    raw = b""
    try:
        async for chunk in reply.body:
            raw += chunk
    finally:
        await reply.body.aclose()
        for done in reply.on_close:
            done()
    events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


async def streamed(f: Fleet) -> list[Any]:
    """A streamed request's events, as its client gets them."""
    reply = await f.generate(stream=True)
    assert isinstance(reply, StreamReply)
    return await read(reply)


def dies_after(events: int) -> Callable[[Engines, Any, dict], Awaitable[MockReply]]:
    """A decode whose stream dies (a reset connection) after ``events`` events."""

    async def dies(engines: Engines, request: Any, body: dict) -> MockReply:
        chunks = decode_stream(engines, request.base, body, die_after=events)
        return MockReply(chunks=chunks, content_type="text/event-stream")

    return dies


def test_a_plain_request_is_a_reply_with_decodes_answer_and_both_legs_end() -> None:
    async def scenario(f: Fleet) -> None:
        reply = await f.generate()
        assert isinstance(reply, Reply) and reply.status == 200
        assert json.loads(reply.body)["text"] == continuation(PROMPT, 8)
        assert reply.headers == {"X-Request-ID": "r1"}
        (p,), (d,) = f.engines.bodies(P1), f.engines.bodies(D1)
        assert p["bootstrap_room"] == d["bootstrap_room"]
        await asyncio.sleep(0)  # the prefill leg the reply did not wait for
        assert f.load() == {P1: 0, D1: 0}

    run(Engines(), scenario)


def held_after(events: int, go: asyncio.Event) -> Callable[[Engines, Any, dict], Awaitable[MockReply]]:
    """A decode whose stream holds after ``events`` events until ``go`` (an engine still generating)."""

    async def held(engines: Engines, request: Any, body: dict) -> MockReply:
        stream = decode_stream(engines, request.base, body)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                for _ in range(events):
                    yield await stream.__anext__()
                await go.wait()
                async for chunk in stream:
                    yield chunk
            except asyncio.CancelledError:
                await stream.aclose()
                raise

        return MockReply(chunks=chunks(), content_type="text/event-stream")

    return held


def test_a_stream_is_a_stream_reply_whose_body_is_the_decodes_events() -> None:
    go = asyncio.Event()

    async def scenario(f: Fleet) -> None:
        reply = await f.generate(stream=True)
        assert isinstance(reply, StreamReply) and reply.status == 200
        assert reply.content_type == "text/event-stream" and reply.headers == {"X-Request-ID": "r1"}
        assert f.load()[D1] == 1  # the decode counts until its stream ends
        go.set()
        events = await read(reply)
        assert events[-1] == "[DONE]" and events[-2]["text"] == continuation(PROMPT, 8)
        assert [e["meta_info"]["completion_tokens"] for e in events[:-1]] == list(range(1, 9))
        assert f.load() == {P1: 0, D1: 0} and f.clock.sleeps == []

    run(Engines(D1=held_after(1, go)), scenario)


def test_a_stream_abandoned_before_its_first_chunk_ends_both_legs() -> None:
    """The server closes a body it never read (the client left with the head in hand): the decode's
    stream is dropped (the engine sees the reader go away) and its load released."""

    async def scenario(f: Fleet) -> None:
        reply = await f.generate(stream=True)
        assert isinstance(reply, StreamReply)
        await reply.body.aclose()
        for _ in range(10):
            await asyncio.sleep(0)  # the engine's generator sees its reader leave
        assert D1 in f.engines.abandoned
        assert f.load() == {P1: 0, D1: 0}

    run(Engines(D1=held_after(1, asyncio.Event())), scenario)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_finds_no_decode_in_rotation_waits_for_one(stream: bool) -> None:
    """The only decode is out of rotation (cordoned for a rolling restart; health checks are off
    in this fleet): the request waits, sends nothing meanwhile, and is served once the decode is
    back; no retry is counted."""

    async def scenario(f: Fleet) -> None:
        decode = f.registry.workers[D1]
        decode.cordoned = "restart"
        request = asyncio.ensure_future(f.generate(stream=stream))
        await eventually_async(lambda: _waiting(f, request), what="the request waiting for a worker")
        assert f.engines.bodies(P1) == [] and f.engines.bodies(D1) == []
        decode.cordoned = None
        f.registry.rotation_changed()
        reply = await request
        assert reply.status == 200
        if isinstance(reply, StreamReply):
            assert (await read(reply))[-1] == "[DONE]"
        assert f.dispatcher.metrics.waiting_for_workers == 0 and f.clock.sleeps == []
        assert len(f.engines.bodies(D1)) == 1

    run(Engines(), scenario, admission=AdmissionConfig(request_timeout_secs=30, worker_wait_secs=600))


def test_a_request_that_finds_prefill_and_decode_on_different_versions_waits_for_a_pair() -> None:
    """A weight update relabels its engines one call at a time: a request that meets the prefill
    relabelled and the decode not yet waits for the registry to pair them (``relabelled``), sends
    nothing meanwhile, and is served; past the wait it gets the 503 that names both versions."""

    async def scenario(f: Fleet) -> None:
        prefill, decode = f.registry.workers[P1], f.registry.workers[D1]
        f.registry.relabelled([prefill], "pdctl:updating:t1")
        request = asyncio.ensure_future(f.generate())
        await eventually_async(lambda: _waiting(f, request), what="the request waiting for a pair")
        assert f.engines.bodies(P1) == [] and f.engines.bodies(D1) == []
        f.registry.relabelled([decode], "pdctl:updating:t1")
        assert (await request).status == 200 and len(f.engines.bodies(D1)) == 1

    async def unpaired(f: Fleet) -> None:
        f.registry.relabelled([f.registry.workers[P1]], "v2")
        with pytest.raises(RouteError) as caught:
            await f.generate()
        assert caught.value.status == 503 and caught.value.code == "no_matching_weight_version"
        assert "waited 0.05 s" in str(caught.value) and "v2" in str(caught.value)

    run(Engines(), scenario, admission=AdmissionConfig(request_timeout_secs=30, worker_wait_secs=600))
    run(Engines(), unpaired, admission=AdmissionConfig(request_timeout_secs=30, worker_wait_secs=0.05))


def test_a_request_woken_during_an_interrupting_update_waits_for_its_release() -> None:
    """The decode comes back while an update holds the router in ``interrupt`` mode (its engines
    paused): the waiting request is not sent before the release."""

    async def scenario(f: Fleet) -> None:
        decode = f.registry.workers[D1]
        decode.cordoned = "restart"
        request = asyncio.ensure_future(f.generate())
        await eventually_async(lambda: f.dispatcher.metrics.waiting_for_workers, what="a request waiting for a worker")
        f.dispatcher.gate.close(RefitMode.INTERRUPT, None, new_transaction=True)
        decode.cordoned = None
        f.registry.rotation_changed()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not request.done() and f.engines.bodies(D1) == []  # held, nothing sent
        f.dispatcher.gate.open()
        assert (await request).status == 200 and len(f.engines.bodies(D1)) == 1

    run(Engines(), scenario, admission=AdmissionConfig(request_timeout_secs=30, worker_wait_secs=600))


def test_the_wait_for_a_worker_ends_in_the_503_and_a_role_with_none_to_come_back_is_not_waited_for() -> None:
    async def scenario(f: Fleet) -> None:
        f.registry.workers[D1].cordoned = "restart"
        with pytest.raises(RouteError) as caught:
            await f.generate()
        assert caught.value.status == 503 and caught.value.code == "no_decode_servers"
        assert "waited 0.05 s" in str(caught.value)
        f.registry.remove(D1)  # no decode at all: nothing to wait for, the 503 at once
        f.dispatcher.config = replace(f.dispatcher.config, admission=AdmissionConfig(worker_wait_secs=600))
        with pytest.raises(RouteError) as caught:
            await f.generate()
        assert caught.value.code == "no_decode_servers" and "waited" not in str(caught.value)
        f.registry.add(D1, "decode", healthy=True)
        f.registry.set_quarantine(D1, "weight push t1 stopped half way")  # only a later push brings it back
        with pytest.raises(RouteError) as caught:
            await f.generate()
        assert "stopped half way" in str(caught.value) and "waited" not in str(caught.value)
        assert f.dispatcher.metrics.waiting_for_workers == 0

    run(Engines(), scenario, admission=AdmissionConfig(request_timeout_secs=30, worker_wait_secs=0.05))


def test_connection_failures_use_the_budget_with_exponential_backoff() -> None:
    """max_retries 3: four attempts, three waits of 100, 200 and 250 ms (capped), then 502."""

    async def refused(engines: Engines, request: Any, body: dict) -> MockReply:
        raise UpstreamError("connection refused")

    async def scenario(f: Fleet) -> None:
        with pytest.raises(RouteError) as caught:
            await f.generate()
        assert caught.value.status == 502 and "after 4 attempt(s)" in str(caught.value)
        assert len(f.engines.bodies(D1)) == 4
        assert f.clock.sleeps == pytest.approx([0.1, 0.2, 0.25])

    run(Engines(D1=refused), scenario, breaker=BreakerConfig(disabled=True))


def test_a_worker_5xx_is_retried_then_passed_on_as_is() -> None:
    async def broken(engines: Engines, request: Any, body: dict) -> MockReply:
        await engines.room(body)
        return await answers(500, "decode broke")

    async def scenario(f: Fleet) -> None:
        reply = await f.generate()
        assert isinstance(reply, Reply) and reply.status == 500
        assert json.loads(reply.body) == {"error": {"message": "decode broke", "code": 500}}
        assert reply.headers == {"X-Request-ID": "r1"}
        assert len(f.clock.sleeps) == 3

    run(Engines(D1=broken), scenario, breaker=BreakerConfig(disabled=True))


def test_backpressure_waits_without_the_budget_until_the_request_timeout() -> None:
    """503s from a live decode: retried past the budget (3) with the backoff capped at 250 ms,
    until the next wait would pass the 2 s request timeout; then 503."""

    async def busy(engines: Engines, request: Any, body: dict) -> MockReply:
        return await answers(503, "queue full")

    async def scenario(f: Fleet) -> None:
        f.dispatcher.retry.timeout_secs = 2.0
        with pytest.raises(RouteError) as caught:
            await f.generate()
        assert caught.value.status == 503 and "busy for 2s" in str(caught.value)
        assert f.clock.sleeps[:3] == pytest.approx([0.1, 0.2, 0.25]) and len(f.clock.sleeps) > 4
        assert sum(f.clock.sleeps) <= 2.0 < sum(f.clock.sleeps) + 0.25
        assert len(f.engines.bodies(D1)) == len(f.clock.sleeps) + 1
        assert not f.registry.workers[D1].to_dict()["circuit_open"]

    run(Engines(D1=busy), scenario)


def test_a_stream_whose_decode_dies_continues_on_another_pair_after_a_backoff() -> None:
    """The decode dies after 3 events: the body's tail is a continuation on the other pair, after
    the policy's first backoff; the client's stream is one answer with cumulative counts."""

    async def scenario(f: Fleet) -> None:
        events = await streamed(f)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        assert events[-2]["text"] == continuation(PROMPT, 8)
        assert [e["meta_info"]["completion_tokens"] for e in events[:-1]] == list(range(1, 9))
        (resumed,) = f.engines.bodies(D2)
        assert resumed["text"] == PROMPT + continuation(PROMPT, 3)
        assert resumed["sampling_params"]["max_new_tokens"] == 5
        assert f.clock.sleeps == pytest.approx([0.1])
        assert f.load() == {P1: 0, P2: 0, D1: 0, D2: 0}

    run(Engines(D1=dies_after(3)), scenario, prefills=(P1, P2), decodes=(D1, D2))


def test_a_stream_that_dies_once_the_budget_is_spent_ends_with_an_error_event() -> None:
    """With retries disabled a decode that dies mid-stream is not continued: the client's stream
    ends with an SGLang-shaped error event and [DONE]."""

    async def scenario(f: Fleet) -> None:
        events = await streamed(f)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
        assert "failed mid-stream" in events[-2]["error"]["message"]
        assert [e["meta_info"]["completion_tokens"] for e in events[:-2]] == [1, 2]
        assert not f.engines.bodies(D2) and f.clock.sleeps == []

    run(Engines(D1=dies_after(2)), scenario, prefills=(P1, P2), decodes=(D1, D2), retry=RetryConfig(disabled=True))


def test_the_policy_counts_failures_and_busy_streaks_apart() -> None:
    clock = FakeClock()
    policy = RetryPolicy(RETRY, 1.0, clock=clock, sleep=clock.sleep, uniform=lambda a, b: b)  # jitter at its top
    tries = policy.start()
    failure, busy = Retry("boom", "x"), Retry("full", "y", busy=True)
    assert tries.next(failure) == pytest.approx(0.12)  # 100 ms + 20% jitter
    assert tries.next(busy) == pytest.approx(0.12)  # a busy streak starts its own backoff
    clock.now = 0.95
    assert tries.next(busy) is None  # 0.95 + 0.24 passes the 1 s deadline
    tries.paused(0.5)  # a weight update held the request: not counted
    assert tries.next(busy) == pytest.approx(0.3)  # 250 ms cap + jitter, within 1.5
    tries.progressed()
    clock.now = 10.0
    assert tries.next(busy) == pytest.approx(0.12)  # tokens reached the client: a fresh streak
    assert tries.next(failure) == pytest.approx(0.24)
    assert tries.next(failure) == pytest.approx(0.3)
    assert tries.next(failure) is None  # the fourth failure: 1 + max_retries attempts
    assert tries.give_up(Retry("boom", "x", answer=Reply(500, b"{}"))).status == 500
    with pytest.raises(RouteError) as caught:
        tries.give_up(busy)
    assert caught.value.status == 503
    off = RetryPolicy(RetryConfig(disabled=True), 1.0, clock=clock, sleep=clock.sleep).start()
    assert off.next(failure) is None


def test_an_interrupted_stream_continues_after_the_release_under_the_retry_policy() -> None:
    """A weight update interrupts a stream after 3 tokens (the engine ends it with an asked-for
    abort): the tail waits for the release, then continues on the new weights; its first attempt
    fails (a failure: the policy's backoff, 100 ms), the next one finishes the answer."""
    aborted = asyncio.Event()
    attempts: list[dict] = []

    async def interrupted_once(engines: Engines, request: Any, body: dict) -> MockReply:
        attempts.append(body)
        if len(attempts) == 2:
            raise UpstreamError("connection reset by peer")
        if len(attempts) > 2:
            return MockReply(chunks=decode_stream(engines, request.base, body), content_type="text/event-stream")

        async def events() -> Any:
            await engines.room(body)
            text = continuation(PROMPT, 8)
            for i in range(1, 4):
                yield sse(output(body, text[:i], False))[: -len(b"data: [DONE]\n\n")]
            await aborted.wait()  # the update pauses the engine: it aborts what it runs
            cut = output(body, text[:3], False)
            cut["meta_info"]["finish_reason"] = {"type": "abort", "message": "paused for a weight update"}
            yield sse(cut)

        return MockReply(chunks=events(), content_type="text/event-stream")

    async def scenario(f: Fleet) -> None:
        reply = await f.generate(stream=True)
        assert isinstance(reply, StreamReply)
        reading = asyncio.ensure_future(read(reply))
        gate = f.dispatcher.gate
        gate.close(RefitMode.INTERRUPT, None, new_transaction=True)
        aborted.set()
        # the interrupted stream is read to its end (its abort caught)
        await eventually_async(lambda: not f.load()[D1], what="the interrupted stream read to its end")
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(attempts) == 1 and not reading.done(), "nothing is sent while the update holds the router"
        gate.open()
        events = await reading
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        assert [e["meta_info"]["completion_tokens"] for e in events[:-1]] == list(range(1, 9))
        last = events[-2]
        assert last["text"] == continuation(PROMPT, 8) and last["meta_info"]["pdctl_interruptions"] == 1
        assert attempts[2]["text"] == PROMPT + continuation(PROMPT, 3)
        assert attempts[2]["sampling_params"]["max_new_tokens"] == 5
        assert f.clock.sleeps == pytest.approx([0.1])
        assert f.load() == {P1: 0, P2: 0, D1: 0, D2: 0}

    run(Engines(D1=interrupted_once, D2=interrupted_once), scenario, prefills=(P1, P2), decodes=(D1, D2))


@pytest.mark.parametrize("mode", [RefitMode.INTERRUPT, RefitMode.DRAIN])
def test_a_retry_waits_out_an_interrupting_update_but_not_a_drain(mode: RefitMode) -> None:
    """A busy decode's retry comes due while a weight update holds the router. An interrupting
    update pauses the engines in abort mode: a retry sent then would be aborted and read as the
    client's own abort (a bench run under interrupt reloads saw 2 of 300 requests "aborted"), so
    it waits for the release. A drain waits for the requests in flight: their retries go on."""
    calls: list[dict] = []

    async def busy_then_held(engines: Engines, request: Any, body: dict) -> MockReply:
        calls.append(body)
        if len(calls) == 1:
            return await answers(503, "queue full")
        await engines.room(body)
        return MockReply(json=output(body, continuation(PROMPT, 8), True))

    async def scenario(f: Fleet) -> None:
        gate = f.dispatcher.gate
        f.clock.during_sleep.append(lambda: gate.close(mode, None, new_transaction=True))  # an update begins
        answer = asyncio.ensure_future(f.generate())
        for _ in range(50):
            await asyncio.sleep(0)
        if mode is RefitMode.INTERRUPT:
            assert len(calls) == 1 and not answer.done(), "the retry waits for the release"
        else:
            assert len(calls) == 2 and answer.done(), "the retry goes on during a drain"
        f.dispatcher.gate.open()
        reply = await answer
        assert isinstance(reply, Reply) and reply.status == 200
        assert json.loads(reply.body)["text"] == continuation(PROMPT, 8)

    run(Engines(D1=busy_then_held), scenario)


def _waiting(f, request) -> bool:
    """Whether ``request`` waits for a worker (it must not have ended meanwhile)."""
    assert not request.done(), request.result()
    return f.dispatcher.metrics.waiting_for_workers > 0
