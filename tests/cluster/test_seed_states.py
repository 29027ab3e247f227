"""Seeding's explicit states (pdctl.node.seed_states): each transition table refuses every move it does
not hold, and the seed relay and a supervisor's story move only through theirs. No engine, no
network: the relay's calls to its engine are a fake that answers when told."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import pdctl.node.peer_weights as peer_weights
from pdctl.jsonhttp import StatusError, call_json, exchange
from pdctl.node.peer_weights import ARM_ROUTE, DISARM_ROUTE, INIT_ROUTE, SEND_ROUTE, WAIT_ROUTE, SeedRelay, SeedSide
from pdctl.node.seed_states import PEER_MOVES, RELAY_MOVES, Machine, PeerState, Refusal, RelayState
from pdctl.node.supervise import PeerStory, RestartNotes, Story
from pdctl.roles import RestartPolicy
from pdctl.sglang import Endpoint

KEY = "ab" * 16
AUTH = f"Bearer {KEY}"


@pytest.mark.parametrize(("table", "states"), [(RELAY_MOVES, RelayState), (PEER_MOVES, PeerState)])
def test_each_table_allows_exactly_its_moves_and_refuses_every_other(table: Any, states: Any) -> None:
    assert set(table) == set(states)  # a row for every state
    for start in states:
        for to in states:
            machine = Machine("m", table, start)
            refused = machine.move(to)
            if to in table[start]:
                assert refused is None and machine.state is to, (start, to)
            else:
                assert refused == Refusal("m", str(start), str(to)) and machine.state is start, (start, to)
                assert str(refused) == f"m: no move from {start} to {to}"


def test_a_table_without_a_row_for_a_state_is_refused() -> None:
    partial = {s: t for s, t in RELAY_MOVES.items() if s is not RelayState.DRAINING}
    with pytest.raises(ValueError, match="no row for draining"):
        Machine("seed relay", partial, RelayState.IDLE)


def test_the_wire_words_are_unchanged() -> None:
    """A story's ``peer.state`` and the remote-instance routes are read by other programs."""
    assert [s.value for s in PeerState] == ["none", "receiving", "done", "failed"]
    assert peer_weights.INIT_ROUTE == "/init_weights_send_group_for_remote_instance" == Endpoint(INIT_ROUTE)
    assert peer_weights.SEND_ROUTE == "/send_weights_to_remote_instance" == Endpoint(SEND_ROUTE)


# -- the relay ------------------------------------------------------------------------------------
class _Engine:
    """The relay's engine, faked: each call waits until ``answer`` is told what to say."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.arrived = threading.Semaphore(0)
        self._answers: list[tuple[threading.Event, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def call(self, url: str, body: Any = None, *, key: str | None = None, timeout_secs: float | None = 5.0) -> Any:
        event, box = threading.Event(), {}
        with self._lock:
            self.calls.append(url)
            self._answers.append((event, box))
        self.arrived.release()
        assert event.wait(30), "the test never answered"
        return box["answer"]

    def answer(self, success: bool) -> None:
        with self._lock:
            event, box = next((e, b) for e, b in self._answers if not e.is_set())
        box["answer"] = {"success": success, "message": "engine says so"}
        event.set()


@pytest.fixture
def relay(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[SeedRelay, _Engine]]:
    engine = _Engine()
    monkeypatch.setattr(peer_weights, "call_json", engine.call)
    yield SeedRelay(SeedSide("seed", "http://127.0.0.1:1", "127.0.0.1", 1, (7,)), KEY), engine


INIT = {"master_address": "127.0.0.1", "ports": "7", "group_rank": 0, "world_size": 2, "group_name": "send_weights_x"}
SEND = {"master_address": "127.0.0.1", "ports": "7", "group_name": "send_weights_x"}


def _in_thread(relay: SeedRelay, path: str, body: dict[str, Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(answer=relay.handle(path, body, None)))
    thread.start()
    return thread, out


def test_a_whole_transfer_moves_the_relay_through_its_table(relay: tuple[SeedRelay, _Engine]) -> None:
    seed, engine = relay
    assert seed.state is RelayState.IDLE
    assert seed.handle(ARM_ROUTE, {"receiver": "r"}, AUTH).status == 200 and seed.state is RelayState.ARMED
    assert seed.handle(SEND_ROUTE, SEND, None).body["message"] == peer_weights.ONE_SEND  # no init yet
    assert seed.state is RelayState.IDLE  # a refused send ends the transfer
    assert seed.handle(ARM_ROUTE, {"receiver": "r"}, AUTH).status == 200
    init, answered = _in_thread(seed, INIT_ROUTE, INIT)
    assert engine.arrived.acquire(timeout=30)
    assert seed.state is RelayState.JOINING
    engine.answer(True)
    init.join(30)
    assert answered["answer"].status == 200 and seed.state is RelayState.JOINED
    again = seed.handle(INIT_ROUTE, INIT, None)  # a second init: the table holds no JOINED -> JOINING
    assert again.status == 403 and again.body["message"] == peer_weights.ONE_GROUP and seed.state is RelayState.JOINED
    send, answered = _in_thread(seed, SEND_ROUTE, SEND)
    assert engine.arrived.acquire(timeout=30)
    assert seed.state is RelayState.SENDING
    engine.answer(True)
    send.join(30)
    assert answered["answer"].status == 200 and seed.state is RelayState.IDLE
    assert seed.handle(WAIT_ROUTE, {"receiver": "r", "timeout_secs": 0}, AUTH).body == {
        "done": True,
        "success": True,
        "message": "engine says so",
    }
    assert engine.calls == ["http://127.0.0.1:1" + INIT_ROUTE, "http://127.0.0.1:1" + SEND_ROUTE]


@pytest.mark.parametrize("init_ok", [True, False])
def test_an_arm_that_ends_during_its_init_drains_then_leaves_the_seed_unable_to_seed(
    relay: tuple[SeedRelay, _Engine], init_ok: bool
) -> None:
    """As before the states were explicit: the group an init may have made is never used, so the
    relay refuses arms until its engine restarts, whatever the init's answer said."""
    seed, engine = relay
    seed.handle(ARM_ROUTE, {"receiver": "r"}, AUTH)
    init, _ = _in_thread(seed, INIT_ROUTE, INIT)
    assert engine.arrived.acquire(timeout=30)
    assert seed.handle(DISARM_ROUTE, {"receiver": "r"}, AUTH).status == 200 and seed.state is RelayState.DRAINING
    busy = seed.handle(ARM_ROUTE, {"receiver": "next"}, AUTH)
    assert busy.status == 409 and busy.body["error"] == "seeding r already"
    engine.answer(init_ok)
    init.join(30)
    assert seed.state is RelayState.LEFT_OPEN
    refused = seed.handle(ARM_ROUTE, {"receiver": "next"}, AUTH)
    assert refused.status == 409 and "never used" in refused.body["error"] and "restarts" in refused.body["error"]
    seed.engine_started()
    assert seed.state is RelayState.IDLE and seed.handle(ARM_ROUTE, {"receiver": "next"}, AUTH).status == 200


