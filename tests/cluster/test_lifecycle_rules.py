"""The cluster code's rules on two in-memory nodes (tests/cluster/fake_nodes.py), in milliseconds:
nothing starts unless every node passes preflight; any failure, or Ctrl-C, stops everything
that started on every node and says which process failed, with its log; ``down`` is idempotent
and keeps what it could not stop. The same rules with real processes, sshd and network
namespaces: test_local_cli.py, test_lifecycle_ssh.py, test_multinode_ssh.py."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from pdctl.cluster import down, status, up
from pdctl.cluster.state import Phase, StateStore
from pdctl.errors import LifecycleError
from pdctl.plan import Planned, load_plan_text
from tests.cluster.fake_nodes import FakeCluster

TOPOLOGY = """
name: fake2
model: {path: "sim://tiny"}
engine: sim
nodes:
  - {name: h0, host: 10.77.0.2, gpus: 4}
  - {name: h1, host: 10.77.0.3, gpus: 4}
ports: {base: 22000}
prefill: {replicas: 1, tp: 1, nodes: [h0]}
decode: {replicas: 1, tp: 2, nodes: [h1]}
trainer: {command: [python, train.py], nproc_per_node: 1, nodes: [h1], startup_secs: 0.001}
weights: {backend: gloo}
"""
up_module = importlib.import_module("pdctl.cluster.up")  # the package's ``up`` is the function
EVERYTHING = {"h0": ["prefill-0", "router"], "h1": ["decode-0", "trainer.h1"]}


@pytest.fixture
def planned() -> Planned:
    return load_plan_text(TOPOLOGY, "fake2.yaml")


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    return StateStore(tmp_path / "state")


def bring_up(planned: Planned, store: StateStore, cluster: FakeCluster, **kwargs):
    with cluster.nodes(planned.topology.nodes) as nodes:
        return up(planned.topology, planned.plan, store=store, nodes=nodes, **kwargs)


def failed_up(planned: Planned, store: StateStore, cluster: FakeCluster, **kwargs) -> str:
    with pytest.raises(LifecycleError) as failure:
        bring_up(planned, store, cluster, **kwargs)
    return str(failure.value)


def test_up_starts_every_process_and_down_stops_them_and_is_idempotent(planned, store):
    cluster = FakeCluster("h0", "h1")
    state = bring_up(planned, store, cluster)
    assert state.status == Phase.UP and cluster.alive() == EVERYTHING
    assert store.load("fake2").status == Phase.UP
    with cluster.nodes(planned.topology.nodes) as nodes:
        assert down("fake2", store=store, nodes=nodes) == "cluster 'fake2' is down (4 processes stopped)"
        assert cluster.alive() == {}
        assert down("fake2", store=store, nodes=nodes) == "cluster 'fake2' is already down"
    assert store.load("fake2").status == Phase.DOWN


def test_a_busy_port_or_an_unreachable_node_fails_preflight_and_nothing_starts(planned, store):
    cluster = FakeCluster("h0", "h1")
    cluster["h0"].busy_ports[22000] = "python3"
    cluster["h1"].unreachable = True
    message = failed_up(planned, store, cluster)
    assert message.startswith("preflight failed, nothing was started")
    assert "node h0: port 22000 is already in use by pid 4242 (python3" in message
    assert "node h1: cannot connect to 10.77.0.3:22" in message
    assert not cluster.spawned() and store.load("fake2") is None


def test_a_launch_that_fails_on_one_node_stops_what_started_on_the_others(planned, store):
    cluster = FakeCluster("h0", "h1")
    cluster["h1"].failing["spawn"] = "cannot create /runs/fake2: Permission denied"
    message = failed_up(planned, store, cluster)
    assert "launch failed: node h1: agent spawn: cannot create /runs/fake2: Permission denied" in message
    assert "stop" in cluster["h0"].calls and cluster.alive() == {}
    state = store.load("fake2")
    assert state.status == Phase.DOWN and not state.processes


def test_an_older_pdctl_on_a_node_that_ignores_the_key_file_fails_up_and_everything_stops(planned, store):
    """Its engines would serve without a key: up refuses them, and what started anywhere stops."""
    cluster = FakeCluster("h0", "h1")
    cluster["h1"].old_agent = True
    message = failed_up(planned, store, cluster)
    assert "node h1: its pdctl did not write decode-0's key file" in message, message
    assert "prefill-0" not in message  # h0's agent wrote its key file
    assert cluster.alive() == {} and store.load("fake2").status == Phase.DOWN
    sent = cluster["h0"].processes["prefill-0"]
    assert not [a for a in sent.argv if "api-key" in a], "the key is not on the command line"


def test_an_engine_that_dies_while_starting_is_named_with_its_log_and_everything_stops(planned, store):
    cluster = FakeCluster("h0", "h1")
    cluster["h1"].dies_at_start["decode-0"] = 1
    message = failed_up(planned, store, cluster)
    assert message.startswith("decode-0 did not become ready: process exited")
    assert "--- last 50 lines of" in message and "log of decode-0: Traceback" in message
    assert cluster.alive() == {} and store.load("fake2").status == Phase.DOWN


def test_a_restart_whose_process_dies_while_starting_names_it_with_its_log(planned, store):
    """`restart` (and `apply`, through the same wait) says why as `up` does: the log's last lines
    (a CI run showed only 'decode-1 did not become ready: process exited')."""
    from pdctl.cluster.restart import restart

    cluster = FakeCluster("h0", "h1")
    state = bring_up(planned, store, cluster)
    cluster[state.processes["router"].node].dies_at_start["router"] = 1
    with cluster.nodes(planned.topology.nodes) as nodes, pytest.raises(LifecycleError) as failure:
        restart("fake2", ["router"], store=store, nodes=nodes)
    message = str(failure.value)
    assert message.startswith("router did not become ready: process exited"), message
    assert "--- last 50 lines of" in message and "log of router: Traceback" in message, message


def test_an_engine_that_never_becomes_healthy_fails_up_after_the_timeout(planned, store):
    cluster = FakeCluster("h0", "h1")
    cluster["h0"].never_ready.add("prefill-0")
    message = failed_up(planned, store, cluster, ready_timeout_secs=0.0)
    assert message.startswith("prefill-0 did not become ready: not healthy after 0s")
    assert cluster.alive() == {}


def test_a_trainer_that_exits_with_an_error_right_after_launch_fails_up(planned, store):
    cluster = FakeCluster("h0", "h1")
    cluster["h1"].dies_at_start["trainer.h1"] = 3
    message = failed_up(planned, store, cluster)
    assert message.startswith("trainer.h1 did not become ready: it exited with code 3 within 0.001s of its start")
    assert cluster.alive() == {}


def test_ctrl_c_during_up_stops_everything_on_every_node(planned, store):
    cluster = FakeCluster("h0", "h1")
    cluster["h1"].interrupt_on = "wait-ready"
    message = failed_up(planned, store, cluster)
    assert message == "interrupted; everything that started was stopped"
    assert cluster.alive() == {} and store.load("fake2").status == Phase.DOWN


def test_up_refuses_a_cluster_that_is_already_up(planned, store):
    cluster = FakeCluster("h0", "h1")
    bring_up(planned, store, cluster)
    message = failed_up(planned, store, cluster)
    assert message.startswith("cluster 'fake2' is already up with 4 processes")
    assert cluster.alive() == EVERYTHING  # the running cluster is untouched


def test_down_keeps_what_an_unreachable_node_still_runs_and_a_retry_finishes(planned, store):
    cluster = FakeCluster("h0", "h1")
    bring_up(planned, store, cluster)
    cluster["h1"].unreachable = True
    with cluster.nodes(planned.topology.nodes) as nodes, pytest.raises(LifecycleError) as failure:
        down("fake2", store=store, nodes=nodes)
    assert "some processes may still run" in str(failure.value) and "node h1: cannot connect" in str(failure.value)
    assert sorted(store.load("fake2").processes) == EVERYTHING["h1"]  # h0's are gone, h1's kept
    cluster["h1"].unreachable = False
    with cluster.nodes(planned.topology.nodes) as nodes:
        assert down("fake2", store=store, nodes=nodes) == "cluster 'fake2' is down (2 processes stopped)"
    assert cluster.alive() == {}


def test_status_reports_a_dead_process_and_the_trainers_exit_code(planned, store):
    cluster = FakeCluster("h0", "h1")
    bring_up(planned, store, cluster)
    trainer = cluster["h1"].processes["trainer.h1"]
    trainer.alive, trainer.exit_code = False, 7
    with cluster.nodes(planned.topology.nodes) as nodes:
        report = status("fake2", store=store, nodes=nodes).to_dict()
    by_id = {p["id"]: p for p in report["processes"]}
    assert by_id["trainer.h1"]["alive"] is False and by_id["trainer.h1"]["exit_code"] == 7
    assert by_id["prefill-0"]["alive"] is True


def test_a_switch_keeps_soft_flags_and_is_refused_for_one_that_changes_tensors() -> None:
    """apply switches an engine whose group args differ from the other group's (it keeps its own
    until its next restart), but not one whose new group differs in a flag that changes its
    tensors or parallelism: that pair is an add and a removal, and apply says why."""
    from pdctl.cluster.switch import kept_args

    running = ["python", "-m", "pdctl.sim", "--model-path", "m", "--tp-size", "2", "--disaggregation-mode", "decode",
               "--max-running-requests", "48", "--mem-fraction-static=0.8", "--enable-metrics"]  # fmt: skip
    planned = ["python", "-m", "pdctl.sim", "--model-path", "m", "--tp-size", "2", "--disaggregation-mode", "decode",
               "--max-running-requests", "32", "--enable-metrics", "--chunked-prefill-size", "4096"]  # fmt: skip
    soft, hard = kept_args(running, planned)
    assert hard == []
    assert soft == {
        "--max-running-requests": ["48", "32"],
        "--mem-fraction-static": ["0.8", None],
        "--chunked-prefill-size": [None, "4096"],
    }
    quantized = [*planned, "--quantization", "fp8"]
    soft, hard = kept_args(running, quantized)
    assert hard == ["--quantization None vs 'fp8'"]
