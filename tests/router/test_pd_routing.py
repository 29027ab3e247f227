"""pdctl router in PD mode over real sim engines: equality, batches, streams, versions, errors."""

from __future__ import annotations

import concurrent.futures as cf
import time
import urllib.request

from tests.helpers import RouterProcess, eventually, get, pd_router_args, post, sse, wait_metric


def greedy(text, n=16, **extra):
    return {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}, **extra}


def test_pd_equals_regular_single_batch_stream(router, fleet) -> None:
    regular = fleet[0]
    for prompt in ("The capital of France is", "routing", "z" * 80):
        assert (
            post(router.url + "/generate", greedy(prompt))[1]["output_ids"]
            == post(regular.url + "/generate", greedy(prompt))[1]["output_ids"]
        )
    for batch in ({"text": ["a b", "c d e", "f"]}, {"input_ids": [[1, 2], [3, 4, 5], [6]]}):
        body = {**batch, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        status, out = post(router.url + "/generate", body)
        assert status == 200, out
        assert [o["output_ids"] for o in out] == [r["output_ids"] for r in post(regular.url + "/generate", body)[1]]
    body = greedy("streamed", 12, stream=True)
    out, ref = sse(router.url + "/generate", body), sse(regular.url + "/generate", body)
    assert out[-1] == "[DONE]" and out[-2]["output_ids"] == ref[-2]["output_ids"]


def test_logprobs_are_merged_like_non_pd(router, fleet) -> None:
    body = greedy("logprobs please", 5, return_logprob=True)
    out = post(router.url + "/generate", body)[1]
    ref = post(fleet[0].url + "/generate", body)[1]
    assert out["meta_info"]["input_token_logprobs"] == ref["meta_info"]["input_token_logprobs"]
    assert out["meta_info"]["output_token_logprobs"] == ref["meta_info"]["output_token_logprobs"]
    stream = sse(router.url + "/generate", {**body, "stream": True})
    assert stream[-2]["meta_info"]["input_token_logprobs"] == ref["meta_info"]["input_token_logprobs"]


def test_openai_routes(router, fleet) -> None:
    chat = {"model": "sim://tiny", "messages": [{"role": "user", "content": "hey"}], "max_tokens": 7, "temperature": 0}
    status, out = post(router.url + "/v1/chat/completions", chat)
    assert status == 200, out
    assert out["choices"][0]["message"] == post(fleet[0].url + "/v1/chat/completions", chat)[1]["choices"][0]["message"]
    comp = {"model": "sim://tiny", "prompt": ["one", "two"], "max_tokens": 4, "temperature": 0}
    status, out = post(router.url + "/v1/completions", comp)
    assert status == 200 and [c["text"] for c in out["choices"]] == [
        c["text"] for c in post(fleet[0].url + "/v1/completions", comp)[1]["choices"]
    ]


def picks(router, url: str) -> float:
    """How often the router selected worker ``url`` (its Prometheus counter)."""
    for line in get(router.url + "/metrics")[1].splitlines():
        if line.startswith("pdctl_router_worker_selection_total") and f'worker="{url}"' in line:
            return float(line.split()[-1])
    return 0.0


def test_round_robin_alternates_decodes(router, fleet) -> None:
    _, _, d1, d2 = fleet
    before = picks(router, d1.url), picks(router, d2.url)
    for i in range(6):
        post(router.url + "/generate", greedy(f"rr {i}", 2))
    assert (picks(router, d1.url) - before[0], picks(router, d2.url) - before[1]) == (3, 3)


def test_worker_load_returns_to_zero_after_mixed_traffic(router) -> None:
    def one(i: int):
        if i % 4 == 0:
            return 200 if sse(router.url + "/generate", greedy(f"load {i}", 4, stream=True))[-1] == "[DONE]" else 0
        if i % 4 == 1:
            return post(router.url + "/generate", greedy(f"load {i}", 4, return_logprob=True))[0]
        if i % 4 == 2:
            return post(router.url + "/generate", {"text": "bad", "sampling_params": {"max_new_tokens": -1}})[0]
        return post(router.url + "/generate", greedy(f"load {i}", 4))[0]

    with cf.ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(one, range(48)))
    assert statuses.count(400) == 12 and statuses.count(200) == 36
    eventually(  # a prefill leg may end just after its reply went out
        lambda: not any(w["load"] for w in get(router.url + "/workers")[1]["workers"]), 10, what="every load back at 0"
    )
    assert [w["load"] for w in get(router.url + "/workers")[1]["workers"]] == [0, 0, 0]


