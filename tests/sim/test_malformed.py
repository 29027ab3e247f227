"""Malformed bodies (hardening issue): every body SGLang 0.5.23 refuses gets the sim's 400 in the
shape of the stage that refuses it in SGLang, with a message naming the field; the sim keeps
serving after each. The same table through pdctl's router in front of a prefill + decode pair:
each is answered 4xx and the fleet still serves. Real processes, one sim (or fleet) per module."""

from __future__ import annotations

import json

import pytest

from tests.helpers import RouterProcess, SimProcess, get, http, pd_router_args, post, sims

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 256
# Small bounds so that the sim's own limits are cheap to reach (the defaults are the router's).
FLAGS = ("--context-length", str(CONTEXT), "--sim-max-n", "8", "--sim-max-sequences-per-request", "16")
FLAGS += ("--sim-max-request-tokens", "1000")
GOOD = {"text": "ok", "sampling_params": {"max_new_tokens": 1}}

GEN, CMPL, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
# The stage that refuses a body in SGLang, as the answer's shape shows it:
PYDANTIC = "pydantic"  # 400 {"object": "error", "message", "type": "Bad Request", ...}
CONTRACT = "contract"  # 400 {"error": "<text>"} (/generate's strict JSON decoder)
VALUE = "value"  # 400 {"error": {"message"}} on /generate, type BadRequestError on the OpenAI routes


def _sp(**params) -> dict:
    return {"text": "a", "sampling_params": params}


def _cmpl(**fields) -> dict:
    return {"model": "m", "prompt": "a", **fields}


def _chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


