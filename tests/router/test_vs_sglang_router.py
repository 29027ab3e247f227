"""The same requests through pdctl router and the real sglang-router 0.3.2, against the same
sim engines, give identical outputs."""

from __future__ import annotations

import pytest

from tests.helpers import post, sglang_router, sse

pytest.importorskip("sglang_router", reason="sglang-router==0.3.2 is a test extra")


@pytest.fixture(scope="module")
def gateway(fleet, tmp_path_factory):
    _, prefill, d1, d2 = fleet
    with sglang_router(tmp_path_factory.mktemp("gw"), [prefill], [d1, d2], expect_workers=3) as url:
        yield url


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
