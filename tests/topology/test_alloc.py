"""The allocation-mode DSL: AReaL's accepted forms, its validation rules, PD extensions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.errors import AllocationError
from pdctl.topology.alloc import Dims, MoEDims, parse_allocation

ACCEPTED = [
    "sglang:d4p2t2",
    "sglang:d2+fsdp:d4",
    "vllm:d2t4+megatron:d2p2t1",
    "fsdp:d4",
    "fsdp:d4c2",
    "megatron:d2p2t1",
    "archon:d2",
    "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
    "sglang:d4p1t2+megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
    "sglang[rollout]:d2+fsdp[actor]:d4",
    "sglang[r]:d2+fsdp[a]:d4+fsdp[c]:d4",
    "sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d4",
    "vllm[rollout1]:d2t2 + fsdp[actor1]:d4 + vllm[rollout2]:d4 + fsdp[actor2]:d4",
    "megatron[actor]:(attn:d4p2t2c2|ffn:d2p2t4e2)",
    "megatron:attn:d4p2t2c2|ffn:d2p2t4e2",
]


@pytest.mark.parametrize("text", ACCEPTED)
def test_areal_forms_parse(text: str) -> None:
    assert parse_allocation(text).components


def test_dimension_order_is_free_and_world_size() -> None:
    a = parse_allocation("sglang:t2d4")
    assert a.components[0].dims == Dims(d=4, t=2)
    assert a.world_size == 8
    assert parse_allocation("fsdp:d4c2").world_size == 8
    assert parse_allocation("megatron:d2t2e4").world_size == 4  # e adds no GPUs


def test_pipe_binds_tighter_than_plus() -> None:
    a = parse_allocation("sglang[r]:d2 + fsdp[a]:d4 | fsdp[c]:d4")
    assert [len(p) for p in a.pools] == [1, 2]
    assert a.world_size == 2 + 4  # the colocated critic shares the actor's GPUs


def test_moe_hybrid_and_derived_expert_dp() -> None:
    comp = parse_allocation("megatron:(attn:d4p2t2c2|ffn:p2t4e2)").components[0]
    assert isinstance(comp.dims, MoEDims)
    assert comp.dims.ffn.d == 32 // (2 * 4 * 2)
    assert comp.world_size == 32


def test_pd_groups_keep_their_own_tp() -> None:
    a = parse_allocation("sglang[prefill]:d2t2 + sglang[decode]:d1t4 + fsdp[trainer]:d8")
    roles = [(c.pd_role, c.dims.t, c.dims.d) for c in a.components if c.is_inference]
    assert roles == [("prefill", 2, 2), ("decode", 4, 1)]
    b = parse_allocation("sglang[prefill_a]:t1 + sglang[prefill_b]:t2 + sglang[decode_x]:t4")
    assert [c.pd_role for c in b.components] == ["prefill", "prefill", "decode"]
    assert parse_allocation("sglang[rollout]:d2").components[0].pd_role is None


REJECTED = [
    ("fsdp:d2p2", "FSDP backend only supports data/tensor/context parallelism", 1),
    ("sglang:d2+fsdp:d2+fsdp:d2", "When using 3+ components, all must have names. Found 3 unnamed", 1),
    ("sglang[a]:d2+fsdp[a]:d2", "Duplicate component name: a", 14),
    ("sglang[r]:d2+fsdp:d4|fsdp:d4", "Components in colocation group must have names", 22),
    ("sglang[r]:d2+fsdp[a]:d4|fsdp[c]:d2", "matching world sizes. 'a' has 4, 'c' has 2.", 25),
    # AReaL counts colocated components in a `+` chain: three components, one unnamed
    ("sglang:d2+fsdp[a]:d4|fsdp[c]:d4", "all must have names. Found 1 unnamed components.", 1),
    ("megatron:(attn:d4p2t2c2|ffn:d2p4t4e2)", "Pipeline parallel size for attention and FFN modules must be", 29),
    ("megatron:(attn:d3p1t1|ffn:t2e1)", "Cannot derive expert dp", 27),
    ("megatron:(attn:d4|ffn:d2e4)", "World size for expert modules and attention modules must be identical", 23),
    ("d4t2", "Backend must be explicitly specified", 1),
    ("[actor]:d4", "Backend must be explicitly specified", 1),
    ("sglang:d4+d4", "Backend must be explicitly specified", 11),
    ("(attn:d4|ffn:e4)", "Backend must be explicitly specified for hybrid MoE parallelism", 1),
    ("sglang.d4", "expected ':'", 7),
    ("sglang:d0", "positive number", 9),
    ("sglang:d04", "positive number", 9),
    ("sglang:c2", "'c' is not one", 8),
    ("torch:d2", "unknown backend 'torch'", 1),
    ("sglang:d2d4", "given twice", 10),
    ("sglang:d2 +", "expected a component", 12),
    ("", "allocation is empty", 1),
    ("megatron:d4e3", "Expert model parallel size 3 cannot divide world size 4", 1),
]


@pytest.mark.parametrize(("text", "message", "col"), REJECTED)
def test_rejections_name_rule_and_column(text: str, message: str, col: int) -> None:
    with pytest.raises(AllocationError) as info:
        parse_allocation(text)
    assert message in str(info.value)
    assert info.value.col == col


ALLOC_ALPHABET = "sglangfsdpmegatronvllm[]:()|+ dtpceattnffn_0123456789²٣\x00é"


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(ALLOC_ALPHABET, max_size=80), st.text(max_size=80)))
def test_any_allocation_string_parses_or_fails_with_a_column(text: str) -> None:
    """Only AllocationError escapes, and it points into the string (Unicode digits such as '²'
    once raised ValueError from int())."""
    try:
        parse_allocation(text)
    except AllocationError as exc:
        assert 1 <= exc.col <= len(text) + 1, (text, exc.col)


def test_huge_allocations_and_dimensions_are_refused() -> None:
    with pytest.raises(AllocationError, match="at most 4096 characters"):
        parse_allocation("sglang[a]:d1+" * 400 + "fsdp[z]:d1")
    with pytest.raises(AllocationError, match="dimension 't' is larger than any cluster") as info:
        parse_allocation("fsdp:d4t" + "9" * 400)
    assert info.value.col == 9
