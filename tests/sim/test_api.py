"""The sim's HTTP API: shapes, errors, pause modes, cache flush, auth, metrics, flags."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.helpers import RouterProcess, SimProcess, eventually, free_port, get, http, post, sse


def test_info_routes(trio) -> None:
    regular, prefill, _ = trio
    for path in ("/model_info", "/get_model_info"):
        status, info = get(regular.url + path)
        assert status == 200 and info["weight_version"] == "default" and info["is_generation"] is True
    status, info = get(prefill.url + "/server_info")
    assert status == 200 and info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == prefill.bootstrap_port and info["version"] == "0.5.23"
    assert get(prefill.url + "/get_server_info")[0] == 200
    status, models = get(regular.url + "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "sim://tiny"
    assert get(regular.url + "/v1/models/nope")[0] == 404
    assert get(f"http://127.0.0.1:{prefill.bootstrap_port}/health") == (200, "OK")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "Either text, input_ids or input_embeds should be provided."),
        ({"text": 5}, "text: Input should be a valid string"),
        ({"input_ids": [-1]}, "out-of-vocabulary token id -1"),
        ({"text": "a", "sampling_params": {"max_tokens": 3}}, "unknown field `max_tokens`"),
        (
            {"text": "a", "sampling_params": {"temperature": "hot"}},
            'temperature: invalid type: string "hot", expected f64',
        ),
        ({"text": "a", "sampling_params": {"regex": "a+"}}, "not supported by the sim"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "1 items for a batch of 2"),
    ],
)
def test_bad_generate_requests_get_sglang_shaped_errors(trio, body, needle) -> None:
    status, out = post(trio[0].url + "/generate", body)
    assert status == 400
    assert needle in str(out.get("error", out.get("message")))


def test_pd_servers_refuse_requests_without_bootstrap(trio) -> None:
    for server in trio[1:]:
        status, out = post(server.url + "/generate", {"text": "x"})
        assert status == 400 and "bootstrap_host" in out["error"]["message"]


def test_stop_strings_and_tokens(trio) -> None:
    url = trio[0].url + "/generate"
    _, ref = post(url, {"text": "stop test", "sampling_params": {"max_new_tokens": 20, "temperature": 0}})
    target = ref["text"][3:5]
    _, out = post(
        url, {"text": "stop test", "sampling_params": {"max_new_tokens": 20, "temperature": 0, "stop": [target]}}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert out["text"] == ref["text"][: ref["text"].find(target)]
    tok = ref["output_ids"][2]
    _, out = post(
        url, {"text": "stop test", "sampling_params": {"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [tok]}}
    )
    assert out["output_ids"] == ref["output_ids"][: ref["output_ids"].index(tok) + 1]


def test_seeded_sampling_is_reproducible(trio) -> None:
    url = trio[0].url + "/generate"
    body = {
        "text": "seed",
        "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "sampling_seed": 42},
    }
    a, b = post(url, body)[1], post(url, body)[1]
    assert a["output_ids"] == b["output_ids"]
    body["sampling_params"]["sampling_seed"] = 43
    assert post(url, body)[1]["output_ids"] != a["output_ids"]


def test_openai_routes(trio) -> None:
    url = trio[0].url
    status, out = post(
        url + "/v1/completions", {"model": "sim://tiny", "prompt": "hi", "max_tokens": 5, "temperature": 0}
    )
    assert status == 200 and out["object"] == "text_completion" and out["usage"]["completion_tokens"] == 5
    status, gen = post(url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    assert out["choices"][0]["text"] == gen["text"]
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
    status, out = post(url + "/v1/chat/completions", chat)
    assert status == 200 and out["choices"][0]["message"]["role"] == "assistant"
    events = sse(url + "/v1/chat/completions", {**chat, "stream": True})
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == out["choices"][0]["message"]["content"] and events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    # stream_options.include_usage: SGLang's last chunk has no choices and the counts
    events = sse(url + "/v1/completions", {"prompt": "hi", "max_tokens": 5, "stream": True,
                                           "stream_options": {"include_usage": True}})  # fmt: skip
    assert events[-2]["choices"] == [] and events[-2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 5,
                                                                   "total_tokens": 7}  # fmt: skip
    status, err = post(url + "/v1/chat/completions", {"messages": []})
    assert status == 400 and err["object"] == "error"


def test_tokenize_counts_as_sglang_answers(trio) -> None:
    """SGLang's /v1/tokenize (and /tokenize): ids and count of a text, of a list, of rendered messages."""
    url = trio[2].url  # a decode answers it too: the router asks any engine in rotation
    status, out = post(url + "/v1/tokenize", {"model": "sim://tiny", "prompt": "héllo", "add_special_tokens": False})
    assert status == 200 and out["count"] == 6 and out["tokens"] == list("héllo".encode())
    assert out["max_model_len"] > 0
    status, out = post(url + "/tokenize", {"prompt": ["a", "bc"]})
    assert status == 200 and out["count"] == [1, 2]
    messages = [{"role": "user", "content": "hi"}]
    status, out = post(url + "/v1/tokenize", {"messages": messages})
    assert status == 200 and out["count"] == len(out["tokens"]) > 2
    for bad in ({}, {"prompt": 5}, {"messages": [{"role": "nobody", "content": "x"}]}):
        status, err = post(url + "/v1/tokenize", bad)
        assert status == 400 and err["object"] == "error", (bad, err)


