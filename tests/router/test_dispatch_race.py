"""The PD race (a decode leg run against its prefill) under Python 3.11's cancellation counting,
in-process: a leg that consumes the race's cancel (as 3.11's ``wait_for`` does when its inner
call completes with the cancel) must not make a later race read its own cancel as the client's.
It did: the CancelledError escaped the handler and the client waited for ever (seen under load
in the suite: a bench request and a healing test's request hung)."""

from __future__ import annotations

import asyncio

from pdctl.router.config import RouterConfig
from pdctl.router.dispatch import Dispatcher, Leg
from pdctl.router.metrics import RouterMetrics
from pdctl.router.workers import WorkerRegistry


async def _ended() -> Leg:
    await asyncio.sleep(0)
    return Leg(error=OSError("prefill went away (test)"))  # a failure: it ends the request


def test_a_consumed_race_cancel_does_not_leak_into_the_next_race() -> None:
    async def scenario() -> tuple[object, object, int]:
        config = RouterConfig()
        registry = WorkerRegistry(config)
        dispatcher = Dispatcher(config, registry, RouterMetrics())
        decode = registry.add("http://127.0.0.1:1", "decode")

        async def consuming_leg() -> str:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                return "consumed"  # the leg swallowed the race's cancel and returned
            return "not cancelled"

        first = await dispatcher._race(asyncio.ensure_future(_ended()), decode, consuming_leg())
        second = await dispatcher._race(asyncio.ensure_future(_ended()), decode, asyncio.sleep(30))
        task = asyncio.current_task()
        assert task is not None
        left = task.cancelling()
        await dispatcher.close()
        return first, second, left

    first, second, left = asyncio.run(scenario())
    assert first == "consumed" and second is None, (first, second)
    assert left == 0, "no cancel request of the races is left on the task"


def test_a_client_that_leaves_during_a_race_still_ends_the_request() -> None:
    async def scenario() -> bool:
        config = RouterConfig()
        registry = WorkerRegistry(config)
        dispatcher = Dispatcher(config, registry, RouterMetrics())
        decode = registry.add("http://127.0.0.1:1", "decode")
        never = asyncio.get_running_loop().create_future()  # a prefill still running

        async def handler() -> object:
            return await dispatcher._race(never, decode, asyncio.sleep(30))

        task = asyncio.ensure_future(handler())
        await asyncio.sleep(0.01)
        task.cancel()  # the client went away
        try:
            await task
        except asyncio.CancelledError:
            return True
        finally:
            await dispatcher.close()
        return False

    assert asyncio.run(scenario()), "the client's cancel reaches the handler"
