"""The PD race (a decode leg run against its prefill, ``PairAttempt.race``) under Python 3.11's
cancellation counting, in-process: a leg that consumes the race's cancel (as 3.11's ``wait_for``
does when its inner call completes with the cancel) must not make a later race read its own
cancel as the client's. It did: the CancelledError escaped the handler and the client waited for
ever (seen under load in the suite: a bench request and a healing test's request hung)."""

from __future__ import annotations

import asyncio

from pdctl.roles import Role
from pdctl.router.config import RouterConfig
from pdctl.router.gate import RefitGate
from pdctl.router.legs import Legs, PairAttempt
from pdctl.router.mock_upstream import MockReply, MockUpstream, UpstreamRequest
from pdctl.router.reply import Reply
from pdctl.router.shaping import Headers
from pdctl.router.upstream import UpstreamError
from pdctl.router.workers import WorkerRegistry

PREFILL, DECODE = "http://127.0.0.2:1", "http://127.0.0.3:1"


async def _prefill_dies(request: UpstreamRequest) -> MockReply:
    await asyncio.sleep(0)
    raise UpstreamError("prefill went away (test)")  # a failure: it ends the request


async def _prefill_runs(request: UpstreamRequest) -> MockReply:
    await asyncio.Event().wait()  # a prefill still running
    raise AssertionError("unreachable")


def _pair(registry: WorkerRegistry, legs: Legs) -> PairAttempt:
    prefill, decode = registry.workers[PREFILL], registry.workers[DECODE]
    return PairAttempt(legs, prefill, decode, "/generate", b"{}", Headers({}, {}))


def _fleet(handler) -> tuple[WorkerRegistry, Legs]:
    config = RouterConfig()
    registry = WorkerRegistry(config)
    registry.add(PREFILL, Role.PREFILL, 8998)
    registry.add(DECODE, Role.DECODE)
    return registry, Legs(MockUpstream(handler), registry, RefitGate(), 30)


def test_a_consumed_race_cancel_does_not_leak_into_the_next_race() -> None:
    async def scenario() -> tuple[object, object, int]:
        registry, legs = _fleet(_prefill_dies)

        async def consuming_leg() -> str:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                return "consumed"  # the leg swallowed the race's cancel and returned
            return "not cancelled"

        async with _pair(registry, legs) as first_pair:
            first = await first_pair.race(consuming_leg())
        async with _pair(registry, legs) as second_pair:
            second = await second_pair.race(asyncio.sleep(30))
        task = asyncio.current_task()
        assert task is not None
        left = task.cancelling()
        await legs.close()
        return first, second, left

    first, second, left = asyncio.run(scenario())
    assert first == "consumed" and second is None, (first, second)
    assert left == 0, "no cancel request of the races is left on the task"


def test_a_client_that_leaves_during_a_race_still_ends_the_request() -> None:
    async def scenario() -> tuple[bool, int]:
        registry, legs = _fleet(_prefill_runs)
        pair = _pair(registry, legs)

        async def handler() -> object:
            async with pair:
                return await pair.race(asyncio.sleep(30))

        task = asyncio.ensure_future(handler())
        while not legs.upstream.requests:  # type: ignore[attr-defined]  # the prefill leg is sent
            await asyncio.sleep(0)
        task.cancel()  # the client went away
        try:
            await task
        except asyncio.CancelledError:
            return True, registry.workers[PREFILL].load
        finally:
            await legs.close()
        return False, -1

    reached, prefill_load = asyncio.run(scenario())
    assert reached, "the client's cancel reaches the handler"
    assert prefill_load == 0, "the prefill leg was cancelled with the attempt"


def test_a_prefill_the_reply_went_out_without_is_cancelled_after_its_grace_and_a_late_one_recorded() -> None:
    """``keep_prefill`` hands a running prefill over: one that answers within its grace is
    recorded (its circuit counts it), one that does not is cancelled (the engine aborts it);
    legs end in the order they began their grace, under one timer."""

    async def scenario() -> tuple[list[str], int, int]:
        answer_now = asyncio.Event()
        seen: list[str] = []

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
                raise

        registry, legs = _fleet(engines)
        prefill, decode = registry.workers[PREFILL], registry.workers[DECODE]
        legs.grace_secs = 0.2
        slow = PairAttempt(legs, prefill, decode, "/generate", b'{"room": "slow"}', Headers({}, {}))
        late = PairAttempt(legs, prefill, decode, "/generate", b'{"room": "late"}', Headers({}, {}))
        for pair in (slow, late):
            reply = await pair.whole(with_logprobs=False)
            assert isinstance(reply, Reply) and reply.status == 200  # the decode's answer, kept
        failures_before = prefill.cb_failures
        answer_now.set()  # the second prefill answers within its grace (a 500: a failure to record)
        await asyncio.wait_for(asyncio.shield(late.prefill_leg), 5)
        await asyncio.wait_for(asyncio.gather(slow.prefill_leg, return_exceptions=True), 5)  # ends at its grace
        recorded = prefill.cb_failures - failures_before
        await legs.close()
        return seen, recorded, prefill.load

    seen, recorded, load = asyncio.run(scenario())
    assert seen == ["slow cancelled"], seen
    assert recorded == 1, "the late prefill's failure was recorded"
    assert load == 0


def test_closing_an_attempt_gives_back_its_prefill_leg_at_once() -> None:
    """``close()`` returns once the cancelled prefill leg has given back its worker's load
    (its done callbacks run in the loop's next turn: close waits for them)."""

    async def scenario() -> int:
        registry, legs = _fleet(_prefill_runs)
        pair = _pair(registry, legs)
        while not legs.upstream.requests:  # type: ignore[attr-defined]  # the prefill leg is sent
            await asyncio.sleep(0)
        await pair.close()
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
        leg = legs.start(registry.workers[DECODE], "/generate", b"{}", Headers({}, {}))
        got = await asyncio.wait_for(leg, 5)
        await legs.close()
        return got.error

    error = asyncio.run(scenario())
    assert isinstance(error, UpstreamError), error
