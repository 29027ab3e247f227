"""Late pairing (``--pd-prefill-room``, pdctl.router.pair_room): PD requests past a prefill's
room wait in the router and are paired when it has room, with the decodes of that moment, so a
decode added mid-burst serves part of the burst; paired on arrival (the default, as
sglang-router does), it serves none of it. A client that leaves the queue is not sent, and every
other request is answered in full. Real sims, a real router."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest

from pdctl.cluster.router_control import RouterControl
from pdctl.roles import Role
from tests.helpers import RouterProcess, eventually, get, pd_router_args, sims
from tests.router.test_overload import assert_idle, one

SLOW_PREFILL = ("--disaggregation-mode", "prefill", "--max-running-requests", "1", "--sim-prefill-ms-per-token", "10")
DECODE = ("--disaggregation-mode", "decode", "--max-running-requests", "8")
PROMPT = "late pair " * 3  # 30 characters: ~0.3 s of prefill each, one at a time
REQUESTS = 10


def _metric(url: str, name: str) -> float:
    """The sum of ``name``'s samples at ``url``/metrics (0 when it has none)."""
    total = 0.0
    for line in get(url + "/metrics")[1].splitlines():
        if line.startswith(name) and line[len(name)] in " {,":
            total += float(line.split()[-1])
    return total


def _picks(router: RouterProcess, engine) -> float:
    """How many requests the router sent to ``engine`` (its own count: an engine's counts its health checks too)."""
    return _metric(router.url, f'pdctl_router_worker_selection_total{{worker="{engine.url}"')


def _queued(engine) -> int:
    return int(get(engine.url + "/server_info")[1]["internal_states"][0]["num_queue_reqs"])


@pytest.mark.parametrize("room", [1, 0], ids=["late", "on-arrival"])
def test_a_decode_added_mid_burst_serves_part_of_it_only_when_pairing_late(tmp_path, room) -> None:
    with sims(tmp_path, SLOW_PREFILL, DECODE, DECODE) as (p0, d0, d1):
        extra = ["--policy", "round_robin", "--pd-prefill-room", str(room)]
        router = RouterProcess(tmp_path, *pd_router_args([p0], [d0], *extra)).start("/readiness")
        answers: list[dict] = []

        async def load() -> None:
            async with aiohttp.ClientSession() as session:
                sent = [one(session, router.url, PROMPT + str(i), i % 2 == 1, 4) for i in range(REQUESTS)]
                answers.extend(await asyncio.gather(*sent))

        runner = threading.Thread(target=lambda: asyncio.run(load()))
        runner.start()
        try:
            if room:  # the burst waits in the router, not at the prefill
                eventually(lambda: _metric(router.url, "pdctl_router_pd_waiting_for_room") >= 6, 60, what="a queue")
                assert _queued(p0) == 0
                assert _metric(router.url, 'pdctl_router_pd_room_short{role="prefill"}') == 1
            else:
                eventually(lambda: _queued(p0) >= 6, 60, what="the burst queued at the prefill")
            RouterControl(router.url, None).add(d1.url, Role.DECODE, None)
        finally:
            runner.join(120)
        try:
            assert not runner.is_alive(), "the load did not finish"
            assert len(answers) == REQUESTS and all(a["ok"] for a in answers), [a for a in answers if not a["ok"]]
            served_late = _picks(router, d1)
            assert (served_late >= 1) if room else (served_late == 0), served_late
            assert _picks(router, d0) + served_late == REQUESTS
            assert _metric(router.url, "pdctl_router_pd_waiting_for_room") == 0
            assert_idle([p0, d0, d1])
        finally:
            router.stop()


def test_a_client_that_leaves_the_queue_is_not_sent(tmp_path) -> None:
    with sims(tmp_path, SLOW_PREFILL, DECODE) as (p0, d0):
        extra = ["--policy", "round_robin", "--pd-prefill-room", "1"]
        router = RouterProcess(tmp_path, *pd_router_args([p0], [d0], *extra)).start("/readiness")
        try:

            async def load() -> list[dict]:
                async with aiohttp.ClientSession() as session:
                    kept = [
                        asyncio.ensure_future(one(session, router.url, PROMPT + str(i), False, 4)) for i in range(4)
                    ]
                    async with aiohttp.ClientSession() as leaving:  # these clients hang up while queued
                        gone = [
                            asyncio.ensure_future(one(leaving, router.url, "gone" + str(i), False, 4)) for i in range(4)
                        ]
                        await asyncio.to_thread(
                            eventually, lambda: _metric(router.url, "pdctl_router_pd_waiting_for_room") >= 6, 60
                        )
                        for task in gone:
                            task.cancel()
                        await asyncio.gather(*gone, return_exceptions=True)
                    return await asyncio.gather(*kept)

            answers = asyncio.run(load())
            assert all(a["ok"] for a in answers), answers
            eventually(lambda: _metric(router.url, "pdctl_router_pd_waiting_for_room") == 0, 30)
            served = _picks(router, d0)
            assert 4 <= served < 8, served  # the kept four, and none of the queued ones that left
            assert_idle([p0, d0])
        finally:
            router.stop()
