"""Serving past capacity and through faults: real sims with few running slots behind pdctl's router.

The fleet has 2 prefill and 2 decode sims with --max-running-requests 4 (8 decode slots); bursts
offer 10x that. Every request must complete: a full engine queues (as SGLang does), and a 503
from a live engine is backpressure, not a failure."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from tests.helpers import RouterProcess, SimProcess, eventually, get, pd_router_args, post, sims

SLOTS = 4
PROMPTS = [f"overload {i} " * 3 for i in range(80)]


@pytest.fixture
def fleet(tmp_path):
    specs = [
        ("--disaggregation-mode", "prefill", "--max-running-requests", str(SLOTS), "--sim-decode-ms-per-step", "2"),
        ("--disaggregation-mode", "prefill", "--max-running-requests", str(SLOTS), "--sim-decode-ms-per-step", "2"),
        ("--disaggregation-mode", "decode", "--max-running-requests", str(SLOTS), "--sim-decode-ms-per-step", "2"),
        ("--disaggregation-mode", "decode", "--max-running-requests", str(SLOTS), "--sim-decode-ms-per-step", "2"),
    ]
    with sims(tmp_path, *specs) as procs:
        router = RouterProcess(
            tmp_path,
            *pd_router_args(
                procs[:2],
                procs[2:],
                "--policy",
                "round_robin",
                "--health-check-interval-secs",
                "1",
                "--health-failure-threshold",
                "2",
            ),
        ).start("/readiness")
        try:
            yield procs, router
        finally:
            router.stop()


def assert_idle(procs, wait_secs: float = 10.0) -> None:
    """No request running, queued or holding a reserved decode slot on any live engine."""
    live = [p for p in procs if p.proc is not None and p.proc.poll() is None]
    counts = ("num_running_reqs", "num_queue_reqs", "num_reserved_decode_slots", "num_decode_prealloc_queue_reqs")

    def busy() -> list[tuple[str, dict]]:
        states = [(p.url, get(p.url + "/server_info")[1]["internal_states"][0]) for p in live]
        return [(url, state) for url, state in states if sum(state[k] for k in counts)]

    eventually(lambda: not busy(), wait_secs, interval=0.2, what=lambda: f"every engine idle: {busy()}")


async def one(session: aiohttp.ClientSession, url: str, prompt: str, stream: bool, tokens: int) -> dict:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}, "stream": stream}
    async with session.post(url + "/generate", json=body) as resp:
        if not stream:
            out = await resp.json(content_type=None)
            ok = resp.status == 200 and out.get("meta_info", {}).get("completion_tokens") == tokens
            return {"ok": ok, "status": resp.status, "body": out}
        last, events = None, []
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
        if events and events[-1] == b"[DONE]":
            last = json.loads(events[-2])
        ok = resp.status == 200 and last is not None and last["meta_info"]["completion_tokens"] == tokens
        return {"ok": ok, "status": resp.status, "body": last or events[-3:]}


async def burst(url: str, n: int, tokens: int = 24) -> list[dict]:
    timeout = aiohttp.ClientTimeout(total=240)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [one(session, url, PROMPTS[i % len(PROMPTS)], stream=i % 2 == 0, tokens=tokens) for i in range(n)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return [r if isinstance(r, dict) else {"ok": False, "status": 0, "body": repr(r)} for r in results]


def _running(server) -> int:
    return get(server.url + "/server_info")[1]["internal_states"][0]["num_running_reqs"]


def test_burst_at_ten_times_the_slots_loses_nothing(fleet):
    procs, router = fleet
    results = asyncio.run(burst(router.url, 10 * 2 * SLOTS))
    failed = [r for r in results if not r["ok"]]
    assert not failed, f"{len(failed)} of {len(results)} failed, first: {failed[0]}"
    workers = get(router.url + "/workers")[1]["workers"]
    assert all(w["is_healthy"] and not w["circuit_open"] for w in workers), workers
    assert_idle(procs)


def test_decode_killed_during_a_burst_loses_nothing(fleet):
    procs, router = fleet
    victim = procs[3]

    async def run() -> list[dict]:
        task = asyncio.create_task(burst(router.url, 10 * 2 * SLOTS, tokens=48))
        deadline = time.monotonic() + 60
        while not await asyncio.to_thread(_running, victim):  # mid-burst: the victim has requests
            assert not task.done(), "the burst ended before the decode ran any of it"
            assert time.monotonic() < deadline, "the decode ran none of the burst within 60 s"
            await asyncio.sleep(0.05)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        return await task

    results = asyncio.run(run())
    failed = [r for r in results if not r["ok"]]
    assert not failed, f"{len(failed)} of {len(results)} failed, first: {failed[0]}"
    workers = {w["url"]: w for w in get(router.url + "/workers")[1]["workers"]}
    assert not workers[victim.url]["is_healthy"]
    log = router.log.read_text()
    assert f"worker {victim.url} is unhealthy" in log  # the log says what /workers shows
    assert ("circuit opened for " + victim.url in log) == workers[victim.url]["circuit_open"]
    for url, w in workers.items():  # and nothing about the survivors
        if url != victim.url:
            assert w["is_healthy"] and not w["circuit_open"] and f"worker {url} is unhealthy" not in log
    # Restarted on the same port, it comes back into rotation.
    SimProcess.__init__(victim, victim.log.parent, *victim.args, name="sim3b", port=victim.port)
    victim.start()
    eventually(lambda: get(router.url + "/workers")[1]["workers"][3]["is_healthy"], 30, interval=0.3, what="sim3 back")
    assert {w["url"]: w for w in get(router.url + "/workers")[1]["workers"]}[victim.url]["is_healthy"]
    assert f"worker {victim.url} is healthy again" in router.log.read_text()
    after = asyncio.run(burst(router.url, 16))
    assert all(r["ok"] for r in after), after


@pytest.mark.parametrize("text", ["", "x" * 5000])
def test_a_prompt_the_prefill_refuses_is_answered_at_once(fleet, text):
    procs, router = fleet
    started = time.monotonic()
    status, out = post(router.url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": 4}}, timeout=30)
    assert time.monotonic() - started < 20  # no wait for a KV hand-off that never comes (a hang hits the timeout)
    assert status == 400 or (status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"), out
    assert_idle(procs)


def test_a_busy_worker_is_backpressure_not_death(tmp_path):
    """A live worker answering 503 (its queue is full) never opens its breaker; requests go on
    to the other worker, and the busy one stays healthy in /workers."""
    from tests.helpers import NullEngine

    busy = NullEngine(tmp_path, "regular", busy=True).start()
    good = NullEngine(tmp_path, "regular").start()
    router = RouterProcess(
        tmp_path, "--worker-urls", busy.url, good.url, "--policy", "round_robin", "--cb-failure-threshold", "2"
    ).start("/readiness")
    try:
        results = [post(router.url + "/generate", {"text": f"b{i}"}) for i in range(20)]
        assert all(status == 200 for status, _ in results), results[:3]
        workers = {w["url"]: w for w in get(router.url + "/workers")[1]["workers"]}
        assert workers[busy.url]["is_healthy"] and not workers[busy.url]["circuit_open"]
        assert "circuit opened" not in router.log.read_text()
    finally:
        router.stop()
        busy.stop()
        good.stop()


def test_model_by_id_through_the_router(fleet):
    procs, router = fleet
    status, out = get(router.url + "/v1/models")
    model_id = out["data"][0]["id"]
    status, one_model = get(router.url + f"/v1/models/{model_id}")
    assert status == 200 and one_model["id"] == model_id
    assert get(procs[0].url + f"/v1/models/{model_id}") == (status, one_model)


def test_a_stream_outlives_its_decode(tmp_path):
    """kill -9 of the decode serving a greedy /generate stream: the router continues the same
    stream on the other decode; the client sees one stream equal to an uninterrupted run."""
    slow = ("--sim-decode-ms-per-step", "15")
    specs = [
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "decode", *slow),
        ("--disaggregation-mode", "decode", *slow),
    ]
    with sims(tmp_path, *specs) as procs:
        router = RouterProcess(tmp_path, *pd_router_args(procs[:1], procs[1:], "--policy", "round_robin")).start(
            "/readiness"
        )
        try:
            body = {
                "text": "a stream that outlives its decode",
                "sampling_params": {"max_new_tokens": 150, "temperature": 0},
            }
            status, reference = post(router.url + "/generate", body)
            assert status == 200 and reference["meta_info"]["completion_tokens"] == 150

            async def run() -> list[bytes]:
                events: list[bytes] = []
                killed = False
                timeout = aiohttp.ClientTimeout(total=120)
                async with (
                    aiohttp.ClientSession(timeout=timeout) as session,
                    session.post(router.url + "/generate", json={**body, "stream": True}) as resp,
                ):
                    async for line in resp.content:
                        if not line.startswith(b"data: "):
                            continue
                        events.append(line[6:].strip())
                        if not killed and len(events) >= 10:
                            busy = [
                                p
                                for p in procs[1:]
                                if get(p.url + "/server_info")[1]["internal_states"][0]["num_running_reqs"]
                            ]
                            assert len(busy) == 1
                            os.killpg(busy[0].proc.pid, signal.SIGKILL)
                            killed = True
                assert killed
                return events

            events = asyncio.run(run())
            assert events[-1] == b"[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert not [c for c in chunks if "error" in c], chunks[-3:]
            last = chunks[-1]
            assert last["text"] == reference["text"] and last["output_ids"] == reference["output_ids"]
            assert last["meta_info"]["completion_tokens"] == 150
            assert len({c["meta_info"]["id"] for c in chunks}) == 1
            tokens = [c["meta_info"]["completion_tokens"] for c in chunks]
            assert tokens == sorted(tokens)  # one stream: counts never go back
            assert "continuing on" in router.log.read_text()
        finally:
            router.stop()
