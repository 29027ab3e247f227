"""The router tells the truth about what it can serve, and a weight update that moved nothing never
takes the fleet down (day 2 under fire): readiness from the workers in rotation, a hold whose
driver went away before its answer, a lease that runs out before any weights moved. In-process:
a real RouterServer over the toy engines of tests/router/mock_fleet.py."""

from __future__ import annotations

import asyncio
import contextlib

from pdctl.refit import Hold, Release
from pdctl.router.mock_upstream import MockReply
from tests.helpers import eventually_async
from tests.router.mock_fleet import D1, P1, Engines, Run, continuation, output, run


async def ready(r: Run) -> tuple[int, dict]:
    async with r.client.get(r.server.url + "/readiness") as resp:
        return resp.status, await resp.json()


async def health_generate(r: Run) -> int:
    async with r.client.get(r.server.url + "/health_generate") as resp:
        return resp.status


async def control(r: Run, path: str, body: dict) -> tuple[int, dict]:
    async with r.client.post(r.server.url + path, json=body) as resp:
        return resp.status, await resp.json()


def test_readiness_and_health_generate_say_whether_each_role_can_be_served():
    async def scenario(r: Run):
        assert (await ready(r))[0] == 200 and await health_generate(r) == 200
        # The only decode cordoned (an interrupted restart left it so): nothing can be served.
        status, _ = await control(r, "/pdctl/cordon", {"url": D1, "cordon": True, "timeout_secs": 0})
        assert status == 200
        status, body = await ready(r)
        assert status == 503 and body["reason"] == "no decode worker in rotation" and body["healthy_workers"] == 1
        assert await health_generate(r) == 503
        await control(r, "/pdctl/cordon", {"url": D1, "cordon": False})
        assert (await ready(r))[0] == 200
        # Every engine quarantined (a push that stopped half way): not ready either.
        r.server.registry.set_quarantine(P1, "weight push t stopped half way")
        status, body = await ready(r)
        assert status == 503 and body["reason"] == "no prefill worker in rotation", body
        r.server.registry.set_quarantine(P1, None)
        # A prefill and a decode on different weight versions cannot be paired.
        r.server.registry.workers[P1].weight_version = "v2"
        status, body = await ready(r)
        assert status == 503 and "one weight version" in body["reason"], body

    run(Engines(), scenario)


def test_a_hold_whose_driver_left_before_its_answer_lets_requests_in_at_once():
    """Ctrl-C on `pdctl weights load` while the router drains for it: the hold's client goes
    away, and the router admits requests again at once (no lease to wait out, nothing quarantined)."""
    release = asyncio.Event()

    async def slow(engines, request, body):  # a long request in flight: the drain waits for it
        await engines.room(body)
        await release.wait()
        return MockReply(json=output(body, continuation(body["text"], 8), True))

    async def scenario(r: Run):
        long = asyncio.ensure_future(r.generate())
        await eventually_async(
            lambda: any(w.load for w in r.server.registry.workers.values()), interval=0.01, what="a request in flight"
        )
        hold = Hold(txn="loader", engines=(P1, D1), lease_secs=30, timeout_secs=60)
        draining = asyncio.ensure_future(control(r, "/pdctl/hold", hold.to_json()))
        await eventually_async(lambda: not r.server.gate.is_open, interval=0.01, what="the hold closing the gate")
        draining.cancel()  # its client goes away
        with contextlib.suppress(asyncio.CancelledError):
            await draining
        # opened by the router at once, not after the 30 s lease
        await eventually_async(lambda: r.server.gate.is_open, 20, interval=0.01, what="the gate open again")
        assert r.server.updates.holder is None
        assert r.server.updates.last is not None and r.server.updates.last.state.value.startswith("cancelled")
        assert not any(w.quarantined for w in r.server.registry.workers.values())
        release.set()
        assert (await long)[0] == 200

    run(Engines(D1=slow), scenario)


def test_a_lease_that_runs_out_before_weights_moved_quarantines_nothing_and_after_it_does():
    async def scenario(r: Run):
        urls = (P1, D1)
        # No weights moved: the transaction just ends.
        assert (await control(r, "/pdctl/hold", Hold(txn="t1", engines=urls, lease_secs=0.2).to_json()))[0] == 200
        await eventually_async(lambda: r.server.updates.holder is None, interval=0.02, what="the lease running out")
        assert r.server.gate.is_open
        assert not any(w.quarantined for w in r.server.registry.workers.values())
        assert r.server.updates.last is not None and r.server.updates.last.state.value == "cancelled (no weights moved)"
        # Weights moved (a renewal says so), then the driver went silent: its engines may be half updated.
        hold = Hold(txn="t2", engines=urls, lease_secs=0.2)
        assert (await control(r, "/pdctl/hold", hold.to_json()))[0] == 200
        assert (await control(r, "/pdctl/hold", hold.renewal(moved=True).to_json()))[0] == 200
        await eventually_async(lambda: r.server.updates.holder is None, interval=0.02, what="the lease running out")
        assert all(w.quarantined for w in r.server.registry.workers.values())
        assert r.server.updates.last.state.value == "abandoned (lease expired)"
        # An interrupted transaction's own release that says nothing moved leaves rotation alone.
        for url in urls:
            r.server.registry.set_quarantine(url, None)
        assert (await control(r, "/pdctl/hold", Hold(txn="t3", engines=urls).to_json()))[0] == 200
        status, _ = await control(r, "/pdctl/release", Release(txn="t3", moved=False).to_json())
        assert status == 200 and not any(w.quarantined for w in r.server.registry.workers.values())
        assert r.server.updates.last.state.value == "cancelled (no weights moved)"

    run(Engines(), scenario)
