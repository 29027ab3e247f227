"""The body rules' glance at the common /generate body agrees with reading it in full: whatever
body it lets through at a glance, the full rules let through too (hypothesis draws bodies of
every shape the rules read: batches, wrong types, n, negative and boolean token counts)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.router.body_rules import GENERATE, _plain_generate, body_problem, full_problem

ODD = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), st.text(max_size=3))
COUNT = st.one_of(ODD, st.integers(-(2**40), 2**40))
PARAMS = st.fixed_dictionaries(
    {},
    optional={"max_new_tokens": COUNT, "n": COUNT, "temperature": ODD},
)
BODY = st.fixed_dictionaries(
    {},
    optional={
        "text": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=3), max_size=3), ODD),
        "input_ids": st.one_of(st.lists(st.integers(0, 9), max_size=3), st.lists(st.lists(st.integers(0, 9)))),
        "stream": ODD,
        "sampling_params": st.one_of(PARAMS, st.lists(PARAMS, max_size=3), ODD),
    },
)


@settings(max_examples=600, deadline=None)
@given(body=BODY, max_n=st.integers(1, 4), max_sequences=st.integers(1, 8))
def test_what_the_glance_lets_through_the_full_rules_let_through(
    body: dict[str, Any], max_n: int, max_sequences: int
) -> None:
    if _plain_generate(body):
        assert full_problem(GENERATE, body, max_n, max_sequences) is None, body
    assert body_problem(GENERATE, body, max_n, max_sequences) == full_problem(GENERATE, body, max_n, max_sequences)


def test_the_glance_takes_the_common_body_and_refuses_nothing_itself() -> None:
    common = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    assert _plain_generate(common) and _plain_generate({"text": "hi"})
    for odd in ({"text": ["a", "b"]}, {"sampling_params": {"n": 2}}, {"sampling_params": {"max_new_tokens": True}}):
        assert not _plain_generate(odd), odd  # read in full
    assert body_problem(GENERATE, {"sampling_params": {"max_new_tokens": -1}}, 1, 1) is not None
