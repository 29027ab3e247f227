"""Failures under load: a decode killed mid-run, client disconnects, what reaches the engines."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import signal
import urllib.request

import pytest

from tests.helpers import (
    NullEngine,
    RouterProcess,
    SimProcess,
    eventually,
    free_port,
    get,
    pd_router_args,
    post,
    sims,
    sse,
    triton_stub,
)


def greedy(text, n=8):
    return {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}}


def healthy(router, url) -> bool:
    return next(w for w in get(router.url + "/workers")[1]["workers"] if w["url"] == url)["is_healthy"]


def test_kill_9_a_decode_under_load_fails_no_request(tmp_path) -> None:
    specs = [
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "decode"),
        ("--disaggregation-mode", "decode"),
    ]
    with sims(tmp_path, *specs) as (prefill, d1, d2):
        router = RouterProcess(
            tmp_path,
            *pd_router_args(
                [prefill],
                [d1, d2],
                "--policy",
                "round_robin",
                "--health-check-interval-secs",
                "0.5",
                "--health-failure-threshold",
                "2",
                "--health-success-threshold",
                "2",
            ),
        ).start("/readiness")
        try:
            done = 0
            killed = False

            def one(i: int):
                return post(router.url + "/generate", greedy(f"load {i}", 8), timeout=120)

            with cf.ThreadPoolExecutor(32) as pool:
                futures = [pool.submit(one, i) for i in range(500)]
                results = []
                for fut in cf.as_completed(futures):
                    results.append(fut.result())
                    done += 1
                    if done == 100 and not killed:
                        os.killpg(d2.proc.pid, signal.SIGKILL)
                        killed = True
            failures = [r for r in results if r[0] != 200]
            assert not failures, failures[:3]
            assert len(results) == 500
            eventually(lambda: not healthy(router, d2.url), 10, interval=0.2, what="the dead decode out of rotation")
            d2.proc.wait()
            revived = SimProcess(tmp_path, "--disaggregation-mode", "decode", port=d2.port).start()
            try:
                eventually(
                    lambda: healthy(router, d2.url), 15, interval=0.2, what="the restarted decode back in rotation"
                )
                statuses = [post(router.url + "/generate", greedy(f"back {i}", 2))[0] for i in range(6)]
                assert statuses == [200] * 6
                served = get(revived.url + "/server_info")[1]
                assert served["internal_states"][0]["num_running_reqs"] == 0
            finally:
                revived.stop()
        finally:
            router.stop()


def test_a_prefill_whose_kv_cannot_reach_the_decode_is_retried_streamed_or_not(tmp_path) -> None:
    """A prefill registered under a bootstrap port nothing listens on (a typo, or a bootstrap
    server that died) answers its own leg, but the decode cannot fetch the KV: SGLang's decode
    aborts with 500 naming that bootstrap address, as an HTTP 500 or, streamed, as a 200 whose
    first event is the abort. The router retries on the other prefill, so every client gets all
    its tokens. End to end with real processes: the sim streams that abort as SGLang does."""
    roles = ("prefill", "prefill", "decode")
    with sims(tmp_path, *[("--disaggregation-mode", role) for role in roles]) as (good, bad, decode):
        nowhere = free_port()
        args = ["--pd-disaggregation", "--prefill", bad.url, str(nowhere)]
        args += ["--prefill", good.url, str(good.bootstrap_port), "--decode", decode.url, "--policy", "round_robin"]
        router = RouterProcess(tmp_path, *args).start("/readiness")
        try:
            for i in range(4):
                events = sse(router.url + "/generate", {**greedy(f"lost {i}", 6), "stream": True}, timeout=120)
                assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events[-2:]
                finish = events[-2]["meta_info"]
                assert finish["finish_reason"]["type"] == "length" and finish["completion_tokens"] == 6, finish
                status, out = post(router.url + "/generate", greedy(f"plain {i}", 6), timeout=120)
                assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length", out
            metrics = urllib.request.urlopen(router.url + "/metrics", timeout=10).read().decode()
            retried = [line for line in metrics.splitlines() if line.startswith("pdctl_router_retries_total{")]
            blamed = [line for line in retried if 'reason="prefill_server_error"' in line]
            assert blamed and not blamed[0].endswith(" 0.0"), retried
            assert get(decode.url + "/server_info")[1]["internal_states"][0]["num_reserved_decode_slots"] == 0
        finally:
            router.stop()


def running(server) -> int:
    return get(server.url + "/server_info")[1]["internal_states"][0]["num_running_reqs"]


def test_client_disconnect_cancels_both_legs(tmp_path) -> None:
    slow = ("--sim-decode-ms-per-step", "50")
    with sims(
        tmp_path,
        ("--disaggregation-mode", "prefill", "--sim-prefill-ms-per-token", "200"),
        ("--disaggregation-mode", "decode", *slow),
    ) as (prefill, decode):
        router = RouterProcess(tmp_path, *pd_router_args([prefill], [decode])).start("/readiness")
        try:
            # 1) disconnect while prefill is still running the prompt (200 ms per token)
            conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
            body = json.dumps({"text": "x" * 40, "stream": True, "sampling_params": {"max_new_tokens": 400}})
            conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
            # the prompt reached the prefill (8 s of prefill at 200 ms/token)
            eventually(lambda: running(prefill) == 1, 60, what="the prompt on the prefill")
            conn.close()
            eventually(
                lambda: running(prefill) == 0 and running(decode) == 0, 5, interval=0.1, what="both legs cancelled"
            )
            # 2) disconnect mid-stream on decode (400 tokens at 50 ms would take 20 s)
            conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
            body = json.dumps({"text": "y", "stream": True, "sampling_params": {"max_new_tokens": 400}})
            conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            resp.fp.readline()
            assert running(decode) == 1
            conn.close()
            eventually(lambda: running(decode) == 0, 5, interval=0.1, what="the decode leg cancelled")
        finally:
            router.stop()


@pytest.fixture(scope="module")
def contract_check():
    with triton_stub():
        api = pytest.importorskip("sglang.srt.entrypoints.api_contract", reason="sglang not installed")
        yield api.generate_contract_error


def test_every_body_sent_to_engines_passes_sglangs_contract(tmp_path, contract_check) -> None:
    prefill, decode = NullEngine(tmp_path, "prefill", record=True), NullEngine(tmp_path, "decode", record=True)
    prefill.start(), decode.start()
    router = RouterProcess(
        tmp_path, "--pd-disaggregation", "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url
    ).start("/readiness")
    try:
        bodies = [
            {"text": "hello", "sampling_params": {"max_new_tokens": 4}},
            {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
            {"input_ids": [[1, 2], [3, 4]], "sampling_params": {"max_new_tokens": 2}},
            {"input_ids": [5, 6, 7], "stream": True},
            {"text": "lp", "return_logprob": True, "rid": "r-1"},
        ]
        for body in bodies:
            status, _ = post(router.url + "/generate", body) if not body.get("stream") else (200, None)
            if body.get("stream"):
                from tests.helpers import sse

                sse(router.url + "/generate", body)
            assert status == 200
        sent = prefill.bodies() + decode.bodies()
        assert len(sent) == 2 * len(bodies)
        for body in sent:
            assert contract_check(body) is None, body
            assert "bootstrap_room" in body
        batch = next(b for b in decode.bodies() if isinstance(b.get("text"), list))
        assert len(batch["bootstrap_room"]) == 3 and len(set(batch["bootstrap_room"])) == 3
        assert batch["bootstrap_port"] == [prefill.bootstrap_port] * 3
        assert all(0 <= r < 2**63 for r in batch["bootstrap_room"])
        # each request's prefill and decode share its room (compared as sets: the two engines record a
        # request's legs as they arrive, and a stream's prefill leg may land after the next request's)
        rooms = [sorted(str(b["bootstrap_room"]) for b in e.bodies()) for e in (prefill, decode)]
        assert rooms[0] == rooms[1]
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
