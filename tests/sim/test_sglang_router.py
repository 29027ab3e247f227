"""The real sglang-router 0.3.2 (Rust gateway) drives sim engines in PD mode."""

from __future__ import annotations

import pytest

from tests.helpers import get, post, sglang_router, sse

pytest.importorskip("sglang_router", reason="sglang-router==0.3.2 is a test extra")


@pytest.fixture(scope="module")
def gateway(trio, tmp_path_factory):
    _, prefill, decode = trio
    with sglang_router(tmp_path_factory.mktemp("gw"), [prefill], [decode], expect_workers=2) as url:
        yield url


def test_registration_sees_both_roles(gateway, trio) -> None:
    _, prefill, _ = trio
    workers = get(gateway + "/workers")[1]["workers"]
    roles = {w["worker_type"]: w for w in workers}
    assert set(roles) == {"prefill", "decode"}
    assert roles["prefill"]["bootstrap_port"] == prefill.bootstrap_port
    assert roles["decode"]["metadata"]["disaggregation_mode"] == "decode"


def test_generate_single_and_batch_equal_non_pd(gateway, trio) -> None:
    regular = trio[0]
    for prompt in ("The capital of France is", "router test", "x" * 50):
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 20, "temperature": 0}}
        status, out = post(gateway + "/generate", body)
        assert status == 200, out
        assert out["output_ids"] == post(regular.url + "/generate", body)[1]["output_ids"]
    batch = {"input_ids": [[1, 2, 3], [4, 5], [6] * 20], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    status, out = post(gateway + "/generate", batch)
    assert status == 200, out
    ref = post(regular.url + "/generate", batch)[1]
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]


def test_stream_equals_non_pd(gateway, trio) -> None:
    body = {
        "text": "stream through the gateway",
        "stream": True,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0},
    }
    out = sse(gateway + "/generate", body)
    ref = sse(trio[0].url + "/generate", body)
    assert out[-1] == "[DONE]" and out[-2]["output_ids"] == ref[-2]["output_ids"]


def test_chat_completions_equal_non_pd(gateway, trio) -> None:
    body = {
        "model": "sim://tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    status, out = post(gateway + "/v1/chat/completions", body)
    assert status == 200, out
    ref = post(trio[0].url + "/v1/chat/completions", body)[1]
    assert out["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