def test_unknown_flag_exits_2_like_sglang() -> None:
    def sim(*flags: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "pdctl.sim", "--model-path", "sim://tiny", *flags]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    result = sim("--disaggregation-decode-tp", "2")
    assert result.returncode == 2 and "unrecognized arguments: --disaggregation-decode-tp" in result.stderr
    result = sim("--disaggregation-mode", "both")
    assert result.returncode == 2 and "invalid choice: 'both'" in result.stderr


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    proc = SimProcess(
        tmp_path_factory.mktemp("g"), "--api-key", "s3cret", "--enable-metrics", "--sim-decode-ms-per-step", "20"
    )
    yield proc.start()
    proc.stop()


def test_api_key_protects_all_but_health_and_metrics(guarded) -> None:
    assert post(guarded.url + "/generate", {"text": "x"})[0] == 401
    auth = {"Authorization": "Bearer s3cret"}
    assert (
        post(guarded.url + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}}, headers=auth)[0] == 200
    )
    assert get(guarded.url + "/health")[0] == 200
    status, text = get(guarded.url + "/metrics")
    assert status == 200 and "sglang:num_running_reqs" in text and "sglang:generation_tokens_total" in text
    assert "s3cret" not in get(guarded.url + "/server_info", headers=auth)[1].__repr__()


def test_metrics_are_off_without_the_flag(trio) -> None:
    assert get(trio[0].url + "/metrics")[0] == 404


def slow_request(url: str, n: int = 50):
    auth = {"Authorization": "Bearer s3cret"}
    return post(
        url + "/generate", {"text": "slow", "sampling_params": {"max_new_tokens": n, "temperature": 0}}, headers=auth
    )


def _wait_running(url: str, fut: cf.Future, headers: dict[str, str]) -> None:
    """Until the engine at ``url`` runs a request (``fut``'s: it must not have ended first)."""

    def runs() -> bool:
        if get(url + "/server_info", headers=headers)[1]["internal_states"][0]["num_running_reqs"] >= 1:
            return True
        assert not fut.done(), fut.result()
        return False

    eventually(runs, 60, interval=0.01, what=f"a request running on {url}")


