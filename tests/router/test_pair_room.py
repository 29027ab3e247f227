"""Late pairing's queue (pdctl.router.pair_room) on a real worker registry, without HTTP: arrival
order, the head for requests already in flight, one wake at a time, a client that leaves as it is
woken (never paired), the timeout, and the policies it refuses."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdctl.errors import RouterConfigError
from pdctl.roles import Role
from pdctl.router.config import AdmissionConfig, RouterConfig
from pdctl.router.errors import RouteError
from pdctl.router.pair_room import PairRoom
from pdctl.router.workers import WorkerRegistry


def _fleet(prefills: int = 1) -> tuple[WorkerRegistry, list]:
    registry = WorkerRegistry(RouterConfig(pd_disaggregation=True))
    workers = [registry.add(f"http://p{k}", Role.PREFILL, 9000 + k, healthy=True) for k in range(prefills)]
    registry.add("http://d0", Role.DECODE, healthy=True)
    return registry, workers


def test_requests_leave_in_arrival_order_one_per_room_and_in_flight_ones_go_first() -> None:
    async def run() -> list[str]:
        registry, (prefill,) = _fleet()
        room = PairRoom(registry, 1, 0, 60)
        order: list[str] = []

        async def request(name: str, first: bool = False) -> None:
            await room.enter(first=first)
            order.append(name)
            prefill.took()  # paired: its claim
            room.freed()

        await request("a")  # room for one: no wait
        waiting = [asyncio.ensure_future(request(n)) for n in "bcd"]
        await asyncio.sleep(0)
        retried = asyncio.ensure_future(request("retry", first=True))
        await asyncio.sleep(0)
        assert room.waiting == 4 and order == ["a"]
        for _ in range(4):
            prefill.gave_back()  # the request at the prefill ends
            room.freed()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert prefill.load == 1, "more than its room paired at once"
        await asyncio.gather(*waiting, retried)
        return order

    assert asyncio.run(run()) == ["a", "retry", "b", "c", "d"]


def test_a_client_that_leaves_as_it_is_woken_is_never_paired_and_passes_the_wake_on() -> None:
    async def run() -> tuple[bool, list[str]]:
        registry, (prefill,) = _fleet()
        room = PairRoom(registry, 1, 0, 60)
        prefill.took()
        paired: list[str] = []

        async def request(name: str) -> None:
            await room.enter()
            paired.append(name)

        leaving = asyncio.ensure_future(request("leaving"))
        staying = asyncio.ensure_future(request("staying"))
        await asyncio.sleep(0)
        prefill.gave_back()
        room.freed()  # wakes "leaving" ...
        leaving.cancel()  # ... whose client hangs up in the same turn of the loop
        await asyncio.gather(leaving, return_exceptions=True)
        await asyncio.wait_for(staying, 5)
        return leaving.cancelled(), paired

    assert asyncio.run(run()) == (True, ["staying"])


def test_a_request_waits_at_most_the_timeout_and_a_closed_room_lets_everything_through() -> None:
    async def run() -> None:
        registry, (prefill,) = _fleet()
        room = PairRoom(registry, 1, 0, 0.05)
        prefill.took()
        with pytest.raises(RouteError) as info:
            await room.enter()
        assert info.value.status == 503 and info.value.code == "room_timeout" and room.waiting == 0
        room.timeout_secs = 60
        stuck = asyncio.ensure_future(room.enter())
        await asyncio.sleep(0)
        room.close()
        await asyncio.wait_for(stuck, 5)
        await asyncio.wait_for(room.enter(), 5)  # later ones too

    asyncio.run(run())


def test_a_role_with_none_in_rotation_is_let_through_to_selection() -> None:
    async def run() -> None:
        registry, (prefill,) = _fleet()
        room = PairRoom(registry, 1, 0, 60)
        prefill.took()
        assert room.short() == [Role.PREFILL]
        prefill.cordoned = "a test"
        assert room.short() == []  # selection's own wait for a worker (or its 503) applies
        await asyncio.wait_for(room.enter(), 5)

    asyncio.run(run())


@pytest.mark.parametrize("policy", ["consistent_hashing", "prefix_hash", "manual"])
def test_late_pairing_refuses_the_sticky_policies(policy) -> None:
    with pytest.raises(RouterConfigError, match=f"must be 0 with the {policy} policy"):
        RouterConfig(prefill_policy=policy, admission=AdmissionConfig(prefill_room=2))
    RouterConfig(policy="power_of_two", admission=AdmissionConfig(prefill_room=2, decode_room=16))


def test_a_request_is_woken_when_an_open_circuit_lets_its_prefill_back() -> None:
    """No leg ends and nothing comes into rotation: the end of the circuit's timeout is the only
    event (the request would otherwise wait for the busy prefill's long answer)."""

    async def run() -> None:
        registry, (busy, tripped) = _fleet(prefills=2)
        room = PairRoom(registry, 1, 0, 60)
        busy.took()
        tripped.cb_open_until = time.monotonic() + 0.2
        assert room.short() == [Role.PREFILL]
        await asyncio.wait_for(room.enter(), 10)
        assert room.short() == [] and tripped in registry.routable(Role.PREFILL)

    asyncio.run(run())
