"""What RL needs from the sim: n > 1 samples per prompt, top logprobs on /generate, OpenAI
logprobs, the weight version in meta_info; the same through pdctl's PD router."""

from __future__ import annotations

import math

import pytest

from tests.helpers import RouterProcess, pd_router_args, post

SAMPLED = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 5}


@pytest.fixture(scope="module")
def pd_router(trio, tmp_path_factory):
    _, prefill, decode = trio
    router = RouterProcess(tmp_path_factory.mktemp("r"), *pd_router_args([prefill], [decode])).start("/readiness")
    yield router
    router.stop()


def test_n_samples_per_prompt_regular_and_pd(trio, pd_router):
    regular = trio[0]
    body = {"text": "group of", "sampling_params": {**SAMPLED, "n": 4}}
    status, direct = post(regular.url + "/generate", body)
    assert status == 200 and isinstance(direct, list) and len(direct) == 4
    assert len({tuple(o["output_ids"]) for o in direct}) > 1  # four different samples
    assert all(o["meta_info"]["weight_version"] == "default" for o in direct)
    status, via_pd = post(pd_router.url + "/generate", body)
    assert status == 200 and len(via_pd) == 4 and len({tuple(o["output_ids"]) for o in via_pd}) > 1
    # Greedy samples through PD equal the regular engine's, one room per sample on both legs.
    greedy = {"text": "group of", "sampling_params": {"max_new_tokens": 12, "temperature": 0, "n": 3}}
    direct_greedy = post(regular.url + "/generate", greedy)[1]
    pd_greedy = post(pd_router.url + "/generate", greedy)[1]
    assert [o["output_ids"] for o in pd_greedy] == [o["output_ids"] for o in direct_greedy]
    # A batch of 2 prompts with n 3: 6 outputs, prompt-major.
    status, batch = post(regular.url + "/generate", {"text": ["a", "b"], "sampling_params": {**SAMPLED, "n": 3}})
    assert status == 200 and len(batch) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [1] * 6


def test_top_logprobs_num_on_generate(trio, pd_router):
    body = {"text": "top", "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "top_logprobs_num": 3}
    for url in (trio[0].url, pd_router.url):
        status, out = post(url + "/generate", body)
        assert status == 200, out
        meta = out["meta_info"]
        tops = meta["output_top_logprobs"]
        assert len(tops) == len(out["output_ids"]) == 6
        for chosen, alternatives, (lp, tok, _) in zip(
            out["output_ids"], tops, meta["output_token_logprobs"], strict=True
        ):
            assert len(alternatives) == 3
            assert alternatives[0][1] == chosen == tok  # greedy: the best alternative is the token taken
            assert math.isclose(alternatives[0][0], lp, rel_tol=1e-9)
            assert alternatives[0][0] >= alternatives[1][0] >= alternatives[2][0]


def test_openai_n_and_logprobs(trio, pd_router):
    for url in (trio[0].url, pd_router.url):
        status, out = post(
            url + "/v1/completions", {"prompt": "hi", "max_tokens": 5, "n": 2, "logprobs": 2, "temperature": 0}
        )
        assert status == 200, out
        assert [c["index"] for c in out["choices"]] == [0, 1]
        lp = out["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
        assert all(len(top) <= 2 for top in lp["top_logprobs"])
        status, chat = post(
            url + "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "logprobs": True,
                "top_logprobs": 2,
                "temperature": 0,
            },
        )
        assert status == 200, chat
        content = chat["choices"][0]["logprobs"]["content"]
        assert len(content) == chat["usage"]["completion_tokens"]
        assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    status, out = post(trio[0].url + "/v1/completions", {"prompt": "hi", "n": 1025})  # over --sim-max-n
    assert status == 400