def test_flush_cache_refused_while_busy_and_pause_modes(guarded) -> None:
    auth = {"Authorization": "Bearer s3cret"}
    url = guarded.url
    _, ref = slow_request(url, 30)
    with cf.ThreadPoolExecutor(2) as pool:
        fut = pool.submit(slow_request, url, 500)  # 10 s of steps: still running at the flush on a loaded machine
        _wait_running(url, fut, auth)
        assert post(url + "/flush_cache", headers=auth)[0] == 400
        assert post(url + "/pause_generation", {"mode": "abort"}, headers=auth)[1]["status"] == "ok"
        status, out = fut.result()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    post(url + "/continue_generation", headers=auth)
    assert post(url + "/flush_cache", headers=auth)[0] == 200
    for mode in ("retract", "in_place"):
        with cf.ThreadPoolExecutor(2) as pool:
            fut = pool.submit(slow_request, url, 30)
            _wait_running(url, fut, auth)
            post(url + "/pause_generation", {"mode": mode}, headers=auth)
            time.sleep(0.3)  # (a paused request must not end meanwhile: a bug would show here)
            assert not fut.done()  # paused, not aborted
            post(url + "/continue_generation", headers=auth)
            status, out = fut.result()
        assert status == 200 and out["output_ids"] == ref["output_ids"], mode
        assert out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)


def test_decode_without_prefill_times_out_clearly_and_frees_its_slot(tmp_path) -> None:
    decode = SimProcess(
        tmp_path,
        "--disaggregation-mode",
        "decode",
        "--max-running-requests",
        "2",
        env={"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "1.5"},
    ).start()
    try:
        dead = {"text": "x", "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 1}
        with cf.ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda _: post(decode.url + "/generate", dead), range(3)))
        statuses = sorted(s for s, _ in results)
        assert statuses == [500, 500, 500]  # all three wait for KV (2 running slots, 4 more for KV on its way)
        message = next(o for s, o in results if s == 500)["error"]["message"]
        assert "bootstrap_room 1" in message and "SGLANG_DISAGGREGATION_WAITING_TIMEOUT" in message
        info = get(decode.url + "/server_info")[1]["internal_states"][0]
        assert info["num_reserved_decode_slots"] == 0 and info["free_slots"] == 2
        assert info["num_decode_prealloc_queue_reqs"] == 0
        assert post(decode.url + "/generate", {**dead, "bootstrap_host": "2.2.2.2"})[0] == 200
    finally:
        decode.stop()


