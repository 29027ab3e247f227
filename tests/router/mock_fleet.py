"""The toy PD fleet the router's in-process tests share (test_failure_rules, test_refit_rules,
test_holds, test_dispatcher): a MockUpstream of toy engines that follow SGLang's PD protocol as
far as those tests need, a real RouterServer over it (``run``), and the failure rules that
test_refit_rules checks again after an interrupt.

A prefill answers and hands its KV over by bootstrap room; a decode waits for its room's KV, then
answers; a streamed decode sends its head at once (SGLang's StreamingResponse does, before the
request reaches the scheduler) and its first event once the KV came.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp

from pdctl.roles import Role
from pdctl.router.app import RouterServer
from pdctl.router.config import AdmissionConfig, BreakerConfig, HealthConfig, RetryConfig, RouterConfig, WorkerSpec
from pdctl.router.mock_upstream import MockReply, MockUpstream, UpstreamRequest
from pdctl.router.upstream import UpstreamError

# Loopback addresses where nothing listens: the router's one health round at start-up is
# refused at once (health checks are disabled, so the workers stay in rotation).
P1, P2 = "http://127.0.0.2:1", "http://127.0.0.3:1"
D1, D2 = "http://127.0.0.4:1", "http://127.0.0.5:1"
PROMPT = "The quick brown fox"
Behaviour = Callable[["Engines", UpstreamRequest, dict], Awaitable[MockReply]]


def continuation(prompt: str, n: int) -> str:
    """What the toy model generates: the same letters for the same prompt (greedy)."""
    return "".join(chr(97 + (len(prompt) + i) % 26) for i in range(n))


def tokens_wanted(body: dict) -> int:
    """The request's max_new_tokens (8 when it names none)."""
    return int(body.get("sampling_params", {}).get("max_new_tokens", 8))


def output(body: dict, text: str, finished: bool, *, logprobs: bool = False) -> dict:
    """An SGLang /generate output for ``body`` that has generated ``text`` so far."""
    meta: dict[str, Any] = {
        "id": "rid-1",
        "prompt_tokens": len(body["text"]),
        "completion_tokens": len(text),
        "finish_reason": {"type": "length", "length": len(text)} if finished else None,
    }
    if logprobs:
        meta["input_token_logprobs"] = [[-1.0, i, None] for i in range(len(body["text"]))]
    return {"text": text, "output_ids": [ord(c) for c in text], "meta_info": meta}


def sse(*events: Any) -> bytes:
    """``events`` as server-sent data events, then ``data: [DONE]``."""
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


class Engines:
    """The toy fleet behind a MockUpstream: a behaviour per worker URL, and what happened."""

    def __init__(self, **behaviours: Behaviour):
        self.behaviours = {globals()[name]: fn for name, fn in behaviours.items()}  # P1=..., D2=...
        self.kv: dict[int, asyncio.Future[bool]] = {}
        self.abandoned: list[str] = []  # workers whose request the router gave up on
        self.mock = MockUpstream(self.handle)

    def room(self, body: dict) -> asyncio.Future[bool]:
        return self.kv.setdefault(body["bootstrap_room"], asyncio.get_running_loop().create_future())

    async def handle(self, request: UpstreamRequest) -> MockReply:
        body = request.json()
        default = prefill_ok if request.base in (P1, P2) else decode_ok
        try:
            return await self.behaviours.get(request.base, default)(self, request, body)
        except asyncio.CancelledError:
            self.abandoned.append(request.base)
            raise

    def bodies(self, base: str) -> list[dict]:
        return [r.json() for r in self.mock.requests if r.base == base]

    def mock_streams(self) -> list:
        """The streamed answers the mock is feeding now (mock_upstream._Stream: ``reading`` is
        cleared while the router holds the stream back)."""
        return [s for s in self.mock.streams if not s.task.done()]


async def prefill_ok(engines: Engines, request: UpstreamRequest, body: dict) -> MockReply:
    """A prefill that answers and hands its room's KV over to the decode."""
    answer = output(body, "", True, logprobs=bool(body.get("return_logprob")))
    engines.room(body).set_result(True)  # the KV is on its way to the decode
    return MockReply(body=sse(answer)) if body.get("stream") else MockReply(json=answer)


