"""The planner as a process of the cluster: ``up`` starts it, its supervisor restarts it after a
kill -9, ``status`` shows it, ``down`` stops it and leaves nothing of the cluster running."""

from __future__ import annotations

import json
import os
import signal

from pdctl.cluster.keys import load_keys
from pdctl.cluster.state import StateStore
from pdctl.step_hint import announce_step
from pdctl.weights.env import CONTROL_KEY_ENV, ROUTER_URL_ENV
from tests.cluster.local_cluster import router_url
from tests.helpers import eventually, free_port_base, local_topology, pdctl, run_processes


def _status(env: dict) -> dict:
    out = pdctl("status", "--json", env=env)
    return json.loads(out.stdout)


def test_up_starts_the_planner_a_kill_brings_it_back_and_down_stops_it(tmp_path) -> None:
    switchable = {"replicas": 1, "role_switch": True}
    topo = local_topology(
        tmp_path,
        "pln",
        free_port_base(),
        nodes=[{"name": "me", "host": "127.0.0.1", "gpus": 2, "workdir": str(tmp_path / "runs")}],
        prefill=switchable,
        decode=switchable,
        planner={"mode": "advise", "interval_secs": 1},
    )
    home = tmp_path / "home"
    env = {**os.environ, "PDCTL_HOME": str(home)}
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    run_id = json.loads((home / "pln" / "state.json").read_text())["run_id"]
    try:
        assert "planner: started (mode advise" in up.stderr, up.stderr
        # it decides: an idle fleet, nothing to move
        history = eventually(
            lambda: json.loads(pdctl("planner", "pln", "--history", env=env).stdout), 120, what="a first decision"
        )
        assert history[0]["mode"] == "advise" and history[0]["action"] == "stay", history
        st = _status(env)
        first = st["planner_process"]
        assert first["alive"] and first["restarts"] == 0 and st["ok"] is True, first
        text = pdctl("status", env=env)
        assert "planner: running" in text.stdout + text.stderr
        # A step announced while it is down (stopped, then killed) is a boundary to it once it is back:
        # it recalls how many it had seen (its record), and the router's count is one more.
        os.kill(first["pid"], signal.SIGSTOP)
        control_key = load_keys(StateStore(home), "pln").control
        router_env = {ROUTER_URL_ENV: router_url(env, "pln"), CONTROL_KEY_ENV: control_key}
        assert announce_step(prompt_tokens=5000, requests=4, env=router_env) == 1
        os.kill(first["pid"], signal.SIGKILL)  # the planner itself, not its supervisor
        back = eventually(
            lambda: (p := _status(env)["planner_process"])["restarts"] >= 1 and p["alive"] and p["pid"] != first["pid"]
            and p,
            120,
            what="the planner restarted by its supervisor",
        )  # fmt: skip
        assert back["supervisor_pid"] == first["supervisor_pid"]
        boundary = eventually(
            lambda: [
                d
                for d in json.loads(pdctl("planner", "pln", "--history", env=env).stdout)
                if "a step boundary (5000 prompt tokens)" in d["reason"]
            ],
            120,
            what="the restarted planner's decision at the step announced while it was down",
        )
        assert boundary[0]["figures"]["steps_seen"] == 1, boundary
    finally:
        down = pdctl("down", "pln", env=env)
        assert down.returncode == 0, down.stderr
    assert "and its planner" in down.stdout, down.stdout
    assert run_processes(run_id) == [], "down left processes of the cluster running (the planner?)"
    assert json.loads((home / "pln" / "state.json").read_text())["planner"] == {}
    again = pdctl("down", "pln", env=env)
    assert again.returncode == 0 and "already down" in again.stdout + again.stderr
