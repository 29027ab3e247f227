"""The refit gate's rules in-process (the MockUpstream fleet of tests/router/mock_fleet.py): the failure
rules hold after interrupts have happened, a drain is not blocked by retries, and a request
stopped before its first token is not stale."""

from __future__ import annotations

import asyncio

import pytest

from pdctl.router import gate
from pdctl.router.app import RouterServer
from pdctl.router.mock_upstream import MockReply
from tests.helpers import eventually_async
from tests.router import mock_fleet
from tests.router.mock_fleet import Engines, decode_ok, run


@pytest.fixture
def after_an_interrupt(monkeypatch):
    """Every router the rules make (mock_fleet.run) starts as after an earlier interrupt transaction
    (epoch 1, released), set on each router's own gate."""
    made: list[RouterServer] = []

    def at_epoch_1(*args, **kwargs) -> RouterServer:
        server = RouterServer(*args, **kwargs)
        server.gate.epoch = 1
        made.append(server)
        return server

    monkeypatch.setattr(mock_fleet, "RouterServer", at_epoch_1)
    yield
    assert made and all(server.dispatcher.gate is server.gate for server in made), "no router at epoch 1"


@pytest.mark.parametrize(
    "rule",
    [
        lambda: mock_fleet.check_a_decode_that_fails_after_its_prefill_answered_takes_the_blame(True),
        lambda: mock_fleet.check_a_decode_that_fails_after_its_prefill_answered_takes_the_blame(False),
        lambda: mock_fleet.check_a_decode_that_never_answers_is_a_504_and_not_retried(True),
        lambda: mock_fleet.check_a_decode_that_lost_its_prefill_blames_the_prefill_not_itself(True),
        lambda: mock_fleet.check_a_decode_that_lost_its_prefill_blames_the_prefill_not_itself(False),
        mock_fleet.check_a_streamed_server_abort_is_retried_and_a_client_abort_is_the_answer,
    ],
)
def test_the_failure_rules_hold_after_an_interrupt(after_an_interrupt, rule) -> None:
    """A failure of a leg sent after the last interrupt is the worker's, as before any interrupt."""
    rule()


async def _until(condition) -> None:
    await eventually_async(condition)


def test_a_retry_during_a_drain_goes_on_and_the_drain_completes() -> None:
    """A request retrying backpressure when a drain hold comes is not held at the gate: the
    drain waits for it, so holding it would deadlock the two."""
    go = asyncio.Event()
    calls = []

    async def busy_once(engines, request, body):
        calls.append(body)
        if len(calls) == 1:
            await go.wait()
            return MockReply(status=503, json={"error": {"message": "no free KV slot", "code": 503}})
        return await decode_ok(engines, request, body)

    async def scenario(r):
        generate = asyncio.create_task(r.generate())
        await _until(lambda: calls)
        hold = asyncio.create_task(r.client.post(r.server.url + "/pdctl/hold", json={"timeout_secs": 10}))
        await _until(lambda: not r.server.gate.is_open)
        go.set()
        async with await hold as resp:
            held = resp.status, await resp.json()
        answer = await generate
        async with r.client.post(r.server.url + "/pdctl/release", json={}) as resp:
            assert resp.status == 200
        return held, answer

    (status, held), (answer_status, _) = run(Engines(D1=busy_once), scenario)
    assert status == 200 and held["drained"] is True and answer_status == 200


def test_a_request_stopped_before_its_first_token_is_continued_even_at_max_staleness_zero() -> None:
    go = asyncio.Event()
    calls = []

    async def aborted_in_queue(engines, request, body):
        calls.append(body)
        if len(calls) > 1:
            return await decode_ok(engines, request, body)
        await engines.room(body)
        await go.wait()
        meta = {"id": "r", "completion_tokens": 0, "weight_version": "A", "prompt_tokens": 3}
        meta["finish_reason"] = {"type": "abort", "message": "Aborted", "status_code": None}
        meta["weight_versions"] = [{"version": "A", "start": 0, "end": 0}]
        return MockReply(json={"text": "", "output_ids": [], "meta_info": meta})

    async def scenario(r):
        generate = asyncio.create_task(r.generate(tokens=5))
        await _until(lambda: calls)
        async with r.client.post(r.server.url + "/pdctl/hold", json={"refit": "interrupt", "max_staleness": 0}):
            pass
        go.set()  # the release may come before or after the abort reaches the router: either is an interrupt
        async with r.client.post(r.server.url + "/pdctl/release", json={}):
            pass
        return await generate

    status, answer = run(Engines(D1=aborted_in_queue), scenario)
    assert status == 200 and answer["meta_info"]["finish_reason"]["type"] == "length", answer
    assert len(calls) == 2 and answer["meta_info"]["pdctl_interruptions"] == 1


def test_a_waiter_woken_by_a_release_waits_on_when_the_next_hold_closed_the_gate_first() -> None:
    """Updates back to back: a release wakes the held requests, and the next update's hold can
    close the gate before they run. They must wait for that update too (its engines abort what
    they are sent, at the new epoch: the client would get the abort as its own)."""
    from pdctl.refit import RefitMode

    async def main() -> None:
        g = gate.RefitGate()
        g.close(RefitMode.INTERRUPT, 1, new_transaction=True)
        waiter = asyncio.ensure_future(g.wait_open(60))
        # until it waits on the event itself
        await eventually_async(lambda: g._open._waiters, what="the waiter on the gate's event")  # type: ignore[attr-defined]
        g.open()
        g.close(RefitMode.INTERRUPT, 1, new_transaction=True)  # the next update, before the waiter ran
        for _ in range(3):
            await asyncio.sleep(0)
        assert not waiter.done(), "a woken waiter went on while the next update held the gate"
        g.open()
        assert await waiter is True
        g.close(RefitMode.INTERRUPT, 1, new_transaction=True)
        assert await g.wait_open(0.01) is False  # (still bounded by its timeout)

    asyncio.run(main())
