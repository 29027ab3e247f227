"""Each leg's claim on its worker is settled once each way, however the attempt ends (issue 51):
its load is given back exactly once and its outcome reaches the circuit breaker at most once.

Hypothesis draws what each engine of a PD attempt does (answers, answers late, aborts, 4xx, 5xx,
503, fails, hangs, dies mid-stream), how the attempt is read (whole, whole with logprobs, streamed, streamed
with input logprobs) and when the client goes away; after the router's legs are closed, both
workers' loads are back at 0 and neither worker's breaker heard more than once from the attempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pdctl.roles import Role
from pdctl.router.config import RouterConfig
from pdctl.router.gate import RefitGate
from pdctl.router.legs import Legs, PairAttempt, StreamLeg
from pdctl.router.mock_upstream import MockReply, MockUpstream, UpstreamRequest
from pdctl.router.shaping import Headers
from pdctl.router.upstream import UpstreamError
from pdctl.router.workers import WorkerRegistry

PREFILL, DECODE = "http://127.0.0.2:1", "http://127.0.0.3:1"
ANSWER = {"text": "hi", "meta_info": {"finish_reason": {"type": "length"}, "input_token_logprobs": [[0.0, 1, None]]}}
ABORT = {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "aborted"}}}
BEHAVIOURS = ("answer", "late", "abort", "400", "500", "503", "fail", "hang", "dies_mid_stream")


def _reply(behaviour: str, stream: bool) -> MockReply:
    if behaviour == "answer" and stream:
        return MockReply(chunks=_events(die=False), content_type="text/event-stream")
    if behaviour == "dies_mid_stream":
        return MockReply(chunks=_events(die=True), content_type="text/event-stream")
    if behaviour == "abort":
        return MockReply(json=ABORT)
    if behaviour in ("400", "500", "503"):
        return MockReply(status=int(behaviour), json={"error": {"message": behaviour}})
    return MockReply(json=ANSWER)


async def _events(die: bool) -> AsyncIterator[bytes]:
    yield b'data: {"text": "h", "meta_info": {}}\n\n'
    await asyncio.sleep(0)
    if die:
        raise UpstreamError("the engine died mid-stream (test)")
    yield b'data: {"text": "hi", "meta_info": {"finish_reason": {"type": "length"}}}\n\ndata: [DONE]\n\n'


class _Reader:
    def __init__(self) -> None:
        self.ended = asyncio.get_running_loop().create_future()

    def block(self, block: bytes, end: bool) -> None:
        if end and not self.ended.done():
            self.ended.set_result(None)

    def broke(self, error: BaseException) -> None:
        if not self.ended.done():
            self.ended.set_result(None)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefill=st.sampled_from(BEHAVIOURS),
    decode=st.sampled_from(BEHAVIOURS),
    shape=st.sampled_from(("whole", "whole_logprobs", "stream", "stream_logprobs")),
    client_leaves_after=st.one_of(st.none(), st.integers(0, 6)),
)
def test_every_leg_settles_its_load_once_and_its_outcome_at_most_once(
    prefill: str, decode: str, shape: str, client_leaves_after: int | None
) -> None:
    assume(client_leaves_after is not None or "hang" not in (prefill, decode))  # (else: the request timeout)

    async def engines(request: UpstreamRequest) -> MockReply:
        behaviour = prefill if request.base == PREFILL else decode
        await asyncio.sleep(0)
        if behaviour == "fail":
            raise UpstreamError("connection reset (test)")
        if behaviour == "hang":
            await asyncio.Event().wait()
        if behaviour == "late":  # answers after the other leg
            for _ in range(4):
                await asyncio.sleep(0)
        return _reply(behaviour, request.stream and request.base == DECODE)

    async def scenario() -> tuple[dict[str, int], dict[str, int]]:
        registry = WorkerRegistry(RouterConfig())
        registry.add(PREFILL, Role.PREFILL, 8998)
        registry.add(DECODE, Role.DECODE)
        heard = {PREFILL: 0, DECODE: 0}
        legs = Legs(MockUpstream(engines), registry, RefitGate(), 30)
        record = legs.breaker.record

        def counted(worker, ok, answered=False):  # type: ignore[no-untyped-def]
            heard[worker.url] += 1
            record(worker, ok, answered)

        legs.breaker.record = counted  # type: ignore[method-assign]
        workers = registry.workers

        async def attempt() -> None:  # (made in the request's task, as the attempt loop makes it)
            pair = PairAttempt(legs, workers[PREFILL], workers[DECODE], "/generate", b"{}", Headers({}, {}))
            if shape.startswith("whole"):
                await pair.whole(shape == "whole_logprobs")
                return
            try:
                opened = await pair.open()
                if not isinstance(opened, StreamLeg):
                    return
                if shape == "stream_logprobs":
                    await pair.input_logprobs()
                reader = _Reader()
                opened.attach(reader)
                await reader.ended
                pair.keep_prefill()  # the stream ended: the prefill may finish on its own
                opened.cancel()
            finally:
                pair.close()

        task = asyncio.ensure_future(attempt())
        if client_leaves_after is not None:
            for _ in range(client_leaves_after):
                await asyncio.sleep(0)
            task.cancel()  # the client went away
        await asyncio.wait({task})
        for url, behaviour in ((PREFILL, prefill), (DECODE, decode)):  # legs still running answer first
            worker = workers[url]
            worker.drained = asyncio.Event()
            if worker.load and behaviour != "hang":
                await asyncio.wait_for(worker.drained.wait(), 30)  # (bounds a leak: fails, not hangs)
        await legs.close()  # (a kept prefill still in its grace is cancelled)
        loads = {url: w.load for url, w in registry.workers.items()}
        return loads, heard

    loads, heard = asyncio.run(scenario())
    assert loads == {PREFILL: 0, DECODE: 0}, (loads, prefill, decode, shape)
    assert max(heard.values()) <= 1, (heard, prefill, decode, shape)