CASES = [
    # /generate, pydantic's parse of GenerateReqInput
    (GEN, [1, 2], PYDANTIC, "must be a JSON object"),
    (GEN, b"{not json", PYDANTIC, "invalid JSON"),
    (GEN, {"text": 5}, PYDANTIC, "text: Input should be a valid string"),
    (GEN, {"input_ids": "abc"}, PYDANTIC, "must be list or null; got str"),
    (GEN, {"input_ids": [1.0, 2]}, PYDANTIC, "elements must be int or list; got float"),
    (GEN, {"input_ids": [1, "a"]}, PYDANTIC, "contains non-int64 element"),
    (GEN, {"input_ids": [1, 2**63]}, PYDANTIC, "contains non-int64 element"),
    (GEN, {"input_ids": [[[1]]]}, PYDANTIC, "row 0: elements must be int; got list"),
    (GEN, {"text": "a", "rid": 5}, PYDANTIC, "rid: Input should be a valid string"),
    (GEN, {"text": "a", "sampling_params": "x"}, PYDANTIC, "sampling_params: Input should be a valid dictionary"),
    (GEN, {"text": "a", "stream": "maybe"}, PYDANTIC, "stream: Input should be a valid boolean"),
    (GEN, {"text": "a", "stream": None}, PYDANTIC, "stream: Input should be a valid boolean"),
    # /generate, the strict JSON contract (bool is never int, float never int)
    (GEN, {"text": "a", "stream": "yes"}, CONTRACT, 'stream: invalid type: string "yes", expected a boolean'),
    (GEN, _sp(foo=1), CONTRACT, "unknown field `foo`, expected one of `max_new_tokens`, `stop`"),
    (GEN, _sp(max_new_tokens="5"), CONTRACT, 'max_new_tokens: invalid type: string "5", expected i64'),
    (GEN, _sp(max_new_tokens=5.0), CONTRACT, "max_new_tokens: invalid type: floating point `5.0`, expected i64"),
    (GEN, _sp(n=True), CONTRACT, "n: invalid type: boolean `true`, expected i64"),
    (GEN, _sp(temperature="hot"), CONTRACT, 'temperature: invalid type: string "hot", expected f64'),
    (GEN, _sp(stop=["a", 5]), CONTRACT, "stop[1]: invalid type: integer `5`, expected a string"),
    (GEN, {"input_ids": [True]}, CONTRACT, "input_ids[0]: invalid type: boolean `true`, expected a sequence"),
    (GEN, {"text": "a", "return_logprob": "yes"}, CONTRACT, "expected a value or an array of values for BoolOrList"),
    # /generate, normalize_batch_and_arguments
    (GEN, {}, VALUE, "Either text, input_ids or input_embeds should be provided."),
    (GEN, {"input_ids": []}, VALUE, "input_ids cannot be empty."),
    (GEN, {"input_ids": [[]]}, VALUE, "input_ids cannot be empty."),
    (GEN, {"text": []}, VALUE, "text cannot be an empty list"),
    (GEN, {"text": ""}, VALUE, "text cannot be empty"),
    (GEN, {"text": "a", "sampling_params": []}, VALUE, "sampling_params cannot be an empty list"),
    (GEN, {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, VALUE, "parallel_sample_num should be"),
    (GEN, {"text": ["a", "b"], "rid": ["x", "x"]}, VALUE, "Duplicate request IDs detected within the request: ['x']"),
    (GEN, {"text": ["a", "b"], "rid": ["x"]}, VALUE, "The specified rids length mismatch with the batch_size"),
    (GEN, {"text": ["a", "b"], "sampling_params": [{}]}, VALUE, "sampling_params has 1 items for a batch of 2"),
    (GEN, {"text": ["a", "b"], "return_logprob": [True, False], "sampling_params": {"n": 2}}, VALUE, "Cannot use list"),
    # /generate, the vocabulary (the sim's own check) and the context length
    (GEN, {"input_ids": [1, 260]}, VALUE, "out-of-vocabulary token id 260; valid range is [0, 260)."),
    (GEN, {"input_ids": [[1], [-1]]}, VALUE, "out-of-vocabulary token id -1"),
    (GEN, {"text": "a" * CONTEXT}, VALUE, f"The input ({CONTEXT} tokens) is longer than the model's context length"),
    (GEN, _sp(max_new_tokens=CONTEXT), VALUE, f"You requested a total of {CONTEXT + 1} tokens: 1 tokens from the"),
    # /generate, SamplingParams.normalize and verify
    (GEN, _sp(temperature=-1), VALUE, "temperature must be a non-negative finite number, got -1."),
    (GEN, _sp(top_p=0), VALUE, "top_p must be in (0, 1], got 0."),
    (GEN, _sp(min_p=2), VALUE, "min_p must be in [0, 1], got 2."),
    (GEN, _sp(top_k=0), VALUE, "top_k must be -1 (disable) or at least 1, got 0."),
    (GEN, _sp(frequency_penalty=3), VALUE, "frequency_penalty must be in [-2, 2], got 3."),
    (GEN, _sp(presence_penalty=-2.5), VALUE, "presence_penalty must be in [-2, 2], got -2.5."),
    (GEN, _sp(repetition_penalty=0), VALUE, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0."),
    (GEN, _sp(max_new_tokens=-1), VALUE, "max_new_tokens must be at least 0, got -1."),
    (GEN, _sp(max_new_tokens=5, min_new_tokens=6), VALUE, "min_new_tokens must be in [0, max_new_tokens(5)], got 6."),
    (GEN, _sp(stop=["x"] * 33), VALUE, "at most 32 stop strings are allowed, got 33"),
    (GEN, _sp(logit_bias={"999": 1.0}), VALUE, "logit_bias must has keys in [0, 259], got 999."),
    (GEN, _sp(sampling_seed=2**63), VALUE, "sampling_seed must be in [-2**63, 2**63 - 1]"),
    (GEN, _sp(regex="a+"), VALUE, "sampling_params.regex is not supported by the sim engine"),
    # /generate, the sim's bounds (SGLang has none)
    (GEN, _sp(n=9), VALUE, "--sim-max-n 8"),
    (GEN, {"text": ["a", "b", "c"], "sampling_params": {"n": 8}}, VALUE, "--sim-max-sequences-per-request 16"),
    (GEN, {"text": ["a" * 200] * 3, "sampling_params": {"n": 2}}, VALUE, "--sim-max-request-tokens 1000"),
    # /v1/completions, pydantic's parse of CompletionRequest
    (CMPL, [1], PYDANTIC, "must be a JSON object"),
    (CMPL, "just a string", PYDANTIC, "must be a JSON object"),
    (CMPL, {"model": "m"}, PYDANTIC, "prompt: Field required"),
    (CMPL, _cmpl(prompt=5), PYDANTIC, "prompt: Input should be"),
    (CMPL, _cmpl(prompt=None), PYDANTIC, "prompt: Input should be"),
    (CMPL, _cmpl(prompt={"text": "a"}), PYDANTIC, "prompt: Input should be"),
    (CMPL, _cmpl(prompt=["a", 1]), PYDANTIC, "prompt: Input should be"),
    (CMPL, _cmpl(prompt=[[1], "a"]), PYDANTIC, "prompt: Input should be"),
    (CMPL, _cmpl(prompt=[1.5, 2]), PYDANTIC, "prompt: Input should be"),
    (CMPL, _cmpl(prompt=[[[1]]]), PYDANTIC, "prompt: Input should be"),
    (CMPL, _cmpl(model=5), PYDANTIC, "model: Input should be a valid string"),
    (CMPL, _cmpl(max_tokens=0), PYDANTIC, "max_tokens must be positive"),
    (CMPL, _cmpl(max_tokens=5.5), PYDANTIC, "max_tokens: Input should be a valid integer"),
    (CMPL, _cmpl(max_tokens="many"), PYDANTIC, "max_tokens: Input should be a valid integer"),
    (CMPL, _cmpl(max_tokens=None), PYDANTIC, "max_tokens: Input should be a valid integer"),
    (CMPL, _cmpl(min_tokens="x"), PYDANTIC, "min_tokens: Input should be a valid integer"),
    (CMPL, _cmpl(stream="maybe"), PYDANTIC, "stream: Input should be a valid boolean"),
    (CMPL, _cmpl(stream=None), PYDANTIC, "stream: Input should be a valid boolean"),
    (CMPL, _cmpl(stream=True, stream_options="yes"), PYDANTIC, "stream_options: Input should be a valid dictionary"),
    (CMPL, _cmpl(stream=True, stream_options={"include_usage": "maybe"}), PYDANTIC, "Input should be a valid boolean"),
    (CMPL, _cmpl(n="x"), PYDANTIC, "n: Input should be a valid integer"),
    (CMPL, _cmpl(n=2.5), PYDANTIC, "n: Input should be a valid integer"),
    (CMPL, _cmpl(temperature=None), PYDANTIC, "temperature: Input should be a valid number"),
    (CMPL, _cmpl(temperature="hot"), PYDANTIC, "temperature: Input should be a valid number"),
    (CMPL, _cmpl(top_p="high"), PYDANTIC, "top_p: Input should be a valid number"),
    (CMPL, _cmpl(top_k="all"), PYDANTIC, "top_k: Input should be a valid integer"),
    (CMPL, _cmpl(frequency_penalty="x"), PYDANTIC, "frequency_penalty: Input should be a valid number"),
    (CMPL, _cmpl(presence_penalty=None), PYDANTIC, "presence_penalty: Input should be a valid number"),
    (CMPL, _cmpl(stop=5), PYDANTIC, "stop: Input should be a valid string"),
    (CMPL, _cmpl(stop=["a", None]), PYDANTIC, "stop: Input should be a valid string"),
    (CMPL, _cmpl(stop_token_ids=5), PYDANTIC, "stop_token_ids: Input should be a valid list"),
    (CMPL, _cmpl(stop_token_ids=["a"]), PYDANTIC, "stop_token_ids: Input should be a valid integer"),
    (CMPL, _cmpl(logprobs="yes"), PYDANTIC, "logprobs: Input should be a valid integer"),
    (CMPL, _cmpl(logprobs=1.5), PYDANTIC, "logprobs: Input should be a valid integer"),
    (CMPL, _cmpl(echo="maybe"), PYDANTIC, "echo: Input should be a valid boolean"),
    (CMPL, _cmpl(echo=None), PYDANTIC, "echo: Input should be a valid boolean"),
    (CMPL, _cmpl(seed="abc"), PYDANTIC, "seed: Input should be a valid integer"),
    (CMPL, _cmpl(seed=1.5), PYDANTIC, "seed: Input should be a valid integer"),
    (CMPL, _cmpl(logit_bias=[1, 2]), PYDANTIC, "logit_bias: Input should be a valid dictionary"),
    (CMPL, _cmpl(logit_bias={"5": "big"}), PYDANTIC, "logit_bias: Input should be a valid number"),
    (CMPL, _cmpl(ignore_eos="maybe"), PYDANTIC, "ignore_eos: Input should be a valid boolean"),
    (CMPL, _cmpl(json_schema={"type": "object"}), PYDANTIC, "json_schema: Input should be a valid string"),
    (CMPL, _cmpl(rid=5), PYDANTIC, "rid: Input should be a valid string"),
    # /v1/completions, _validate_request and the later stages shared with /generate
    (CMPL, _cmpl(prompt=""), VALUE, "Prompt cannot be empty"),
    (CMPL, _cmpl(prompt=[]), VALUE, "Prompt cannot be empty"),
    (CMPL, _cmpl(prompt=["", ""]), VALUE, "Prompt cannot be empty"),
    (CMPL, _cmpl(prompt=[[1], []]), VALUE, "prompt cannot be empty."),
    (CMPL, _cmpl(prompt="a" * 300), VALUE, "The input (300 tokens) is longer than the model's context length (256"),
    (CMPL, _cmpl(max_tokens=CONTEXT), VALUE, "Requested token count exceeds the model's maximum context length"),
    (CMPL, _cmpl(temperature=-1, stream=True), VALUE, "temperature must be a non-negative finite number, got -1.0."),
    (CMPL, _cmpl(temperature="inf"), VALUE, "temperature must be a non-negative finite number, got inf."),
    (CMPL, _cmpl(top_p=2), VALUE, "top_p must be in (0, 1], got 2.0."),
    (CMPL, _cmpl(top_p=0), VALUE, "top_p must be in (0, 1], got 0.0."),
    (CMPL, _cmpl(top_k=0), VALUE, "top_k must be -1 (disable) or at least 1, got 0."),
    (CMPL, _cmpl(min_p=1.5), VALUE, "min_p must be in [0, 1], got 1.5."),
    (CMPL, _cmpl(frequency_penalty=5), VALUE, "frequency_penalty must be in [-2, 2], got 5.0."),
    (CMPL, _cmpl(presence_penalty=-3), VALUE, "presence_penalty must be in [-2, 2], got -3.0."),
    (CMPL, _cmpl(repetition_penalty=3), VALUE, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 3.0."),
    (CMPL, _cmpl(min_tokens=-1), VALUE, "min_new_tokens must be in [0, max_new_tokens], got -1."),
    (CMPL, _cmpl(max_tokens=2, min_tokens=5), VALUE, "min_new_tokens must be in [0, max_new_tokens(2)], got 5."),
    (CMPL, _cmpl(stop=["x"] * 33), VALUE, "at most 32 stop strings are allowed, got 33"),
    (CMPL, _cmpl(logit_bias={"999": 1}), VALUE, "logit_bias must has keys in [0, 259], got 999."),
    (CMPL, _cmpl(logit_bias={"abc": 1}), VALUE, "logit_bias: invalid literal for int() with base 10: 'abc'"),
    (CMPL, _cmpl(seed=2**63), VALUE, "sampling_seed must be in [-2**63, 2**63 - 1]"),
    (CMPL, _cmpl(regex="a", ebnf="b"), VALUE, "Only one of json_schema, regex, ebnf, or structural_tag can be set."),
    (CMPL, _cmpl(prompt=["a", "b"], bootstrap_room=[1]), VALUE, "bootstrap_room has 1 items for a batch of 2"),
    # /v1/completions, the sim's own checks (SGLang has none; the sim refuses rather than crash,
    # allocate without bound or silently ignore what it cannot honour)
    (CMPL, _cmpl(prompt=[1, 999]), VALUE, "prompt contains out-of-vocabulary token id 999"),
    (CMPL, _cmpl(prompt=[-1]), VALUE, "prompt contains out-of-vocabulary token id -1"),
    (CMPL, _cmpl(prompt=[[1, 2], [3, 260]]), VALUE, "out-of-vocabulary token id 260; valid range is [0, 260)."),
    (CMPL, _cmpl(logprobs=21), VALUE, "top_logprobs must be an integer in [0, 20]"),  # OpenAI's bound
    (CMPL, _cmpl(ebnf="root ::= 'a'"), VALUE, "sampling_params.ebnf is not supported by the sim engine"),
    (CMPL, _cmpl(n=9), VALUE, "--sim-max-n 8"),
    (CMPL, _cmpl(n=10**6), VALUE, "n = 1000000 is more than this sim engine allows (--sim-max-n 8)"),
    (CMPL, _cmpl(prompt=["a"] * 17), VALUE, "17 sequences, more than this sim engine allows in one request"),
    (CMPL, _cmpl(prompt=["a" * 201] * 5), VALUE, "--sim-max-request-tokens 1000"),
    # /v1/chat/completions, pydantic's parse of ChatCompletionRequest (messages first)
    # A body that is no object: the sim's 400 is deliberate (SGLang 0.5.23's model_validator
    # calls .get on it and answers 500).
    (CHAT, [1], PYDANTIC, "must be a JSON object"),
    (CHAT, {"model": "m"}, PYDANTIC, "messages: Field required"),
    (CHAT, {"messages": "hi"}, PYDANTIC, "messages: Input should be a valid list"),
    (CHAT, {"messages": None}, PYDANTIC, "messages: Input should be a valid list"),
    (CHAT, {"messages": {"role": "user", "content": "hi"}}, PYDANTIC, "messages: Input should be a valid list"),
    (CHAT, {"messages": ["hi"]}, PYDANTIC, "Input should be a valid dictionary"),
    (CHAT, {"messages": [None]}, PYDANTIC, "message 0: Input should be a valid dictionary"),
    (CHAT, {"messages": [[{"role": "user", "content": "hi"}]]}, PYDANTIC, "message 0: Input should be a valid dict"),
    (CHAT, {"messages": [{"role": "bogus", "content": "x"}]}, PYDANTIC, "'role' must be 'user' or one of system"),
    (CHAT, {"messages": [{"role": "User", "content": "x"}]}, PYDANTIC, "'role' must be 'user' or one of system"),
    (CHAT, {"messages": [{"role": 5, "content": "x"}]}, PYDANTIC, "'role' must be 'user' or one of system"),
    (CHAT, {"messages": [{"content": "x"}]}, PYDANTIC, "'role' must be 'user' or one of system"),
    (CHAT, {"messages": [{"role": "user"}]}, PYDANTIC, "content: Field required"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, PYDANTIC, "content: Field required"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, PYDANTIC, "content must be a string or a list of content"),
    (CHAT, {"messages": [{"role": "system", "content": True}]}, PYDANTIC, "content must be a string or a list of"),
    (CHAT, {"messages": [{"role": "user", "content": {"text": "x"}}]}, PYDANTIC, "content must be a string or a list"),
    (CHAT, {"messages": [{"role": "user", "content": ["x"]}]}, PYDANTIC, "content must be a string or a list"),
    (CHAT, {"messages": [{"role": "user", "content": [{"text": "x"}]}]}, PYDANTIC, "content must be a string or a"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, PYDANTIC, "content must be"),
    (CHAT, _chat(model=None), PYDANTIC, "model: Input should be a valid string"),
    (CHAT, _chat(max_tokens="many"), PYDANTIC, "max_tokens: Input should be a valid integer"),
    (CHAT, _chat(max_tokens=1.5), PYDANTIC, "max_tokens: Input should be a valid integer"),
    (CHAT, _chat(max_completion_tokens="x"), PYDANTIC, "max_completion_tokens: Input should be a valid integer"),
    (CHAT, _chat(min_tokens="x"), PYDANTIC, "min_tokens: Input should be a valid integer"),
    (CHAT, _chat(n=None), PYDANTIC, "n: Input should be a valid integer"),
    (CHAT, _chat(temperature="hot"), PYDANTIC, "temperature: Input should be a valid number"),
    (CHAT, _chat(top_p="x"), PYDANTIC, "top_p: Input should be a valid number"),
    (CHAT, _chat(top_k=2.5), PYDANTIC, "top_k: Input should be a valid integer"),
    (CHAT, _chat(repetition_penalty="x"), PYDANTIC, "repetition_penalty: Input should be a valid number"),
    (CHAT, _chat(frequency_penalty=None), PYDANTIC, "frequency_penalty: Input should be a valid number"),
    (CHAT, _chat(presence_penalty="x"), PYDANTIC, "presence_penalty: Input should be a valid number"),
    (CHAT, _chat(stop=5), PYDANTIC, "stop: Input should be a valid string"),
    (CHAT, _chat(stop=[1]), PYDANTIC, "stop: Input should be a valid string"),
    (CHAT, _chat(stop_token_ids="x"), PYDANTIC, "stop_token_ids: Input should be a valid list"),
    (CHAT, _chat(logprobs="maybe"), PYDANTIC, "logprobs: Input should be a valid boolean"),
    (CHAT, _chat(logprobs=2), PYDANTIC, "logprobs: Input should be a valid boolean"),
    (CHAT, _chat(logprobs=True, top_logprobs="x"), PYDANTIC, "top_logprobs: Input should be a valid integer"),
    (CHAT, _chat(stream=None), PYDANTIC, "stream: Input should be a valid boolean"),
    (CHAT, _chat(stream=True, stream_options="x"), PYDANTIC, "stream_options: Input should be a valid dictionary"),
    (CHAT, _chat(stream=True, stream_options={"include_usage": "x"}), PYDANTIC, "Input should be a valid boolean"),
    (CHAT, _chat(seed="x"), PYDANTIC, "seed: Input should be a valid integer"),
    (CHAT, _chat(logit_bias=[1]), PYDANTIC, "logit_bias: Input should be a valid dictionary"),
    (CHAT, _chat(logit_bias={"1": "x"}), PYDANTIC, "logit_bias: Input should be a valid number"),
    (CHAT, _chat(ignore_eos="x"), PYDANTIC, "ignore_eos: Input should be a valid boolean"),
    (CHAT, _chat(ebnf=5), PYDANTIC, "ebnf: Input should be a valid string"),
    (CHAT, _chat(stop_regex=[5]), PYDANTIC, "stop_regex: Input should be a valid string"),
    (CHAT, _chat(rid=5), PYDANTIC, "rid: Input should be a valid string"),
    # /v1/chat/completions, _validate_request and the later stages shared with /generate
    (CHAT, {"messages": []}, VALUE, "Messages cannot be empty."),
    (CHAT, _chat(messages=[{"role": "user", "content": "a" * 300}]), VALUE, "is longer than the model's context"),
    (CHAT, _chat(max_completion_tokens=CONTEXT), VALUE, "Requested token count exceeds the model's maximum context"),
    (CHAT, _chat(max_completion_tokens=-1), VALUE, "max_new_tokens must be at least 0, got -1."),
    (CHAT, _chat(max_tokens=-5), VALUE, "max_new_tokens must be at least 0, got -5."),
    (CHAT, _chat(min_tokens=-1), VALUE, "min_new_tokens must be in [0, max_new_tokens], got -1."),
    (CHAT, _chat(max_tokens=2, min_tokens=5), VALUE, "min_new_tokens must be in [0, max_new_tokens(2)], got 5."),
    (CHAT, _chat(temperature=-1), VALUE, "temperature must be a non-negative finite number, got -1.0."),
    (CHAT, _chat(temperature="inf", stream=True), VALUE, "temperature must be a non-negative finite number, got inf."),
    (CHAT, _chat(top_p=1.5), VALUE, "top_p must be in (0, 1], got 1.5."),
    (CHAT, _chat(top_k=0), VALUE, "top_k must be -1 (disable) or at least 1, got 0."),
    (CHAT, _chat(min_p=2), VALUE, "min_p must be in [0, 1], got 2.0."),
    (CHAT, _chat(repetition_penalty=0), VALUE, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0.0."),
    (CHAT, _chat(frequency_penalty=-3), VALUE, "frequency_penalty must be in [-2, 2], got -3.0."),
    (CHAT, _chat(presence_penalty=2.5), VALUE, "presence_penalty must be in [-2, 2], got 2.5."),
    (CHAT, _chat(stop=["x"] * 33), VALUE, "at most 32 stop strings are allowed, got 33"),
    (CHAT, _chat(logit_bias={"500": 1}), VALUE, "logit_bias must has keys in [0, 259], got 500."),
    (CHAT, _chat(logit_bias={"x": 1}), VALUE, "logit_bias: invalid literal for int() with base 10: 'x'"),
    (CHAT, _chat(seed=2**63), VALUE, "sampling_seed must be in [-2**63, 2**63 - 1]"),
    (CHAT, _chat(regex="a", ebnf="b"), VALUE, "Only one of json_schema, regex, ebnf, or structural_tag can be set."),
    # /v1/chat/completions, the sim's own checks (SGLang has none)
    (CHAT, _chat(logprobs=True, top_logprobs=50), VALUE, "top_logprobs must be an integer in [0, 20]"),  # OpenAI's
    (CHAT, _chat(regex="a+"), VALUE, "sampling_params.regex is not supported by the sim engine"),
    (CHAT, _chat(n=10**6), VALUE, "n = 1000000 is more than this sim engine allows (--sim-max-n 8)"),
]


def send(url: str, route: str, body, headers: dict | None = None) -> tuple[int, object]:
    raw = body if isinstance(body, bytes) else None
    return http("POST", url + route, None if raw else body, raw=raw, headers=headers)


def check_refused(status: int, out: object, route: str, stage: str, needle: str) -> None:
    """A 400 whose body has the shape of SGLang's answer for ``stage`` and holds ``needle``."""
    assert status == 400, (status, out)
    assert isinstance(out, dict), out
    if stage == PYDANTIC:
        assert out["object"] == "error" and out["type"] == "Bad Request" and out["code"] == 400, out
        message = out["message"]
    elif stage == CONTRACT:
        assert isinstance(out["error"], str), out
        message = out["error"]
    elif route == GEN:
        message = out["error"]["message"]
    else:
        assert out["object"] == "error" and out["type"] == "BadRequestError" and out["code"] == 400, out
        message = out["message"]
    assert needle in message, (needle, message)


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    proc = SimProcess(tmp_path_factory.mktemp("malformed"), *FLAGS, "--api-key", KEY)
    yield proc.start()
    proc.stop()


@pytest.mark.parametrize(("route", "body", "stage", "needle"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_refused_with_sglangs_status_and_shape(sim, route, body, stage, needle) -> None:
    check_refused(*send(sim.url, route, body, AUTH), route, stage, needle)
    assert post(sim.url + GEN, GOOD, headers=AUTH)[0] == 200


def test_openai_routes_want_json_content_type(sim) -> None:
    for route in (CMPL, CHAT):
        headers = {**AUTH, "Content-Type": "text/plain"}
        status, out = http("POST", sim.url + route, raw=b'{"prompt": "a"}', headers=headers)
        check_refused(status, out, route, PYDANTIC, "Unsupported Media Type: Only 'application/json' is allowed")


def test_a_streamed_generate_gets_later_errors_as_an_event(sim) -> None:
    """SGLang's /generate with stream=true: a later stage's ValueError is the one event of a
    200 stream, then [DONE], written as SGLang writes it (orjson: compact); the parse stages
    still answer 400."""
    status, text = http("POST", sim.url + GEN, {**_sp(temperature=-1), "stream": True}, headers=AUTH)
    message = "temperature must be a non-negative finite number, got -1."
    error = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
    assert status == 200 and text == f"data: {json.dumps({'error': error}, separators=(',', ':'))}\n\ndata: [DONE]\n\n"
    status, out = http("POST", sim.url + GEN, {**_sp(max_new_tokens="5"), "stream": True}, headers=AUTH)
    check_refused(status, out, GEN, CONTRACT, "expected i64")


def test_what_sglang_accepts_the_sim_accepts(sim) -> None:
    """Both text and input_ids: input_ids are the prompt (the batch's shape is text's); n <= 1 is
    one sample; pydantic's coercions on the OpenAI routes ("3" is 3, "no" is false)."""
    status, out = post(sim.url + GEN, {"text": "zzzz", "input_ids": [104, 105], **GOOD}, headers=AUTH)
    assert status == 200 and out["meta_info"]["prompt_tokens"] == 2
    for n in (0, -3, 1):
        status, out = post(sim.url + GEN, _sp(n=n, max_new_tokens=1), headers=AUTH)
        assert status == 200 and isinstance(out, dict), (n, out)
    status, out = post(sim.url + CMPL, _cmpl(max_tokens="3", stream="no", n=1.0, temperature="0"), headers=AUTH)
    assert status == 200 and out["usage"]["completion_tokens"] <= 3
    batch = {"text": ["a", "b"], "rid": "r", "sampling_params": {"n": 2, "max_new_tokens": 1}}
    status, out = post(sim.url + GEN, batch, headers=AUTH)
    assert status == 200 and [o["meta_info"]["id"] for o in out] == ["r_0", "r_1", "r_2", "r_3"]


def test_api_key_as_sglang_checks_it(sim) -> None:
    """``Authorization: <scheme> <key>``, the scheme Bearer in any case; /health*, /ready*,
    /metrics* open; every other path (unknown ones too) 401 {"error": "Unauthorized"}."""
    for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer nope"}):
        assert post(sim.url + GEN, GOOD, headers=headers) == (401, {"error": "Unauthorized"}), headers
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert post(sim.url + GEN, GOOD, headers={"Authorization": f"{scheme} {KEY}"})[0] == 200, scheme
    for path in ("/model_info", "/v1/models", "/server_info", "/no/such/path"):
        assert get(sim.url + path)[0] == 401, path
    assert get(sim.url + "/no/such/path", headers=AUTH)[0] == 404
    for path in ("/health", "/ready", "/health_generate"):
        assert get(sim.url + path)[0] == 200, path
    assert get(sim.url + "/metrics")[0] == 404  # open (no key asked), off without --enable-metrics
    # a header that is not ASCII is a 401, not a crash (SGLang's compare_digest on str would raise)
    assert post(sim.url + GEN, GOOD, headers={"Authorization": "Bearer s3crét"})[0] == 401


def test_no_traceback_in_the_log(sim) -> None:
    assert get(sim.url + "/health")[0] == 200
    assert "Traceback" not in sim.log.read_text()


# -- through pdctl's router, in front of a prefill + decode pair ---------------------------------
# (Not the non-JSON one, nor those about bootstrap_* fields: the router sets those itself.)
ROUTER_CASES = [c for c in CASES if isinstance(c[1], dict | list) and "bootstrap_room" not in c[1]]


@pytest.fixture(scope="module")
def pd_router(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd-malformed")
    with sims(tmp, ("--disaggregation-mode", "prefill", *FLAGS), ("--disaggregation-mode", "decode", *FLAGS)) as pair:
        router = RouterProcess(tmp, *pd_router_args(pair[:1], pair[1:]))
        yield router.start("/readiness"), pair
        router.stop()


@pytest.mark.parametrize(
    ("route", "body", "stage", "needle"), ROUTER_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(ROUTER_CASES)]
)
def test_refused_through_the_pd_router(pd_router, route, body, stage, needle) -> None:
    router, _ = pd_router
    status, out = send(router.url, route, body)
    assert 400 <= status < 500 and out, (status, out)
    assert post(router.url + GEN, GOOD)[0] == 200


def test_the_pd_pair_logs_no_traceback(pd_router) -> None:
    router, pair = pd_router
    assert post(router.url + CMPL, _cmpl(max_tokens=2))[0] == 200
    for proc in pair:
        assert "Traceback" not in proc.log.read_text(), proc.log
