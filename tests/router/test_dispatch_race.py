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
