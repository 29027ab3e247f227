"""Engines a move cordoned ahead of their own switch, and never switched (the move was stopped or
killed), are taken back into rotation and forgotten only once the router says so
(pdctl.cluster.restart.lift_cordons_ahead, which every `switch`, `restart`, `apply` and an act
planner run first). A router that refuses (a wrong key), or does not answer, leaves the record as
it was: the engines stay named (``status``) for the next command, never silently out of
rotation. One the router no longer lists (404) is nothing to lift. A real router process and null
engines."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdctl.cluster.journal import Journal
from pdctl.cluster.restart import lift_cordons_ahead
from pdctl.cluster.router_control import RouterControl
from pdctl.cluster.state import ClusterState, Phase, StateStore
from pdctl.errors import LifecycleError
from tests.helpers import NullEngine, RouterProcess, pd_router_args

KEY = "control-key-for-the-test"


@pytest.fixture
def fleet(tmp_path) -> Iterator[tuple[RouterProcess, list[NullEngine]]]:
    prefill = NullEngine(tmp_path, "prefill").start()
    decodes = [NullEngine(tmp_path, "decode").start() for _ in range(2)]
    router = RouterProcess(tmp_path, *pd_router_args([prefill], decodes), "--api-key-env", "ROUTER_KEY",
                           env={"ROUTER_KEY": KEY})  # fmt: skip
    try:
        router.start()
        yield router, decodes
    finally:
        router.stop()
        for engine in (prefill, *decodes):
            engine.stop()


def _cordoned(control: RouterControl, url: str) -> bool:
    worker = control.worker(url)
    assert worker is not None, f"the router does not list {url}"
    return bool(worker["cordoned"])


def test_cordons_ahead_are_forgotten_only_once_the_router_lifts_them(fleet, tmp_path) -> None:
    router, decodes = fleet
    store = StateStore(tmp_path / "home")
    state = ClusterState("c", "run-1", Phase.UP, [])
    store.save(state)
    control = RouterControl(router.url, KEY)
    ahead = {"decode-1": decodes[0].url, "decode-2": decodes[1].url}
    said: list[str] = []

    def events(unit: str, text: str) -> None:
        said.append(f"{unit}: {text}")

    def cordon_ahead(engines: dict[str, str]) -> dict:
        Journal(state, store, "planner").cordon_ahead(engines, "planner")
        for url in engines.values():
            if url in ahead.values():
                control.cordon(url, True, wait=False)
        return store.load("c").cordoned_ahead

    record = cordon_ahead(ahead)
    assert record["engines"] == ahead and all(_cordoned(control, url) for url in ahead.values())

    # Refused (a key the router does not take): the record stays, the engines stay out and named.
    with pytest.raises(LifecycleError, match="did not uncordon"):
        lift_cordons_ahead(state, store, RouterControl(router.url, "a-wrong-key"), events)
    assert store.load("c").cordoned_ahead == record
    assert all(_cordoned(control, url) for url in ahead.values())

    # Lifted: back in rotation, then forgotten.
    lift_cordons_ahead(state, store, control, events)
    assert store.load("c").cordoned_ahead is None and state.cordoned_ahead is None
    assert not any(_cordoned(control, url) for url in ahead.values())
    assert "decode-1: back in rotation: `pdctl planner` cordoned it ahead of a switch it never made" in said

    # One the router no longer lists (it was removed meanwhile): nothing to lift, the record goes.
    cordon_ahead({"decode-9": "http://127.0.0.1:1"})
    lift_cordons_ahead(state, store, control, events)
    assert store.load("c").cordoned_ahead is None

    # A router that does not answer: the record stays for the next command.
    record = cordon_ahead(ahead)
    router.stop()
    with pytest.raises(LifecycleError, match="did not uncordon"):
        lift_cordons_ahead(state, store, control, events)
    assert store.load("c").cordoned_ahead == record
