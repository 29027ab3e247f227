"""The PD race, in-process: a ``PairAttempt``'s decode leg against its prefill. Both legs answer
through callbacks; the attempt's task is woken once, by what decides it, and is never cancelled
by the attempt itself (Python 3.11's cancel counting once made a race's own cancel read as the
client's: the CancelledError escaped the handler and the client waited for ever)."""

from __future__ import annotations

import asyncio

from pdctl.roles import Role
from pdctl.router.config import RouterConfig
from pdctl.router.gate import RefitGate
from pdctl.router.legs import Legs, PairAttempt
from pdctl.router.mock_upstream import MockReply, MockUpstream, UpstreamRequest
from pdctl.router.reply import Reply
from pdctl.router.retry import Retry
from pdctl.router.shaping import Headers
from pdctl.router.upstream import UpstreamError
from pdctl.router.workers import WorkerRegistry
from tests.helpers import eventually_async

PREFILL, DECODE = "http://127.0.0.2:1", "http://127.0.0.3:1"


async def _prefill_runs(request: UpstreamRequest) -> MockReply:
    await asyncio.Event().wait()  # a prefill still running
    raise AssertionError("unreachable")


def _pair(registry: WorkerRegistry, legs: Legs, body: bytes = b"{}") -> PairAttempt:
    prefill, decode = registry.workers[PREFILL], registry.workers[DECODE]
    return PairAttempt(legs, prefill, decode, "/generate", body, Headers({}, {}))


def _fleet(handler) -> tuple[WorkerRegistry, Legs]:
    config = RouterConfig()
    registry = WorkerRegistry(config)
    registry.add(PREFILL, Role.PREFILL, 8998)
    registry.add(DECODE, Role.DECODE)
    return registry, Legs(MockUpstream(handler), registry, RefitGate(), 30)


def test_a_prefill_that_ends_the_request_cancels_its_decode_without_cancelling_the_task() -> None:
    """The decode waits for KV that will never come: it is cancelled at once, the attempt is a
    retry, both loads are back, and the task holds no cancel request (twice in a row)."""

    async def scenario() -> tuple[list[object], list[str], dict[str, int], int]:
        abandoned: list[str] = []

        async def engines(request: UpstreamRequest) -> MockReply:
            if request.base == PREFILL:
                await asyncio.sleep(0)
                raise UpstreamError("prefill went away (test)")  # a failure: it ends the request
            try:
                await asyncio.Event().wait()  # a decode waiting for its KV
            except asyncio.CancelledError:
                abandoned.append(request.base)
                raise
            raise AssertionError("unreachable")

        registry, legs = _fleet(engines)
        outcomes = [await _pair(registry, legs).whole(with_logprobs=False) for _ in range(2)]
        for _ in range(3):
            await asyncio.sleep(0)  # the cancelled decodes' handlers see it
        task = asyncio.current_task()
        assert task is not None
        loads = {url: w.load for url, w in registry.workers.items()}
        await legs.close()
        return outcomes, abandoned, loads, task.cancelling()

    outcomes, abandoned, loads, cancelling = asyncio.run(scenario())
    assert all(isinstance(o, Retry) for o in outcomes), outcomes
    assert abandoned == [DECODE, DECODE]
    assert loads == {PREFILL: 0, DECODE: 0}
    assert cancelling == 0, "no cancel request is left on the task"


def test_a_client_that_leaves_during_a_race_still_ends_the_request() -> None:
    async def scenario() -> tuple[bool, dict[str, int]]:
        registry, legs = _fleet(_prefill_runs)
        pair = _pair(registry, legs)
        task = asyncio.ensure_future(pair.whole(with_logprobs=False))
        await eventually_async(lambda: len(legs.upstream.requests) >= 2, what="both legs sent")  # type: ignore[attr-defined]
        task.cancel()  # the client went away
        try:
            await task
        except asyncio.CancelledError:
            return True, {url: w.load for url, w in registry.workers.items()}
        finally:
            await legs.close()
        return False, {}

    reached, loads = asyncio.run(scenario())
    assert reached, "the client's cancel reaches the handler"
    assert loads == {PREFILL: 0, DECODE: 0}, "both legs were cancelled with the attempt"


def test_a_prefill_the_reply_went_out_without_is_cancelled_after_its_grace_and_a_late_one_recorded() -> None:
    """``keep_prefill`` hands a running prefill over: one that answers within its grace is
    recorded (its circuit counts it), one that does not is cancelled (the engine aborts it);
    prefills end in the order they began their grace, under one timer."""

    async def scenario() -> tuple[list[str], int, int]:
        answer_now = asyncio.Event()
        seen: list[str] = []
        both_over = asyncio.Event()

        async def engines(request: UpstreamRequest) -> MockReply:
            room = request.json().get("room")
            if request.base == DECODE:
                return MockReply(json={"text": "ok"})
            try:
                if room == "slow":
                    await asyncio.Event().wait()  # never answers
                await answer_now.wait()
                return MockReply(status=500, json={"error": "prefill failed late"})
            except asyncio.CancelledError:
                seen.append(f"{room} cancelled")
                both_over.set()
                raise

        registry, legs = _fleet(engines)
        prefill = registry.workers[PREFILL]
        legs.grace_secs = 0.2
        for room in ("slow", "late"):
            reply = await _pair(registry, legs, b'{"room": "%s"}' % room.encode()).whole(with_logprobs=False)
            assert isinstance(reply, Reply) and reply.status == 200  # the decode's answer, kept
        failures_before = prefill.cb_failures
        answer_now.set()  # the second prefill answers within its grace (a 500: a failure to record)
        await asyncio.wait_for(both_over.wait(), 5)  # the first one's grace ends
        # (its cancel gives the load back at once; the late answer may still come)
        await eventually_async(lambda: not prefill.load, interval=0.01, what="the prefill's load given back")
        recorded = prefill.cb_failures - failures_before
        await legs.close()
        return seen, recorded, prefill.load

    seen, recorded, load = asyncio.run(scenario())
    assert seen == ["slow cancelled"], seen
    assert recorded == 1, "the late prefill's failure was recorded"
    assert load == 0


def test_closing_an_attempt_gives_back_its_prefill_leg_at_once() -> None:
    async def scenario() -> int:
        registry, legs = _fleet(_prefill_runs)
        pair = _pair(registry, legs)
        await eventually_async(lambda: legs.upstream.requests, what="the prefill leg sent")  # type: ignore[attr-defined]
        pair.close()
        load = registry.workers[PREFILL].load
        await legs.close()
        return load

    assert asyncio.run(scenario()) == 0


def test_a_leg_whose_request_task_is_cancelled_from_outside_still_ends() -> None:
    """A request run as a task (connecting first; the MockUpstream) that something else cancels
    (the loop shutting down) ends its leg with an error, not a leg that waits for ever."""

    async def cancelled_engine(request: UpstreamRequest) -> MockReply:
        raise asyncio.CancelledError

    async def scenario() -> object:
        registry, legs = _fleet(cancelled_engine)
        leg = legs.start(legs.claim(registry.workers[DECODE]), "/generate", b"{}", Headers({}, {}))
        got = await asyncio.wait_for(leg, 5)
        await legs.close()
        return got.error

    error = asyncio.run(scenario())
    assert isinstance(error, UpstreamError), error
