"""Random bodies at a real sim (hardening issue): whatever JSON arrives at /generate or
/v1/completions, the answer is an HTTP response below 500 (or 503, a full queue), never a crash
or a wedge, and the sim still answers /health afterwards with no traceback in its log.

The sim runs with a short context and small bounds so that the bodies it accepts stay cheap."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import SimProcess, get, http

FLAGS = ("--context-length", "64", "--sim-max-n", "4", "--sim-max-sequences-per-request", "8")
FLAGS += ("--sim-max-request-tokens", "256")

GENERATE_FIELDS = ["text", "input_ids", "rid", "stream", "sampling_params", "return_logprob", "logprob_start_len"]
GENERATE_FIELDS += ["top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "bootstrap_host"]
GENERATE_FIELDS += ["bootstrap_port", "bootstrap_room", "input_embeds", "priority", "custom_labels", "modalities"]
SAMPLING_FIELDS = ["max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop"]
SAMPLING_FIELDS += ["stop_token_ids", "ignore_eos", "no_stop_trim", "logit_bias", "sampling_seed", "regex"]
SAMPLING_FIELDS += ["frequency_penalty", "presence_penalty", "repetition_penalty", "watermark", "unknown"]
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "n", "stream", "stream_options", "echo", "logprobs", "seed"]
COMPLETION_FIELDS += ["temperature", "top_p", "top_k", "min_p", "min_tokens", "stop", "stop_token_ids", "logit_bias"]
COMPLETION_FIELDS += ["ignore_eos", "repetition_penalty", "rid", "bootstrap_room"]

# Values near the edges: empty, negative, huge, of the wrong type, almost right ("5", 5.0, "yes").
EDGES = st.sampled_from([None, True, False, 0, 1, -1, 2, 63, 64, 2**63 - 1, 2**63, -(2**63), 5.0, 0.5, -0.0, 1e300])
EDGES |= st.sampled_from(["", "a", "yes", "5", "5.0", "nan", "inf", " 7 ", "\u00e9\u2603", [], {}, [[]], [0], [259]])
EDGES |= st.sampled_from([[260], [-1], [1, 2], [[1], [2]], ["a", "b"], {"n": 2}, [{"n": 2}], {"0": 1.0}])
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
JSON = st.recursive(
    SCALARS | EDGES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def fields(names: list[str], values: st.SearchStrategy, max_size: int = 6) -> st.SearchStrategy:
    return st.dictionaries(st.sampled_from(names), values, max_size=max_size)


def near(valid: st.SearchStrategy, names: list[str], values: st.SearchStrategy) -> st.SearchStrategy:
    """A valid body with up to two fields replaced: most of it passes, the rest probes one rule."""
    return st.builds(lambda body, noise: {**body, **noise}, valid, fields(names, values, max_size=2))


SAMPLING = fields(SAMPLING_FIELDS, EDGES | JSON)
GENERATE = fields(GENERATE_FIELDS, EDGES | JSON | SAMPLING | st.lists(SAMPLING, max_size=3))
COMPLETION = fields(COMPLETION_FIELDS, EDGES | JSON)
# Bodies SGLang accepts, small enough to run at once.
TOKENS = st.lists(st.integers(0, 259), min_size=1, max_size=8)
VALID_SAMPLING = st.fixed_dictionaries(
    {"max_new_tokens": st.integers(0, 6)},
    optional={
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.sampled_from([-1, 1, 5]),
        "n": st.integers(-1, 3),
        "stop": st.text(max_size=2) | st.lists(st.text(min_size=1, max_size=2), max_size=2),
        "sampling_seed": st.integers(0, 2**63 - 1),
        "ignore_eos": st.booleans(),
    },
)
VALID_GENERATE = st.fixed_dictionaries(
    {"sampling_params": VALID_SAMPLING},
    optional={"stream": st.booleans(), "return_logprob": st.booleans(), "top_logprobs_num": st.integers(0, 3)},
).flatmap(
    lambda body: st.one_of(
        st.fixed_dictionaries({"text": st.text(min_size=1, max_size=12)}),
        st.fixed_dictionaries({"input_ids": TOKENS | st.lists(TOKENS, min_size=1, max_size=2)}),
    ).map(lambda prompt: {**body, **prompt})
)
VALID_COMPLETION = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=12) | TOKENS, "max_tokens": st.integers(1, 6)},
    optional={"stream": st.booleans(), "n": st.integers(1, 2), "temperature": st.floats(0, 2), "echo": st.booleans()},
)
BODIES = st.one_of(
    st.tuples(st.just("/generate"), JSON | GENERATE | near(VALID_GENERATE, GENERATE_FIELDS, EDGES | SAMPLING)),
    st.tuples(st.just("/v1/completions"), JSON | COMPLETION | near(VALID_COMPLETION, COMPLETION_FIELDS, EDGES)),
)


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    proc = SimProcess(tmp_path_factory.mktemp("fuzz"), *FLAGS)
    yield proc.start()
    proc.stop()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=BODIES)
def test_random_bodies_never_crash_the_sim(sim, case) -> None:
    route, body = case
    status, out = http("POST", sim.url + route, body, timeout=60)
    assert status < 500 or status == 503, (route, body, status, out)


def test_the_sim_is_still_up_after_the_fuzz(sim) -> None:
    assert get(sim.url + "/health")[0] == 200
    assert "Traceback" not in sim.log.read_text()