def decode_stream(engines: Engines, base: str, body: dict, *, die_after: int | None = None) -> AsyncIterator[bytes]:
    """A decode's event stream once its room's KV came (the connection dies after ``die_after`` events)."""

    async def events() -> AsyncIterator[bytes]:
        try:
            await engines.room(body)  # no event before the KV
            text = continuation(body["text"], tokens_wanted(body))
            for i in range(1, len(text) + 1):
                if die_after is not None and i > die_after:
                    raise UpstreamError("connection reset by peer")
                yield sse(output(body, text[:i], i == len(text)))[: -len(b"data: [DONE]\n\n")]
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            engines.abandoned.append(base)
            raise

    return events()


async def decode_ok(engines: Engines, request: UpstreamRequest, body: dict) -> MockReply:
    """A decode that waits for its room's KV, then answers (streamed when asked)."""
    if body.get("stream"):
        return MockReply(chunks=decode_stream(engines, request.base, body), content_type="text/event-stream")
    await engines.room(body)
    return MockReply(json=output(body, continuation(body["text"], tokens_wanted(body)), True))


async def answers(status: int, error: str) -> MockReply:
    """An error answer: ``status`` with SGLang's error body."""
    return MockReply(status=status, json={"error": {"message": error, "code": status}})


def config(prefills: tuple[str, ...], decodes: tuple[str, ...], **groups: Any) -> RouterConfig:
    """A PD router's config over these workers (health checks off, quick retries); ``groups`` override."""
    workers = [WorkerSpec(url=p, role=Role.PREFILL, bootstrap_port=8998) for p in prefills]
    workers += [WorkerSpec(url=d, role=Role.DECODE) for d in decodes]
    groups.setdefault("breaker", BreakerConfig(failure_threshold=1, timeout_duration_secs=600))
    groups.setdefault("retry", RetryConfig(initial_backoff_ms=1, max_backoff_ms=20))
    # no wait for a worker to come back: nothing brings one back here (tests/router/test_dispatcher.py has the wait)
    groups.setdefault("admission", AdmissionConfig(request_timeout_secs=30, worker_wait_secs=0))
    return RouterConfig(
        host="127.0.0.1",
        port=0,
        pd_disaggregation=True,
        workers=tuple(workers),
        policy="round_robin",
        health=HealthConfig(disabled=True),
        **groups,
    )


class Run:
    """One router over ``engines``, a client, and what the test reads back."""

    def __init__(self, server: RouterServer, engines: Engines, client: aiohttp.ClientSession):
        self.server, self.engines, self.client = server, engines, client

    async def generate(self, *, stream: bool = False, tokens: int = 8, **extra: Any) -> tuple[int, Any]:
        """(status, JSON body) or, streamed, (status, the data events: dicts and "[DONE]")."""
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}, "stream": stream}
        async with self.client.post(self.server.url + "/generate", json={**body, **extra}) as resp:
            raw = await resp.read()
        if not stream or resp.status != 200:
            return resp.status, json.loads(raw)
        events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
        return resp.status, [e if e == "[DONE]" else json.loads(e) for e in events]

    def circuit_open(self, url: str) -> bool:
        return bool(self.server.registry.workers[url].to_dict()["circuit_open"])


def run(engines: Engines, scenario: Callable[[Run], Awaitable[Any]], prefills=(P1,), decodes=(D1,), **groups):
    """Run ``scenario`` against a real RouterServer over ``engines``; check every worker's load
    returns to zero, and return what the scenario returned."""

    async def main() -> Any:
        async with (
            RouterServer(config(prefills, decodes, **groups), upstream=engines.mock) as server,
            aiohttp.ClientSession() as client,
        ):
            result = await scenario(Run(server, engines, client))
            workers = server.registry.workers.values()
            for _ in range(500):  # legs the reply did not wait for end on their own
                if all(w.load == 0 for w in workers):
                    break
                await asyncio.sleep(0.01)
            assert {w.url: w.load for w in workers} == {w.url: 0 for w in workers}
            return result

    return asyncio.run(main())


def text_of(stream: bool, answer: Any) -> str:
    """The generated text of a /generate answer (streamed: its last event, checked for errors)."""
    if not stream:
        return answer["text"]
    assert answer[-1] == "[DONE]" and not any("error" in e for e in answer[:-1]), answer
    return answer[-2]["text"]


def aborted(body: dict, message: str, status: int) -> MockReply:
    """A streamed request SGLang 0.5.23 aborts: a 200 head, then one output whose finish_reason is
    the abort with its status code (``_handle_abort_finish_reason`` yields it for streams), then
    [DONE]."""
    out = output(body, "", True)
    out["meta_info"]["finish_reason"] = {"type": "abort", "message": message, "status_code": status, "err_type": None}
    return MockReply(body=sse(out), content_type="text/event-stream")


