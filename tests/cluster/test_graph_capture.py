"""``up`` captures the decode CUDA graphs of a role_switch fleet's prefills (issue 58): each flips
to decode and back, cordoned, before ``up`` returns, so that no later switch pays the capture.
On sim engines costed as an 8B model on an H100, whose first flip to decode waits the graph
capture (``--sim-graph-capture-secs``) and whose ``/server_info`` says, as SGLang's does, which
decode graph batch sizes it captured (none on a prefill never switched)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdctl.cluster.graph_capture import capture_decode_graphs
from pdctl.cluster.router_control import RouterControl
from pdctl.cluster.state import StateStore
from tests.cluster.local_cluster import interrupted, wait_back
from tests.helpers import (
    control_auth,
    engine_auth,
    eventually,
    free_port_base,
    get,
    held_generate,
    local_topology,
    pdctl,
    post,
    run_processes,
)

pytestmark = pytest.mark.timeout(300)

COSTED = {"sim-profile": "llama3-8b-h100"}


def _topology(tmp: Path, name: str, capture_secs: float, planner: dict) -> str:
    switchable = {"replicas": 2, "role_switch": True}
    return local_topology(
        tmp,
        name,
        free_port_base(),
        nodes=[{"name": "me", "host": "127.0.0.1", "gpus": 4, "workdir": str(tmp / "runs")}],
        prefill={**switchable, "args": {**COSTED, "sim-graph-capture-secs": capture_secs}},
        decode={**switchable, "args": COSTED},
        planner=planner,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[dict, str, str]]:
    tmp = tmp_path_factory.mktemp("graphs")
    # advise: its planner switches nothing; capture_graphs_at_up: what act mode does unset
    topo = _topology(tmp, "gc", 1, {"mode": "advise", "capture_graphs_at_up": True})
    env = {**os.environ, "PDCTL_HOME": str(tmp / "home")}
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    try:
        yield env, "gc", up.stdout + up.stderr
    finally:
        run_id = json.loads((tmp / "home" / "gc" / "state.json").read_text())["run_id"]
        assert pdctl("down", "gc", env=env).returncode == 0
        assert run_processes(run_id) == []


def _status(env: dict) -> dict:
    return json.loads(pdctl("status", "--json", env=env).stdout)


def _engines(env: dict) -> dict[str, dict]:
    return {p["id"]: p for p in _status(env)["processes"] if p["role"] in ("prefill", "decode")}


def _router(env: dict) -> str:
    return next(p["url"] for p in _status(env)["processes"] if p["role"] == "router")


def _log(env: dict, engine_id: str) -> str:
    return pdctl("logs", "gc", engine_id, "--lines", "1000", env=env).stdout


def _internal(url: str, name: str, env: dict) -> dict:
    return get(url + "/server_info", headers=engine_auth(name, env["PDCTL_HOME"]))[1]["internal_states"][0]


def _in_rotation(env: dict, name: str) -> dict[str, bool]:
    workers = get(_router(env) + "/workers", headers=control_auth(name, env["PDCTL_HOME"]))[1]["workers"]
    return {w["url"]: w["is_healthy"] and not w["quarantined"] and not w["cordoned"] for w in workers}


def test_up_leaves_every_prefill_captured_in_rotation_and_serving(cluster) -> None:
    env, name, out = cluster
    assert "captured on 2 of 2 prefill(s)" in out, out
    engines = _engines(env)
    rotation = _in_rotation(env, name)
    for engine_id in ("prefill-0", "prefill-1"):
        url = engines[engine_id]["url"]
        internal = _internal(url, name, env)
        assert internal["disaggregation_mode"] == "prefill"
        assert internal["decode_cuda_graph_bs"], f"{engine_id} says it captured no decode graphs"
        assert rotation[url], f"{engine_id} left out of rotation"
        log = _log(env, engine_id)
        there = log.index("PD role switch succeeded: prefill -> decode")
        assert log.index("PD role switch succeeded: decode -> prefill") > there
    for engine_id in ("decode-0", "decode-1"):  # started as decodes: captured at start, never flipped
        assert "PD role switch" not in _log(env, engine_id)
    asked = {"text": "after the capture", "sampling_params": {"max_new_tokens": 4}}
    code, body = post(_router(env) + "/generate", asked)
    assert code == 200 and body["meta_info"]["completion_tokens"] == 4, body


def _held(url: str, bootstrap_port: int, name: str, env: dict) -> socket.socket:
    """A request sent to the prefill at ``url`` directly, whose decode never comes for its KV: the
    prefill holds it (its bootstrap queue) until the connection closes."""
    body = {
        "text": "never taken",
        "sampling_params": {"max_new_tokens": 4},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": 4343,
    }
    held = held_generate(url, body, engine_auth(name, env["PDCTL_HOME"])["Authorization"])

    def busy() -> bool:
        internal = _internal(url, name, env)
        keys = ("num_running_reqs", "num_queue_reqs", "num_prefill_prealloc_queue_reqs")
        return sum(internal.get(k) or 0 for k in keys) >= 1

    eventually(busy, 60, interval=0.02, what="the prefill holding the request")
    return held


def test_the_planner_counts_the_prefills_captured_at_up_as_captured(cluster) -> None:
    """The planner knew only the engines it saw run as decodes; it asks each prefill process once
    what its /server_info says, so the prefills up captured are cheap to move to decode."""
    import asyncio

    import aiohttp

    from pdctl.cluster.keys import load_keys
    from pdctl.cluster.planner_loop import PlannerLoop, observe
    from pdctl.cluster.sampling import Sampler
    from pdctl.role_planner.config import PlannerConfig

    env, name, _ = cluster
    store = StateStore(Path(env["PDCTL_HOME"]))
    state = store.load(name)
    loop = PlannerLoop(name, PlannerConfig.from_dict({"mode": "advise"}), store)

    async def ask_and_sample() -> list:
        async with aiohttp.ClientSession() as session:
            sampler = Sampler(state, load_keys(store, name), session, versions_and_workers=False)
            await loop._ask_captured(sampler, state)
            return [await sampler.sample(), await sampler.sample()]

    samples = asyncio.run(ask_and_sample())
    prefills = {rec.url for rec in state.processes.values() if rec.role.value == "prefill"}
    assert {url for url, _ in loop.asked_graphs} == prefills
    loads = {e.id: e for e in observe(state, samples, loop.decoded).engines}
    assert loads["prefill-0"].captured and loads["prefill-1"].captured, loads
    unasked = {e.id: e for e in observe(state, samples, set()).engines}  # what it knew before it asked
    assert not unasked["prefill-0"].captured and not unasked["prefill-1"].captured


def test_a_restarted_prefill_captures_before_it_is_back_in_rotation(cluster) -> None:
    """``pdctl restart`` of a prefill starts a new process, uncaptured: it flips to decode and
    back before its cordon lifts."""
    env, name, _ = cluster
    restarted = pdctl("restart", name, "prefill-0", env=env)
    assert restarted.returncode == 0, restarted.stderr
    assert "prefill-0: captured" in restarted.stdout + restarted.stderr, restarted.stdout + restarted.stderr
    url = _engines(env)["prefill-0"]["url"]
    internal = _internal(url, name, env)
    assert internal["disaggregation_mode"] == "prefill" and internal["decode_cuda_graph_bs"]
    assert _in_rotation(env, name)[url]


def test_a_busy_prefill_refuses_serves_on_uncaptured_and_a_later_capture_takes(cluster) -> None:
    """A prefill its supervisor restarted (kill -9) is a new process, uncaptured; kept busy, it
    refuses the flip ("not idle"): it serves on as a prefill in rotation, said so; idle again, the
    capture takes."""
    env, name, _ = cluster
    engines = _engines(env)
    os.kill(engines["prefill-1"]["pid"], signal.SIGKILL)
    wait_back(env, "prefill-1", engines["prefill-1"]["pid"], 1)
    url = engines["prefill-1"]["url"]
    eventually(lambda: _in_rotation(env, name).get(url), 60, what="prefill-1 back in rotation")
    assert _internal(url, name, env)["decode_cuda_graph_bs"] == []
    store = StateStore(Path(env["PDCTL_HOME"]))
    said: list[str] = []

    def events(subject: str, text: str) -> None:
        said.append(f"{subject}: {text}")

    state = store.load(name)
    held = _held(url, engines["prefill-1"]["ports"]["bootstrap"], name, env)
    try:
        capture_decode_graphs(state, store, RouterControl.of(state, store), events)
    finally:
        held.close()
    assert any("not captured: prefill-1" in line and "not idle" in line for line in said), said
    assert "captured on 0 of 1 prefill(s)" in said[-1], said
    internal = _internal(url, name, env)
    assert internal["disaggregation_mode"] == "prefill" and internal["decode_cuda_graph_bs"] == []
    assert _in_rotation(env, name)[url]
    eventually(lambda: _internal(url, name, env)["num_prefill_prealloc_queue_reqs"] == 0, 60, what="it let go")
    said.clear()
    capture_decode_graphs(state, store, RouterControl.of(state, store), events)
    assert "captured on 1 of 1 prefill(s)" in said[-1], said
    assert _internal(url, name, env)["decode_cuda_graph_bs"]
    assert _in_rotation(env, name)[url]


def test_a_flip_refused_as_not_idle_is_asked_again_once_what_ran_there_ended(cluster, monkeypatch) -> None:
    """A request at the engine as its switch is asked (seen: the router's health check, a one-token
    generation, at the prefill `restart` was bringing back) refuses the flip as not idle; once it
    ended and the engine is seen idle, the flip is asked again and takes."""
    from pdctl.cluster import role_call
    from pdctl.cluster.graph_capture import flip_there_and_back

    env, name, _ = cluster
    engines = _engines(env)
    url = engines["prefill-1"]["url"]
    store = StateStore(Path(env["PDCTL_HOME"]))
    state = store.load(name)
    engine = next(e for e in state.plan.engines if e.id == "prefill-1")
    router = RouterControl.of(state, store)
    router.cordon(url, True, reason="test: a flip refused as not idle", handoff=True)
    held = _held(url, engines["prefill-1"]["ports"]["bootstrap"], name, env)
    waited: list[str] = []
    wait_idle = role_call._wait_idle

    def the_request_ends_then_wait(client, at: str, secs: float) -> bool:
        waited.append(at)  # (called only after a refusal as not idle)
        held.close()
        return wait_idle(client, at, secs)

    monkeypatch.setattr(role_call, "_wait_idle", the_request_ends_then_wait)
    try:
        why = flip_there_and_back(state, store, engine, url)
    finally:
        held.close()
        router.cordon(url, False)
    assert why == "" and waited == [url], (why, waited)
    internal = _internal(url, name, env)
    assert internal["disaggregation_mode"] == "prefill" and internal["decode_cuda_graph_bs"]


def test_ctrl_c_while_a_switch_is_refused_as_not_idle_asks_no_more(cluster) -> None:
    """Ctrl-C as `pdctl switch` asks a busy engine: the refusal is the answer, the switch is not
    asked again once what ran there ended (the user asked to stop); the engine serves on as it
    was, in rotation."""
    env, name, _ = cluster
    engines = _engines(env)
    url = engines["prefill-1"]["url"]

    def refusals() -> int:
        return _log(env, "prefill-1").count("PD role switch rejected")

    before = refusals()
    held = _held(url, engines["prefill-1"]["ports"]["bootstrap"], name, env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdctl", "switch", name, "prefill-1", "decode"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "idle: asking it to switch" in line:
                proc.send_signal(signal.SIGINT)
                break
        eventually(lambda: refusals() == before + 1, 60, what="the switch refused")
        held.close()  # what ran there ends: asked again now, it would switch
        out = "".join(seen) + proc.stdout.read()
        code = proc.wait(120)
    finally:
        held.close()
        if proc.poll() is None:
            proc.kill()
    assert code != 0 and "not idle" in out and "Traceback" not in out, out
    assert refusals() == before + 1, _log(env, "prefill-1")
    assert _internal(url, name, env)["disaggregation_mode"] == "prefill"
    assert "prefill-1" in _engines(env)
    eventually(lambda: _in_rotation(env, name).get(url), 60, what="prefill-1 back in rotation")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_up_interrupted_while_it_captures_stops_everything(tmp_path, sig) -> None:
    """Ctrl-C (or SIGTERM, or a closed terminal: SIGHUP) while the prefills capture (60 s each): up
    stops every process at once, without waiting for the captures; status says down, and down
    again changes nothing."""
    topo = _topology(tmp_path, "gci", 60, {"mode": "act"})  # act: the capture unset is on
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}
    try:
        code, out = interrupted("up", topo, at="graphs: capturing", env=env, sig=sig)
    except BaseException:  # (an up that was not interrupted runs on: a failed check must not leave it)
        pdctl("down", "gci", env=env)
        raise
    assert code != 0 and "everything that started was stopped" in out, out
    assert "Traceback" not in out
    state = json.loads((tmp_path / "home" / "gci" / "state.json").read_text())
    assert state["status"] == "down"
    assert run_processes(state["run_id"]) == [], "up left processes of the cluster running"
    status = pdctl("status", "gci", env=env)
    assert "down" in status.stdout and "Traceback" not in status.stdout + status.stderr, status.stdout
    again = pdctl("down", "gci", env=env)
    assert again.returncode == 0, again.stderr
