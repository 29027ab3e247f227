"""An OpenAI stream whose decode is killed mid-answer goes on, on another decode, as one stream:
driven with the OpenAI SDK (streamed chat and completions, greedy), the decode serving it killed
with kill -9 after some chunks. The client gets a 200, no error, every token of its budget, and
the text of a bare engine's greedy answer (the sim's byte vocabulary re-tokenizes the seam
exactly). It died with the decode before ("failed mid-stream: connection closed"). With SGLang's
``--stream-interval 4`` a chunk holds four tokens: the router counts the tokens sent with the
engines' /v1/tokenize, not the chunks (it asked for four times too many before)."""

from __future__ import annotations

import os
import signal

import openai
import pytest

from tests.helpers import RouterProcess, SimProcess, eventually, get, pd_router_args, post, sims

TOKENS = 48
PACED = ("--sim-decode-ms-per-step", "25")  # a stream lasts over a second: the kill lands inside it


@pytest.fixture(params=[1, 4], ids=["stream_interval_1", "stream_interval_4"])
def fleet(tmp_path, request):
    decode = ("--disaggregation-mode", "decode", *PACED, "--stream-interval", str(request.param))
    specs = [("--disaggregation-mode", "prefill"), decode, decode, ()]
    with sims(tmp_path, *specs) as procs:
        prefill, d1, d2, bare = procs
        router = RouterProcess(tmp_path, *pd_router_args([prefill], [d1, d2], "--health-check-interval-secs", "1"))
        router.start("/readiness")
        try:
            yield router, (d1, d2), bare
        finally:
            router.stop()


def busy_decode(decodes: tuple[SimProcess, ...]) -> SimProcess:
    """The decode running the stream (its /server_info counts it)."""

    def running(d: SimProcess) -> int:
        info = get(d.url + "/server_info")[1]
        return sum(s.get("num_running_reqs", 0) for s in info.get("internal_states", []))

    return eventually(lambda: next((d for d in decodes if running(d)), None), 30, what="the decode of the stream")


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_an_openai_stream_outlives_its_decode(fleet, route) -> None:
    router, decodes, bare = fleet
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompt = "the decode dies in the middle"
    if route == "chat":
        messages = [{"role": "user", "content": prompt}]
        stream = client.chat.completions.create(
            model="sim", messages=messages, max_tokens=TOKENS, temperature=0, stream=True
        )
        reference = post(
            bare.url + "/v1/chat/completions",
            {"model": "sim", "messages": messages, "max_tokens": TOKENS, "temperature": 0},
        )[1]
        expected = reference["choices"][0]["message"]["content"]  # fmt: skip
    else:
        stream = client.completions.create(model="sim", prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True)
        reference = post(
            bare.url + "/v1/completions", {"model": "sim", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
        )[1]
        expected = reference["choices"][0]["text"]  # fmt: skip
    text, ids, finish, killed = [], set(), None, None
    for chunk in stream:  # the SDK raises on an error event or a broken stream
        ids.add(chunk.id)
        for choice in chunk.choices:
            piece = choice.delta.content if route == "chat" else choice.text
            if piece:
                text.append(piece)
            finish = choice.finish_reason or finish
        if len("".join(text)) >= 8 and killed is None:
            killed = busy_decode(decodes)
            os.killpg(killed.proc.pid, signal.SIGKILL)
    assert killed is not None and killed.proc.wait(timeout=30) is not None
    assert finish == "length", finish
    assert "".join(text) == expected  # greedy: the continuation is the answer it would have been
    assert len(ids) == 1, ids  # one stream, one id