def test_max_queued_requests_answers_503_beyond_the_queue(tmp_path) -> None:
    """SGLang 0.5.23: with --max-queued-requests, a request beyond that many waiting ones gets
    503 'The request queue is full.'; running and queued ones complete."""
    sim = SimProcess(
        tmp_path, "--max-running-requests", "1", "--max-queued-requests", "2", "--sim-decode-ms-per-step", "20"
    ).start()
    try:
        # the first holds the only slot until it is aborted (2000 steps, 40 s): the burst arrives while
        # it runs however loaded the machine; the others ask for one token each
        long = {"text": "q", "rid": "long", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        body = {"text": "q", "sampling_params": {"max_new_tokens": 1}}
        with cf.ThreadPoolExecutor(6) as pool:
            first = pool.submit(post, sim.url + "/generate", long)
            _wait_running(sim.url, first, {})  # it must be running, not waiting, before the others come
            burst = [pool.submit(post, sim.url + "/generate", body) for _ in range(5)]
            # the refused: two wait in the queue behind the first
            eventually(lambda: sum(f.done() for f in burst) >= 3, 60, interval=0.01, what="three of the burst answered")
            assert post(sim.url + "/abort_request", {"rid": "long"})[0] == 200  # the queued ones run now
            results = [first.result(), *(f.result() for f in burst)]
        statuses = sorted(s for s, _ in results)
        assert statuses.count(200) >= 3 and 503 in statuses and set(statuses) <= {200, 503}, statuses
        full = next(o for s, o in results if s == 503)
        assert full["error"]["message"] == "The request queue is full."
    finally:
        sim.stop()


def test_hostile_bodies_get_400_and_the_engine_stays_up(trio) -> None:
    """Bodies nested 100 000 deep, not UTF-8 or cut short: a clear 400 on every route that
    reads JSON (orjson's nesting limit), never a 500 or a traceback in the log."""
    url = trio[0].url
    deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    routes = ["/generate", "/v1/completions", "/v1/chat/completions", "/init_weights_update_group",
              "/update_weights_from_distributed", "/pause_generation", "/abort_request"]  # fmt: skip
    for route in routes:
        for body in (deep, b"\xff\xfe garbage", b"[1, 2"):
            req = urllib.request.Request(url + route, data=body, headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(req, timeout=30)
            assert info.value.code == 400, (route, body[:20], info.value.read()[:200])
    assert get(url + "/health")[0] == 200
    assert "Traceback" not in trio[0].log.read_text()
    # pdctl's router in front: the same bodies get its 400 (orjson too), the worker never sees them
    router = RouterProcess(trio[0].log.parent, "--worker-urls", url).start()
    try:
        for route in ("/generate", "/v1/completions", "/v1/chat/completions"):
            for body in (deep, b"\xff\xfe garbage", b"[1, 2"):
                code, out = http("POST", router.url + route, raw=body)
                assert code == 400 and "invalid JSON body" in str(out), (route, body[:20], out)
        assert "Traceback" not in router.log.read_text()
    finally:
        router.stop()


def test_completions_echo_puts_the_prompt_first(trio) -> None:
    """SGLang's `echo`: the choice's text starts with the prompt (non-stream), and a stream's
    first chunk carries it; the sim ignored `echo` once."""
    url = trio[0].url + "/v1/completions"
    body = {"prompt": "Once upon", "max_tokens": 5, "temperature": 0}
    plain = post(url, body)[1]["choices"][0]["text"]
    echoed = post(url, {**body, "echo": True})[1]["choices"][0]["text"]
    assert echoed == "Once upon" + plain
    events = sse(url, {**body, "echo": True, "stream": True})
    pieces = [e["choices"][0]["text"] for e in events[:-1]]
    assert pieces[0].startswith("Once upon") and "".join(pieces) == echoed


AUTH = {"Authorization": "Bearer s3cret"}


def test_openai_streams_of_several_choices_interleave(guarded) -> None:
    """SGLang streams a batch's choices side by side, on /generate and on the OpenAI routes
    alike (the sim's OpenAI routes once sent every chunk of choice 0, then of choice 1)."""
    body = {"prompt": ["Once upon", "zebra"], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    events = sse(guarded.url + "/v1/completions", body, headers=AUTH)
    order = [e["choices"][0]["index"] for e in events[:-1] if e["choices"]]
    assert sorted(set(order)) == [0, 1] and order != sorted(order), order
    texts = {i: "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"][0]["index"] == i) for i in (0, 1)}
    plain = post(guarded.url + "/v1/completions", {**body, "stream": False}, headers=AUTH)[1]["choices"]
    assert [texts[0], texts[1]] == [c["text"] for c in plain]
    generate = {"text": ["Once upon", "zebra"], "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}
    events = sse(guarded.url + "/generate", {**generate, "stream": True}, headers=AUTH)
    order = [e["index"] for e in events[:-1]]
    assert sorted(set(order)) == [0, 1] and order != sorted(order), order


def _abort_when_running(server, url: str, body: dict) -> list:
    """Stream ``body`` to ``url``, /abort_request everything once it runs; the stream's events."""
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(sse, url, body, 60, AUTH)
        eventually(
            lambda: get(server.url + "/server_info", headers=AUTH)[1]["internal_states"][0]["num_running_reqs"] >= 1,
            10,
            interval=0.02,
            what="the request started",
        )
        post(server.url + "/abort_request", {"abort_all": True}, headers=AUTH)
        return fut.result()


def test_a_stream_aborted_on_request_ends_as_any_stream_does(guarded) -> None:
    """SGLang 0.5.23 gives an abort that was asked for (/abort_request, a pause) no status: the
    stream's last output carries finish_reason abort and [DONE] follows, with no error event
    (the sim once sent a 500 error event after it, which a router takes for a failure)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "ignore_eos": True, "stream": True}
    events = _abort_when_running(guarded, guarded.url + "/v1/chat/completions", chat)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    native = {"text": "hi", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}, "stream": True}
    events = _abort_when_running(guarded, guarded.url + "/generate", native)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    finish = events[-2]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["status_code"] is None, finish


def test_a_streamed_decode_whose_kv_cannot_come_is_a_200_that_ends_in_an_abort(trio) -> None:
    """SGLang sends a stream's head at once; a decode that loses its prefill aborts the request
    with status 500, which /generate streams as an output whose finish_reason says so and the
    OpenAI routes as their streamed error (the sim once answered these streams with an HTTP 500,
    so a router's handling of the real shape was never exercised against it)."""
    decode = trio[2]
    dead = free_port()
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": dead, "bootstrap_room": 9200}
    native = {"text": "lost", "sampling_params": {"max_new_tokens": 4}, "stream": True, **pd}
    events = sse(decode.url + "/generate", native, timeout=120)
    assert len(events) == 2 and events[1] == "[DONE]", events
    finish = events[0]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["status_code"] == 500, finish
    assert f"Lost connection with prefill instance (bootstrap_addr: 127.0.0.1:{dead})" in finish["message"]
    assert events[0]["output_ids"] == [] and events[0]["meta_info"]["completion_tokens"] == 0
    chat = {"messages": [{"role": "user", "content": "lost"}], "max_tokens": 4, "stream": True, **pd}
    events = sse(decode.url + "/v1/chat/completions", {**chat, "bootstrap_room": 9201}, timeout=120)
    assert len(events) == 2 and events[1] == "[DONE]", events
    error = events[0]["error"]
    assert error["code"] == 500 and error["type"] == "INTERNAL_SERVER_ERROR", error
    assert "Lost connection with prefill instance" in error["message"]
    status, out = post(decode.url + "/generate", {**native, "stream": False, "bootstrap_room": 9202}, timeout=120)
    assert status == 500 and "Lost connection with prefill instance" in out["error"]["message"]


def test_a_decode_batch_that_fails_half_way_gives_back_every_reserved_slot(trio) -> None:
    """A decode batch reserves a KV slot per item as it fetches their KV; when a later item's
    KV cannot come (its prefill is dead), the slots of the items before it go back too (they
    once leaked: the decode ran one slot short for good)."""
    _, prefill, decode = trio
    dead = free_port()
    first = {"text": "half", "sampling_params": {"max_new_tokens": 4}}
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": 9100}
    batch = {
        "text": ["half", "way"],
        "sampling_params": {"max_new_tokens": 4},
        "bootstrap_host": ["127.0.0.1", "127.0.0.1"],
        "bootstrap_port": [prefill.bootstrap_port, dead],
        "bootstrap_room": [9100, 9101],
    }
    with cf.ThreadPoolExecutor(2) as pool:
        d = pool.submit(post, decode.url + "/generate", batch, timeout=120)
        assert post(prefill.url + "/generate", {**first, **pd})[0] == 200
        status, out = d.result()
    assert status == 500 and "Lost connection with prefill instance" in out["error"]["message"]
    info = get(decode.url + "/server_info")[1]["internal_states"][0]
    assert info["num_reserved_decode_slots"] == 0, info


@pytest.mark.parametrize(
    "content, name, needle",
    [
        ("api-key: k\n", "keys.json", "must be YAML format"),
        ("- a\n- b\n", "keys.yaml", "dictionary at root level"),
        ("api-key: [unclosed\n", "keys.yaml", "--config"),
        ("no-such-flag: 1\n", "keys.yaml", "unrecognized arguments: --no-such-flag"),
    ],
)
def test_a_bad_config_file_exits_2_naming_it(tmp_path, capsys, content, name, needle) -> None:
    from pdctl.sim.__main__ import config_from_argv

    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(SystemExit) as exited:
        config_from_argv(["--model-path", "sim://tiny", "--config", str(path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