def test_an_arm_that_ends_during_its_send_drains_then_frees_the_seed(relay: tuple[SeedRelay, _Engine]) -> None:
    seed, engine = relay
    seed.handle(ARM_ROUTE, {"receiver": "r"}, AUTH)
    init, _ = _in_thread(seed, INIT_ROUTE, INIT)
    assert engine.arrived.acquire(timeout=30)
    engine.answer(True)
    init.join(30)
    send, _ = _in_thread(seed, SEND_ROUTE, SEND)
    assert engine.arrived.acquire(timeout=30)
    seed.handle(DISARM_ROUTE, {"receiver": "r"}, AUTH)
    assert seed.state is RelayState.DRAINING
    engine.answer(True)
    send.join(30)
    assert seed.state is RelayState.IDLE and seed.handle(ARM_ROUTE, {"receiver": "next"}, AUTH).status == 200


# -- the supervisor -------------------------------------------------------------------------------
def test_a_story_moves_its_peer_only_through_the_table_and_writes_the_same_json(tmp_path: Any) -> None:
    story = Story(str(tmp_path / "story"), RestartPolicy.ON_FAILURE)
    story.write()
    assert json.loads((tmp_path / "story").read_text())["peer"] is None
    assert story.set_peer(PeerStory(PeerState.DONE, "x")) == Refusal("weights from a peer", "none", "done")
    assert story.peer is None
    assert story.set_peer(PeerStory(PeerState.RECEIVING, "from decode-1 at 'B'")) is None
    story.write()
    assert (
        (tmp_path / "story").read_text().endswith('"peer": {"state": "receiving", "detail": "from decode-1 at \'B\'"}}')
    )
    refused = story.set_peer(PeerStory(PeerState.NONE, "a start while the transfer runs"))
    assert refused is not None and story.peer is not None and story.peer.state is PeerState.RECEIVING
    assert story.set_peer(PeerStory(PeerState.DONE, "took 'B'", "decode-1", "B", 1.5)) is None
    story.write()
    assert (
        (tmp_path / "story")
        .read_text()
        .endswith('"peer": {"state": "done", "detail": "took \'B\'", "seed": "decode-1", "version": "B", "secs": 1.5}}')
    )


def test_the_supervisors_notes_are_taken_once() -> None:
    notes = RestartNotes()
    assert notes.take_killed_for() is None and notes.take_from_disk_next() is False
    notes.killed("hung")
    notes.load_from_disk_next()
    assert notes.take_killed_for() == "hung" and notes.take_killed_for() is None
    assert notes.take_from_disk_next() is True and notes.take_from_disk_next() is False


# -- the one synchronous client -------------------------------------------------------------------
@pytest.fixture
def server() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = {"/ok": (200, b'{"a": 1}'), "/empty": (200, b""), "/text": (200, b"hi")}.get(
                self.path, (409, b'{"error": "seeding r already"}')
            )
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_client_answers_statuses_and_raises_only_for_no_answer(server: str) -> None:
    assert exchange("GET", server + "/busy").status == 409  # an error status is an answer
    assert call_json(server + "/ok") == {"a": 1} and call_json(server + "/empty") is None
    with pytest.raises(StatusError) as refused:
        call_json(server + "/busy")
    assert refused.value.status == 409 and refused.value.error() == "seeding r already"
    with pytest.raises(ValueError):
        call_json(server + "/text")
    with pytest.raises(OSError):
        exchange("GET", server.rsplit(":", 1)[0] + ":1/")  # nothing listens on port 1