def test_request_id_kept_or_generated(router) -> None:
    req = urllib.request.Request(
        router.url + "/generate",
        data=b'{"text":"x","sampling_params":{"max_new_tokens":1}}',
        headers={"Content-Type": "application/json", "X-Request-ID": "abc-123"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["X-Request-ID"] == "abc-123"
    req = urllib.request.Request(
        router.url + "/generate",
        data=b'{"text":"x","sampling_params":{"max_new_tokens":1}}',
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert len(resp.headers["X-Request-ID"]) >= 16


def test_bad_requests_are_not_retried_and_keep_worker_shape(router) -> None:
    status, out = post(router.url + "/generate", {"text": "x", "sampling_params": {"max_tokens": 3}})
    assert status == 400 and "unknown field `max_tokens`" in str(out)
    status, out = post(router.url + "/generate", None)
    assert status == 400 or status == 200  # {} is a valid JSON object; the engine answers 400
    req = urllib.request.Request(router.url + "/generate", data=b"not json", method="POST")
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("expected 400")
    except urllib.error.HTTPError as exc:
        assert exc.code == 400 and b"invalid_request" in exc.read()


def test_info_and_fan_out_routes(router) -> None:
    assert get(router.url + "/health") == (200, "OK")
    assert get(router.url + "/readiness")[1]["status"] == "ready"
    assert get(router.url + "/model_info")[1]["model_path"] == "sim://tiny"
    assert get(router.url + "/v1/models")[1]["data"][0]["id"] == "sim://tiny"
    info = get(router.url + "/server_info")[1]
    assert len(info["prefill"]) == 1 and len(info["decode"]) == 2
    status, out = post(router.url + "/flush_cache")
    assert status == 200 and "all 3 HTTP workers" in out["message"]


def test_weight_versions_are_never_mixed(router, fleet) -> None:
    _, prefill, d1, d2 = fleet
    try:
        post(d1.url + "/update_weight_version", {"new_version": "v2", "abort_all_requests": False})
        post(router.url + "/pdctl/refresh")
        d1_before, d2_before = picks(router, d1.url), picks(router, d2.url)
        for i in range(6):  # prefill is on "default": only d2 may be paired with it
            assert post(router.url + "/generate", greedy(f"ver {i}", 2))[0] == 200
        assert picks(router, d1.url) == d1_before and picks(router, d2.url) == d2_before + 6
        post(prefill.url + "/update_weight_version", {"new_version": "v2", "abort_all_requests": False})
        post(d2.url + "/update_weight_version", {"new_version": "v3", "abort_all_requests": False})
        post(router.url + "/pdctl/refresh")
        assert post(router.url + "/generate", greedy("v2 pair", 2))[1]["meta_info"]["weight_version"] == "v2"
        # No pair at all: the request waits for one (an update relabels its engines one call at
        # a time) and is served once a decode holds the prefill's version.
        post(prefill.url + "/update_weight_version", {"new_version": "v9", "abort_all_requests": False})
        post(router.url + "/pdctl/refresh")
        with cf.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, router.url + "/generate", greedy("no pair", 2))
            wait_metric(router, "pdctl_router_requests_waiting_for_workers 1.0", answer)
            post(d1.url + "/update_weight_version", {"new_version": "v9", "abort_all_requests": False})
            post(router.url + "/pdctl/refresh")
            status, out = answer.result()
        assert status == 200 and out["meta_info"]["weight_version"] == "v9", out
    finally:
        for s in (prefill, d1, d2):
            post(s.url + "/update_weight_version", {"new_version": "default", "abort_all_requests": False})
        post(router.url + "/pdctl/refresh")


def test_hold_drains_and_release_resumes_without_failures(router) -> None:
    with cf.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(post, router.url + "/generate", greedy(f"hold {i}", 24)) for i in range(24)]
        time.sleep(0.05)
        status, held = post(router.url + "/pdctl/hold", {"timeout_secs": 60})
        assert status == 200 and held["drained"] and held["in_flight"] == 0
        late = [pool.submit(post, router.url + "/generate", greedy(f"late {i}", 4)) for i in range(4)]
        time.sleep(0.3)
        assert not any(f.done() for f in late)  # held, not failed
        assert post(router.url + "/pdctl/release")[1]["held"] is False
        results = [f.result() for f in futs + late]
    assert all(status == 200 for status, _ in results)


def test_api_key(fleet, tmp_path) -> None:
    _, prefill, d1, _ = fleet
    args = pd_router_args([prefill], [d1], "--api-key-env", "ROUTER_KEY")
    proc = RouterProcess(tmp_path, *args, env={"ROUTER_KEY": "k3y"}).start()
    try:
        assert post(proc.url + "/generate", greedy("x", 1))[0] == 401
        assert post(proc.url + "/generate", greedy("x", 1), headers={"Authorization": "Bearer k3y"})[0] == 200
        assert get(proc.url + "/health")[0] == 200 and get(proc.url + "/metrics")[0] == 200
        assert "k3y" not in proc.log.read_text()
    finally:
        proc.stop()


def test_concurrency_limit_answers_429(fleet, tmp_path) -> None:
    _, prefill, d1, _ = fleet
    args = pd_router_args([prefill], [d1], "--max-concurrent-requests", "1", "--queue-size", "1")
    proc = RouterProcess(tmp_path, *args).start()
    try:
        with cf.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: post(proc.url + "/generate", greedy(f"q{i}", 256)), range(8)))
        codes = [s for s, _ in results]
        assert 429 in codes and 200 in codes
        body = next(o for s, o in results if s == 429)
        assert body["error"]["code"] == "queue_full"
    finally:
        proc.stop()
