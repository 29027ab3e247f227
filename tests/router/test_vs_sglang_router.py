"""The same requests through pdctl router and the real sglang-router 0.3.2, against the same
sim engines, give identical outputs."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.helpers import free_port, get, post, sse

pytest.importorskip("sglang_router", reason="sglang-router==0.3.2 is a test extra")


@pytest.fixture(scope="module")
def gateway(fleet, tmp_path_factory):
    _, prefill, d1, d2 = fleet
    port = free_port()
    log = tmp_path_factory.mktemp("gw") / "gateway.log"
    argv = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--pd-disaggregation",
        "--prefill",
        prefill.url,
        str(prefill.bootstrap_port),
        "--decode",
        d1.url,
        "--decode",
        d2.url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn",
    ]
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            status, out = get(url + "/readiness", timeout=2)
            if status == 200 and out.get("healthy_workers") == 3:
                break
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"sglang-router not ready:\n{log.read_text()[-2000:]}")
        time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=15)


REQUESTS = [
    {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
    {"text": "zzz", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "stop": ["}"]}},
    {"input_ids": [[1, 2, 3], [9, 8], [7] * 30], "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    {"text": "sampled", "sampling_params": {"max_new_tokens": 10, "temperature": 0.8, "sampling_seed": 5}},
    {"text": "logprobs", "return_logprob": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
]


def strip(out):
    """What must be equal: tokens, text, finish reasons, logprobs (ids and timings differ)."""
    items = out if isinstance(out, list) else [out]
    return [
        (
            o["text"],
            o["output_ids"],
            o["meta_info"]["finish_reason"],
            o["meta_info"].get("input_token_logprobs"),
            o["meta_info"].get("output_token_logprobs"),
        )
        for o in items
    ]


@pytest.mark.parametrize("body", REQUESTS, ids=range(len(REQUESTS)))
def test_generate_identical(router, gateway, body) -> None:
    a, b = post(router.url + "/generate", body), post(gateway + "/generate", body)
    assert a[0] == b[0] == 200, (a, b)
    assert strip(a[1]) == strip(b[1])


def test_stream_and_chat_identical(router, gateway) -> None:
    body = {"text": "stream both", "stream": True, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    a, b = sse(router.url + "/generate", body), sse(gateway + "/generate", body)
    assert a[-2]["output_ids"] == b[-2]["output_ids"] and a[-1] == b[-1] == "[DONE]"
    chat = {
        "model": "sim://tiny",
        "messages": [{"role": "user", "content": "same?"}],
        "max_tokens": 9,
        "temperature": 0,
    }
    a, b = post(router.url + "/v1/chat/completions", chat), post(gateway + "/v1/chat/completions", chat)
    assert a[1]["choices"][0]["message"]["content"] == b[1]["choices"][0]["message"]["content"]
