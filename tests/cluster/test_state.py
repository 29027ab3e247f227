"""The state file and the lock, without any node."""

from __future__ import annotations

import pytest

from pdctl.cluster import ClusterState, StateStore
from pdctl.errors import LifecycleError


def test_atomic_private_roundtrip(tmp_path) -> None:
    store = StateStore(tmp_path)
    state = ClusterState(name="c", run_id="r", status="up", nodes=[])
    store.save(state)
    assert oct(store.path("c").stat().st_mode & 0o777) == "0o600"
    assert store.load("c").run_id == "r"
    assert not list(store.dir("c").glob("*.tmp"))
    assert store.names() == ["c"]
    assert store.resolve_name(None) == "c"


def test_second_up_of_the_same_name_is_locked_out(tmp_path) -> None:
    store = StateStore(tmp_path)
    with (
        store.locked("c"),
        pytest.raises(LifecycleError, match="another pdctl up/down of 'c' is running"),
        store.locked("c"),
    ):
        pass


def test_resolve_name_errors(tmp_path) -> None:
    store = StateStore(tmp_path)
    with pytest.raises(LifecycleError, match="no clusters"):
        store.resolve_name(None)
    for name in ("a", "b"):
        store.save(ClusterState(name=name, run_id="r", status="down", nodes=[]))
    with pytest.raises(LifecycleError, match="several clusters"):
        store.resolve_name(None)


def test_corrupt_state_is_a_clear_error(tmp_path) -> None:
    store = StateStore(tmp_path)
    store.dir("x").mkdir(parents=True)
    store.path("x").write_text("{not json")
    with pytest.raises(LifecycleError, match="unreadable"):
        store.load("x")


def test_the_plan_is_read_into_its_types_and_written_back_byte_for_byte() -> None:
    """Every shipped topology's plan, held typed in the state (issue 60 item 4), writes the bytes
    the dict held before (the JSON ``Plan.to_dict`` makes, ASCII, ints kept ints), and survives a
    load and a save unchanged; an infinite wait and a state of the older ``refit`` form read back."""
    import dataclasses
    import json
    import math

    from pdctl.cluster.state import Phase
    from pdctl.plan import load_plan
    from tests.conftest import TOPOLOGIES

    for path in TOPOLOGIES:
        plan = load_plan(path).plan
        state = ClusterState(name="c", run_id="r", status=Phase.UP, nodes=[], plan=plan, source="topologies/café.yaml")
        text = state.to_json()
        assert json.loads(text)["plan"] == json.loads(json.dumps(plan.to_dict())), path.name
        assert text.isascii() and ClusterState.from_json(text).to_json() == text, path.name
    assert len(TOPOLOGIES) >= 10
    forever = dataclasses.replace(plan, trainer_startup_secs=math.inf)
    text = ClusterState(name="c", run_id="r", status=Phase.UP, nodes=[], plan=forever).to_json()
    assert ClusterState.from_json(text).plan.trainer_startup_secs == math.inf
    older = json.loads(text)
    older["plan"]["refit"] = "interrupt"
    assert ClusterState.from_json(json.dumps(older)).plan.refit == "interrupt"
