"""The SGLang contract helpers, and that every package declares a sorted public surface."""

from __future__ import annotations

import importlib

import pytest

from pdctl.sglang import (
    MAX_BOOTSTRAP_ROOM,
    batch_size_of,
    init_weights_update_group_body,
    inject_bootstrap,
    supports_weight_update_session,
    update_weights_from_distributed_body,
)


def test_weight_session_exists_from_0_5_21() -> None:
    assert supports_weight_update_session("0.5.23")
    assert supports_weight_update_session("0.5.21")
    assert not supports_weight_update_session("0.5.20")
    assert not supports_weight_update_session("0.4.10.post2")
    assert supports_weight_update_session("0.6.0rc1")


def test_batch_size_follows_minilb() -> None:
    assert batch_size_of({"text": "a"}) is None
    assert batch_size_of({"text": ["a", "b"]}) == 2
    assert batch_size_of({"input_ids": [1, 2, 3]}) is None
    assert batch_size_of({"input_ids": [[1], [2], [3]]}) == 3


def test_inject_bootstrap_single_and_batch() -> None:
    body = {"text": "x"}
    one = inject_bootstrap(body, host="10.0.0.1", port=8998, batch_size=None)
    assert one["bootstrap_host"] == "10.0.0.1" and one["bootstrap_port"] == 8998
    assert 0 <= one["bootstrap_room"] <= MAX_BOOTSTRAP_ROOM and "bootstrap_room" not in body
    many = inject_bootstrap(body, host="[::1]", port=None, batch_size=3)
    assert many["bootstrap_host"] == ["[::1]"] * 3 and many["bootstrap_port"] == [None] * 3
    assert len(set(many["bootstrap_room"])) == 3


def test_weight_bodies() -> None:
    init = init_weights_update_group_body(master_address="h", master_port="29500", rank_offset=3, world_size=9)
    assert init == {
        "master_address": "h",
        "master_port": 29500,
        "rank_offset": 3,
        "world_size": 9,
        "group_name": "weight_update_group",
        "backend": "nccl",
    }
    upd = update_weights_from_distributed_body(names=["w"], dtypes=["bfloat16"], shapes=[(2, 3)], weight_version="v1")
    assert upd["shapes"] == [[2, 3]] and upd["flush_cache"] is False and upd["weight_version"] == "v1"


@pytest.mark.parametrize(
    # pdctl.router has no __all__: its __init__ imports nothing, so the planner's import of
    # pdctl.router.config stays light (tests/test_structure.py checks the import graph).
    "module",
    ["pdctl.sglang", "pdctl.topology", "pdctl.plan", "pdctl.sim", "pdctl.remote", "pdctl.cluster"],
)
def test_all_is_sorted_and_importable(module: str) -> None:
    mod = importlib.import_module(module)
    names = list(mod.__all__)
    isort_style = sorted(names, key=lambda n: (not n.isupper(), not n[0].isupper(), n))  # as ruff's RUF022
    assert names == isort_style, f"{module}.__all__ is not sorted"
    for name in names:
        assert hasattr(mod, name), f"{module}.__all__ names missing {name}"