# The failure rules test_failure_rules checks, and test_refit_rules checks again after an interrupt.


def check_a_decode_that_fails_after_its_prefill_answered_takes_the_blame(stream: bool) -> None:
    """Check that a decode failing after its prefill answered is retried elsewhere and blamed, not the prefill."""

    async def broken(engines, request, body):
        await engines.room(body)
        if stream:  # the head went out at once; the connection dies before the first event
            return MockReply(chunks=decode_stream(engines, request.base, body, die_after=0))
        return await answers(500, "decode broke")

    async def scenario(r: Run):
        status, answer = await r.generate(stream=stream)
        assert status == 200 and text_of(stream, answer) == continuation(PROMPT, 8)
        assert r.circuit_open(D1) and not r.circuit_open(P1)

    run(Engines(D1=broken), scenario, decodes=(D1, D2))


def check_a_decode_that_never_answers_is_a_504_and_not_retried(stream: bool) -> None:
    """Check that a decode that never answers ends the request in a 504 after one try."""

    async def silent(engines, request, body):
        if stream:  # a head at once, then no event (as a stuck SGLang decode)
            forever = asyncio.get_running_loop().create_future()

            async def nothing() -> AsyncIterator[bytes]:
                await forever
                yield b""

            return MockReply(chunks=nothing(), content_type="text/event-stream")
        await asyncio.get_running_loop().create_future()
        raise AssertionError("unreachable")

    async def scenario(r: Run):
        status, answer = await r.generate(stream=stream)
        assert status == 504, answer
        assert len(r.engines.bodies(D1)) == 1  # another try would wait as long again

    run(Engines(D1=silent), scenario, decodes=(D1, D2), admission=AdmissionConfig(request_timeout_secs=0.5))


def check_a_decode_that_lost_its_prefill_blames_the_prefill_not_itself(stream: bool) -> None:
    """Check that a decode's "Lost connection with prefill instance" retries on the other prefill and blames P1."""

    async def loses_p1(engines: Engines, request: UpstreamRequest, body: dict) -> MockReply:
        if body["bootstrap_host"] == "127.0.0.2":  # P1's rooms
            message = "Lost connection with prefill instance (bootstrap_addr: 127.0.0.2:8998)"
            return aborted(body, message, 500) if stream else await answers(500, message)
        return await decode_ok(engines, request, body)

    engines = Engines(D1=loses_p1)

    async def scenario(r: Run) -> tuple[int, Any, bool, bool]:
        status, body = await r.generate(stream=stream)
        return status, body, r.circuit_open(P1), r.circuit_open(D1)

    status, body, p1_open, d1_open = run(engines, scenario, prefills=(P1, P2))
    assert status == 200 and text_of(stream, body) == continuation(PROMPT, 8)
    assert p1_open and not d1_open


def check_a_streamed_server_abort_is_retried_and_a_client_abort_is_the_answer() -> None:
    """Check that a streamed 5xx abort is retried on another pair and a streamed 4xx abort is passed on."""

    async def fails(engines: Engines, request: UpstreamRequest, body: dict) -> MockReply:
        await engines.room(body)
        return aborted(body, "CUDA out of memory", 500)

    async def refuses(engines: Engines, request: UpstreamRequest, body: dict) -> MockReply:
        await engines.room(body)
        return aborted(body, "input is longer than the context", 400)

    async def retried(r: Run) -> None:
        status, events = await r.generate(stream=True)
        assert status == 200 and text_of(True, events) == continuation(PROMPT, 8)
        assert r.circuit_open(D1) and not r.circuit_open(D2) and not r.circuit_open(P1)

    run(Engines(D1=fails), retried, decodes=(D1, D2))

    async def answered(r: Run) -> None:
        status, events = await r.generate(stream=True)
        assert status == 200 and events[0]["meta_info"]["finish_reason"]["status_code"] == 400
        assert events[1:] == ["[DONE]"]
        assert len(r.engines.bodies(D1)) + len(r.engines.bodies(D2)) == 1  # not retried
        assert not r.circuit_open(D1) and not r.circuit_open(D2)

    run(Engines(D1=refuses, D2=refuses), answered, decodes=(D1, D2))
