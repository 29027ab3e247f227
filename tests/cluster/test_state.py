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
