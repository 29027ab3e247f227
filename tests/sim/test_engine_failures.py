"""The sim's scheduler under failure (hardening issue): a request that breaks while it starts
ends alone with a 500; a batched step that breaks ends every request with a 500, refuses new
ones and reports itself fatal (the server then exits for its supervisor to restart it) instead
of leaving a deaf engine; aborting a large queue is one pass. In-process: a real Engine on a
real (tiny) model, waiting on the requests' own completion events."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from pdctl.sim.engine import Engine, Request
from pdctl.sim.model import PRESETS, TinyLM
from pdctl.sim.sampling import SamplingOptions


class Done:
    """Requests' completion, observed through their emit callback."""

    def __init__(self) -> None:
        self.events: dict[str, threading.Event] = {}

    def request(self, rid: str, ids: list[int], max_new_tokens: int = 4) -> Request:
        event = self.events[rid] = threading.Event()

        def emit(req: Request) -> None:
            if req.finished:
                event.set()

        return Request(rid=rid, input_ids=ids, sampling=SamplingOptions(max_new_tokens=max_new_tokens), emit=emit)

    def wait(self, *rids: str) -> None:
        for rid in rids:
            assert self.events[rid].wait(60), f"{rid} never finished"


@pytest.fixture
def engine():
    model = TinyLM(replace(PRESETS["tiny"], seed=1))
    eng = Engine(model, max_running=8)
    fatal: list[str] = []
    eng.on_fatal = fatal.append
    eng.fatal_calls = fatal  # type: ignore[attr-defined]
    eng.start()
    try:
        yield eng
    finally:
        eng.stop()


def test_a_request_that_breaks_while_starting_ends_alone(engine, monkeypatch) -> None:
    real = engine.model.prefill

    def prefill(ids):
        if 7 in ids:
            raise IndexError("index out of range in self (test)")
        return real(ids)

    monkeypatch.setattr(engine.model, "prefill", prefill)
    done = Done()
    bad, good = done.request("bad", [1, 7, 2]), done.request("good", [1, 2, 3])
    engine.submit(bad)
    engine.submit(good)
    done.wait("bad", "good")
    assert bad.finish["type"] == "abort" and bad.finish["status_code"] == 500, bad.finish
    assert "IndexError" in bad.finish["message"]
    assert good.finish["type"] == "length" and len(good.output_ids) == 4
    assert engine.fatal is None and engine.fatal_calls == []


def test_a_broken_step_ends_every_request_and_the_engine(engine, monkeypatch) -> None:
    def broken(*_args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (test)")

    monkeypatch.setattr(engine.model, "decode_step", broken)
    done = Done()
    reqs = [done.request(f"r{i}", [1, 2, 3 + i], max_new_tokens=8) for i in range(3)]
    for req in reqs:
        engine.submit(req)
    done.wait(*(r.rid for r in reqs))
    for req in reqs:
        assert req.finish["type"] == "abort" and req.finish["status_code"] == 500, req.finish
        assert "the engine failed" in req.finish["message"]
    assert engine.fatal and "RuntimeError" in engine.fatal
    assert engine.fatal_calls == [engine.fatal], "on_fatal is called once, with the reason"
    late = done.request("late", [1, 2])
    engine.submit(late)  # refused at once: nothing would ever run it
    done.wait("late")
    assert late.finish["status_code"] == 500 and "the engine failed" in late.finish["message"]


def test_aborting_a_large_queue_is_one_pass_and_keeps_the_books(engine) -> None:
    engine.pause("in_place")  # nothing is admitted: everything stays queued
    done = Done()
    queued = [done.request(f"q{i}", [1, 2]) for i in range(50_000)]
    for req in queued:
        engine.submit(req)
    assert engine.stats()["num_queue_reqs"] == 50_000
    assert engine.abort_requests(queued[:10], "client disconnected") == 10
    assert engine.stats()["num_queue_reqs"] == 49_990, "aborted requests leave the queue count at once"
    assert engine.abort_requests(queued, "client disconnected") == 49_990
    assert engine.stats()["num_queue_reqs"] == 0
    assert all(r.finish and r.finish["type"] == "abort" for r in queued)
    engine.resume()
    after = done.request("after", [1, 2, 3])
    engine.submit(after)
    done.wait("after")
    assert after.finish["type"] == "length", "the engine serves on"


def test_a_server_whose_scheduler_fails_answers_500_and_fails_for_its_supervisor(monkeypatch) -> None:
    """The whole server in-process: the failed step's request is answered 500, /health says 503
    and the server's ``failed`` event fires (``python -m pdctl.sim`` then exits 1)."""
    import asyncio

    import aiohttp

    from pdctl.sim.__main__ import config_from_argv
    from pdctl.sim.server import SimServer

    async def scenario() -> tuple[int, dict, int]:
        server = SimServer(config_from_argv(["--model-path", "sim://tiny", "--port", "0", "--skip-server-warmup"]))
        await server.start()
        try:

            def broken(*_args):
                raise RuntimeError("NCCL error: unhandled system error (test)")

            assert server._engine is not None
            monkeypatch.setattr(server._engine.model, "decode_step", broken)
            body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
            async with aiohttp.ClientSession() as http:
                async with http.post(server.url + "/generate", json=body) as resp:
                    status, answer = resp.status, await resp.json(content_type=None)
                await asyncio.wait_for(server.failed.wait(), 60)
                async with http.get(server.url + "/health") as resp:
                    health = resp.status
            return status, answer, health
        finally:
            await server.stop()

    status, answer, health = asyncio.run(scenario())
    assert status == 500 and "the engine failed" in str(answer), answer
    assert health == 503
