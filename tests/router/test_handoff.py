"""A role switch's drain hands off what is only queued at its prefill (pdctl.router.legs
``Legs.hand_off``, ``POST /pdctl/cordon`` with ``handoff``): PD requests queued at a cordoned
prefill are taken back and sent to other pairs at once; every request is answered in full, the
engines are left with no request or reserved slot, and the cordon answers drained once what did
run there has finished. Without ``handoff`` the cordon waits for them (as a restart's does), and
a decode hands off nothing (its requests waiting for KV may be mid-prefill). Real sims, a real
router."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest

from pdctl.cluster.router_control import RouterControl
from tests.helpers import RouterProcess, eventually, get, http, pd_router_args, sims
from tests.router.test_overload import assert_idle, one

SLOW_PREFILL = ("--disaggregation-mode", "prefill", "--max-running-requests", "1", "--sim-prefill-ms-per-token", "10")
DECODE = ("--disaggregation-mode", "decode", "--max-running-requests", "8")
PROMPT = "hand off " * 3  # 27 characters: ~0.3 s of prefill each, one at a time per prefill
REQUESTS = 12


def _queued(engine) -> int:
    state = get(engine.url + "/server_info")[1]["internal_states"][0]
    return int(state["num_queue_reqs"])


def _retries(router: RouterProcess, reason: str) -> float:
    text = get(router.url + "/metrics")[1]
    for line in text.splitlines():
        if line.startswith(f'pdctl_router_retries_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def _load(router: RouterProcess, url: str, *, cordon: str, handoff: bool, busy) -> tuple[list[dict], dict]:
    """Send REQUESTS at once (streamed and not), cordon ``cordon`` once ``busy()`` holds, and
    return every answer and the router's answer to the cordon."""
    answers: list[dict] = []
    cordoned: dict = {}

    async def load() -> None:
        async with aiohttp.ClientSession() as session:
            sent = [one(session, router.url, PROMPT + str(i), i % 2 == 1, 4) for i in range(REQUESTS)]
            answers.extend(await asyncio.gather(*sent))

    runner = threading.Thread(target=lambda: asyncio.run(load()))
    runner.start()
    try:
        eventually(busy, 60, what="requests waiting at the engine to cordon")
        cordoned.update(RouterControl(router.url, None).cordon(cordon, True, reason="a test", handoff=handoff))
    finally:
        runner.join(120)
    assert not runner.is_alive(), "the load did not finish"
    return answers, cordoned


@pytest.mark.parametrize("handoff", [True, False], ids=["handoff", "wait"])
def test_a_cordoned_prefills_queue_goes_to_the_other_prefill(tmp_path, handoff) -> None:
    with sims(tmp_path, SLOW_PREFILL, SLOW_PREFILL, DECODE) as (p0, p1, d0):
        router = RouterProcess(tmp_path, *pd_router_args([p0, p1], [d0], "--policy", "round_robin")).start("/readiness")
        try:
            answers, cordoned = _load(router, router.url, cordon=p0.url, handoff=handoff, busy=lambda: _queued(p0) >= 3)
            assert all(a["ok"] for a in answers), [a for a in answers if not a["ok"]]
            assert cordoned["drained"] is True, cordoned
            handed = cordoned["handed_off"]
            assert (handed >= 3) if handoff else (handed == 0), cordoned
            assert _retries(router, "handed_off") == handed
            assert_idle([p0, p1, d0])
            status, answer = http("POST", router.url + "/pdctl/cordon", {"url": p0.url, "handoff": "yes"})
            assert status == 400 and "handoff must be true or false" in json.dumps(answer), answer
            RouterControl(router.url, None).cordon(p0.url, False)  # p0 still serves after its aborts
            eventually(lambda: get(router.url + "/workers")[1], 30)
        finally:
            router.stop()


def test_a_cordoned_decode_hands_off_nothing_and_its_requests_finish_there(tmp_path) -> None:
    with sims(tmp_path, SLOW_PREFILL, DECODE, DECODE) as (p0, d0, d1):
        router = RouterProcess(tmp_path, *pd_router_args([p0], [d0, d1], "--policy", "round_robin")).start("/readiness")
        try:
            answers, cordoned = _load(router, router.url, cordon=d0.url, handoff=True, busy=lambda: _queued(p0) >= 6)
            assert all(a["ok"] for a in answers), [a for a in answers if not a["ok"]]
            assert cordoned["drained"] is True and cordoned["handed_off"] == 0, cordoned
            assert _retries(router, "handed_off") == 0
            assert_idle([p0, d0, d1])
        finally:
            router.stop()
