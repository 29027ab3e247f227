"""The CUDA MPS lifecycle of colocated clusters. There is no GPU here: a stand-in
nvidia-cuda-mps-control (tests/fake_mps) goes on the node's PATH through the topology's node
env; it daemonizes, makes its control pipe and records every call (see its docstring)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from pdctl.cluster import down, status, up
from pdctl.cluster.state import StateStore
from pdctl.errors import LifecycleError
from pdctl.node import mps
from pdctl.plan import make_plan
from pdctl.topology import load_topology_text
from tests.helpers import eventually, free_port_base

FAKE_MPS = Path(__file__).resolve().parents[1] / "fake_mps"
PATH = f"{FAKE_MPS}:{os.environ['PATH']}"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def calls(log_dir: str | Path) -> list[dict]:
    path = Path(log_dir) / "stand-in.calls"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def environ(pid: int) -> dict[str, str]:
    """The process's environment once its exec has finished. Popen returns when the exec closed
    its close-on-exec pipe, which the kernel does before it sets the new image's environment
    bounds, so /proc/PID/environ can read empty for a moment right after spawn."""
    return eventually(lambda: psutil.Process(pid).environ(), 10, interval=0.01, what=f"pid {pid}'s environment")


# -- the node side: pdctl.node.mps as the agent runs it ----------------------------------------------------
@pytest.fixture
def dirs(tmp_path):
    req = {"pipe_dir": str(tmp_path / "pipe"), "log_dir": str(tmp_path / "log"), "env": {"PATH": PATH}}
    yield req
    for proc in mps._daemon_and_servers(Path(req["pipe_dir"])):  # a failed test leaves no daemon
        proc.kill()


def test_start_waits_for_the_pipe_reuses_a_running_daemon_and_quits(dirs) -> None:
    first = mps.start(dirs)
    assert first["started"] and Path(dirs["pipe_dir"], "control").exists()
    daemon = psutil.Process(first["pid"])
    assert daemon.environ()["CUDA_MPS_PIPE_DIRECTORY"] == dirs["pipe_dir"]
    again = mps.start(dirs)  # idempotent: the same daemon, not ours to stop
    assert not again["started"] and again["pid"] == first["pid"]
    assert [c["call"] for c in calls(dirs["log_dir"])] == ["start"]
    assert mps.status({**dirs, **first}) == {"running": True, "control_pipe": True}
    stopped = mps.stop({**dirs, **first, "grace_secs": 5})
    assert stopped == {"forced": False, "detail": "quit"}
    assert [c.get("stdin") or c.get("command") for c in calls(dirs["log_dir"])[1:]] == [["quit"], "quit"]
    assert not mps.status({**dirs, **first})["running"]
    assert mps.stop({**dirs, **first})["detail"] == "not running"  # twice is fine


def test_a_quit_that_hangs_is_forced_after_the_grace(dirs) -> None:
    hanging = {**dirs, "env": {**dirs["env"], "FAKE_MPS": "hang_quit"}}
    daemon = mps.start(hanging)
    out = mps.stop({**hanging, **daemon, "grace_secs": 1})
    assert out["forced"] and "killed" in out["detail"] and out["left"] == []
    assert not mps.status({**dirs, **daemon})["running"]
    silent = {**dirs, "env": {**dirs["env"], "FAKE_MPS": "hang_client"}}
    daemon = mps.start(silent)
    out = mps.stop({**silent, **daemon, "grace_secs": 1})
    assert out["forced"] and "quit did not return within 1s" in out["detail"]


def test_mps_that_cannot_run_says_why(dirs) -> None:
    with pytest.raises(mps.MpsError, match=r"not on the node's PATH .*placement.mps: false"):
        mps.start({**dirs, "env": {"PATH": "/nonexistent"}})
    with pytest.raises(mps.MpsError, match="-d exited 1: An MPS control daemon could not be started"):
        mps.start({**dirs, "env": {**dirs["env"], "FAKE_MPS": "fail"}})
    with pytest.raises(mps.MpsError, match=r"did not open .*control within 1s\ncontrol.log: .*never creating"):
        mps.start({**dirs, "env": {**dirs["env"], "FAKE_MPS": "no_pipe"}, "timeout_secs": 1})
    assert mps._daemon_and_servers(Path(dirs["pipe_dir"])) == []  # the one without a pipe was killed


# -- the lifecycle on localhost -----------------------------------------------------------------------
def colocated(tmp_path, name: str, base: int, *, env: dict | None = None, placement: dict | None = None):
    data = {
        "name": name,
        "model": {"path": "sim://tiny"},
        "engine": "sim",
        "nodes": [{"name": "me", "host": "127.0.0.1", "gpus": 2, "workdir": str(tmp_path / "runs"),
                   "env": {"PATH": PATH, **(env or {})}}],
        "ports": {"base": base},
        "prefill": {"tp": 1},
        "decode": {"tp": 1},
        "trainer": {"command": SLEEPER, "nproc_per_node": 2, "startup_secs": 0.5},
        "weights": {"backend": "gloo"},
        "placement": placement or {"mode": "colocate", "train_frac": 0.4, "infer_frac": 0.4,
                                   "mps_active_thread_percentage": {"trainer": 50, "prefill": 30}},
    }  # fmt: skip
    return load_topology_text(yaml.safe_dump(data))[0]


def test_up_starts_mps_first_then_the_trainer_and_down_quits_it(tmp_path, pdctl_home) -> None:
    top = colocated(tmp_path, "colo", free_port_base())
    plan = make_plan(top)
    [daemon] = plan.mps
    events: list[tuple[str, str]] = []
    state = up(top, plan, ready_timeout_secs=120, events=lambda who, what: events.append((who, what)))
    try:
        record = state.mps["me"]
        assert record["started"] and record["pipe_dir"] == daemon.pipe_dir
        started = record["create_time"]  # psutil's clock, as the processes' (time.time() differs by up to 1 s)
        procs = {p.id: p for p in state.processes.values()}
        trainer = procs["trainer.me"].create_time
        engines = [p.create_time for p in procs.values() if p.role in ("prefill", "decode")]
        assert started < trainer < min(engines)  # MPS, then the trainer, then the engines
        for proc in procs.values():
            env = environ(proc.pid)
            if proc.role == "router":
                assert "CUDA_MPS_PIPE_DIRECTORY" not in env
            else:
                assert env["CUDA_MPS_PIPE_DIRECTORY"] == daemon.pipe_dir
        assert environ(procs["trainer.me"].pid)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert environ(procs["prefill-0"].pid)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in environ(procs["decode-0"].pid)
        [shown] = status("colo").mps
        assert shown.running and shown.control_pipe and shown.started and shown.pid == record["pid"]
        cli = subprocess.run(
            [sys.executable, "-m", "pdctl", "status", "colo"], capture_output=True, text=True, timeout=60,
            env={**os.environ, "PDCTL_HOME": str(pdctl_home), "COLUMNS": "80"},
        )  # fmt: skip
        assert f"mps me: running (pid {record['pid']}, started by pdctl)" in cli.stdout, cli.stdout + cli.stderr
    finally:
        summary = down("colo")
    assert summary == "cluster 'colo' is down (4 processes stopped)"
    assert [c["command"] for c in calls(daemon.log_dir) if c["call"] == "command"] == ["quit"]
    assert not psutil.pid_exists(record["pid"]) or psutil.Process(record["pid"]).status() == psutil.STATUS_ZOMBIE
    assert StateStore().load("colo").mps == {}
    assert "already down" in down("colo")
    assert ("mps.me", f"started: pid {record['pid']}, pipe {daemon.pipe_dir}") in events


def test_a_daemon_already_running_is_reused_and_left_running(tmp_path, pdctl_home) -> None:
    top = colocated(tmp_path, "reuse", free_port_base())
    plan = make_plan(top)
    [daemon] = plan.mps
    request = {"pipe_dir": daemon.pipe_dir, "log_dir": daemon.log_dir, "env": {"PATH": PATH}}
    theirs = mps.start(request)
    try:
        state = up(top, plan, ready_timeout_secs=120)
        assert state.mps["me"] == {**state.mps["me"], "pid": theirs["pid"], "started": False}
        [shown] = status("reuse").mps
        assert shown.running and not shown.started
        down("reuse")
        assert mps.status({**request, **theirs})["running"]  # not pdctl's to stop
        assert not [c for c in calls(daemon.log_dir) if c["call"] == "client"]
    finally:
        mps.stop({**request, **theirs, "grace_secs": 5})


def test_mps_that_fails_to_start_fails_up_and_leaves_nothing(tmp_path, pdctl_home) -> None:
    top = colocated(tmp_path, "nomps", free_port_base(), env={"FAKE_MPS": "fail"})
    plan = make_plan(top)
    with pytest.raises(LifecycleError) as err:
        up(top, plan, ready_timeout_secs=60)
    message = str(err.value)
    assert "MPS cannot run, nothing else was started" in message
    assert "An MPS control daemon could not be started" in message and "placement.mps: false" in message
    state = StateStore().load("nomps")
    assert state.status == "down" and not state.processes and not state.mps
    assert [c["call"] for c in calls(plan.mps[0].log_dir)] == ["start"]
    assert not list(Path(tmp_path / "runs" / "nomps" / "logs").glob("*.log"))  # no process was launched


def test_mps_false_runs_colocated_without_a_daemon(tmp_path, pdctl_home) -> None:
    placement = {"mode": "colocate", "train_frac": 0.4, "infer_frac": 0.4, "mps": False}
    top = colocated(tmp_path, "plain", free_port_base(), placement=placement)
    plan = make_plan(top)
    assert plan.mps == () and plan.trainer_first
    events: list[tuple[str, str]] = []
    state = up(top, plan, ready_timeout_secs=120, events=lambda who, what: events.append((who, what)))
    try:
        assert state.mps == {}
        assert ("mps", "placement.mps is false: colocated processes share GPUs without MPS") in events
        engine = next(p for p in state.processes.values() if p.role == "decode")
        assert "CUDA_MPS_PIPE_DIRECTORY" not in environ(engine.pid)
        assert status("plain").mps == []
    finally:
        down("plain")


# -- on SSH test hosts ----------------------------------------------------------------------------------
def two_hosts(hosts, name: str, base: int, h1_mode: str):
    data = {
        "name": name,
        "model": {"path": "sim://tiny"},
        "engine": "sim",
        "nodes": [hosts.node(0, gpus=1, env={"PATH": PATH}),
                  hosts.node(1, gpus=1, env={"PATH": PATH, "FAKE_MPS": h1_mode})],
        "ports": {"base": base},
        "prefill": {"tp": 1, "nodes": ["h0"]},
        "decode": {"tp": 1, "nodes": ["h1"]},
        "router": {"node": "h0"},
        "trainer": {"command": SLEEPER, "nproc_per_node": 1, "startup_secs": 0.5},
        "weights": {"backend": "gloo"},
        "placement": {"mode": "colocate", "train_frac": 0.4, "infer_frac": 0.4},
    }  # fmt: skip
    return load_topology_text(yaml.safe_dump(data))[0]


@pytest.mark.netns
def test_mps_on_two_ssh_hosts_with_a_quit_that_hangs(clean_hosts, pdctl_home, monkeypatch) -> None:
    """A daemon per host over SSH; h1's ignores quit (clients that hang): down forces it after the
    grace (2 s here, 10 s by default), and the fixture checks that nothing is left on either host."""
    monkeypatch.setattr("pdctl.cluster.mps.QUIT_GRACE_SECS", 2.0)
    top = two_hosts(clean_hosts, "colo-ssh", 26400, "hang_quit")
    plan = make_plan(top)
    assert [d.node for d in plan.mps] == ["h0", "h1"]
    assert [p.gpu_ids for p in plan.processes if p.role.value == "trainer"] == [(0,), (0,)]
    events: list[tuple[str, str]] = []
    state = up(top, plan, ready_timeout_secs=120)
    try:
        assert sorted(state.mps) == ["h0", "h1"] and all(d["started"] for d in state.mps.values())
        assert [(d.node, d.running, d.control_pipe) for d in status("colo-ssh").mps] == [
            ("h0", True, True),
            ("h1", True, True),
        ]
    finally:
        down("colo-ssh", events=lambda who, what: events.append((who, what)))
    stopped = dict(e for e in events if e[0].startswith("mps.") and e[1].startswith("stopped"))
    assert stopped["mps.h0"] == "stopped (quit)"
    assert "still running after 2s (clients hang?), killed" in stopped["mps.h1"]
    for d in plan.mps:
        assert [c["command"] for c in calls(d.log_dir) if c["call"] == "command"] == ["quit"]


def test_the_agent_expands_the_mps_directories_in_a_process_env(tmp_path, monkeypatch) -> None:
    """The planner writes them under the node's workdir as the topology spells it (``~/...``);
    the CUDA driver reads them literally, so the agent expands them as it does cwd and log paths."""
    from pdctl.node import agent

    monkeypatch.setenv("HOME", str(tmp_path))
    env = {"CUDA_MPS_PIPE_DIRECTORY": "~/run/mps/pipe", "CUDA_MPS_LOG_DIRECTORY": "~/run/mps/log", "OTHER": "~/x"}
    spec = {"id": "p", "argv": SLEEPER, "env": env, "cwd": "~/run", "log_path": "~/run/logs/p.log"}
    started = agent.spawn({"processes": [spec]})["started"]["p"]
    try:
        seen = environ(started["pid"])
        assert seen["CUDA_MPS_PIPE_DIRECTORY"] == f"{tmp_path}/run/mps/pipe"
        assert seen["CUDA_MPS_LOG_DIRECTORY"] == f"{tmp_path}/run/mps/log"
        assert seen["OTHER"] == "~/x"  # other values are the user's, untouched
    finally:
        psutil.Process(started["pid"]).kill()


@pytest.mark.netns
def test_mps_that_fails_on_one_ssh_host_stops_the_other_hosts_daemon(clean_hosts, pdctl_home) -> None:
    top = two_hosts(clean_hosts, "colo-fail", 26500, "fail")
    plan = make_plan(top)
    with pytest.raises(LifecycleError, match=r"node h1: agent mps-start: .* -d exited 1: An MPS control daemon"):
        up(top, plan, ready_timeout_secs=60)
    h0, h1 = plan.mps
    assert [c["call"] for c in calls(h0.log_dir)] == ["start", "client", "command"]  # h0's started, then quit
    assert [c["call"] for c in calls(h1.log_dir)] == ["start"]
    state = StateStore().load("colo-fail")
    assert state.status == "down" and not state.processes and not state.mps
