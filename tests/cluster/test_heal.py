"""Self-healing on localhost nodes, driven as a user would: `pdctl up`, clients through the
router, `kill -9` of engine and router processes, `pdctl weights load`, `pdctl status`, `pdctl
down`. No pdctl command runs while the cluster heals: the nodes' supervisors do it alone."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from functools import partial
from pathlib import Path

import psutil

from pdctl.sim.model import resolve_model, save_checkpoint
from tests.cluster.test_local_cli import local_topology, pdctl
from tests.helpers import control_auth, engine_auth, eventually, free_port_base, get, post


def _status(env: dict) -> dict[str, dict]:
    st = pdctl("status", "--json", env=env)
    return {p["id"]: p for p in json.loads(st.stdout)["processes"]} | {"": {"ok": st.returncode == 0}}


CONTROL: dict[str, dict[str, str]] = {}
"""Router URL -> its cluster's control-plane header (``/workers`` is control plane)."""


def _router(env: dict, name: str) -> str:
    url = _status(env)["router"]["url"]
    CONTROL[url] = control_auth(name, env["PDCTL_HOME"])
    return url


def _workers(router: str) -> dict[str, dict]:
    return {w["url"]: w for w in get(router + "/workers", timeout=10, headers=CONTROL[router])[1]["workers"]}


def _wait_back(env: dict, proc: str, old_pid: int, restarts: int) -> dict:
    """Wait until ``proc`` runs again under a new pid, healthy, with its restart counted."""

    def back() -> dict | None:
        p = _status(env)[proc]
        return p if p["pid"] != old_pid and p["alive"] and p["healthy"] and p["restarts"] == restarts else None

    return eventually(back, 120, interval=0.2, what=f"{proc} back (restart {restarts})")


def _wait_in_rotation(router: str, url: str, version: str | None = None) -> dict:
    """Wait until the router has ``url`` in rotation (on ``version``, when given)."""

    def in_rotation() -> dict | None:
        w = _workers(router).get(url)
        return w if w and w["is_healthy"] and not w["quarantined"] and version in (None, w["weight_version"]) else None

    return eventually(in_rotation, 120, interval=0.1, ignore=(OSError,), what=f"{url} in rotation")


PACED = {"sim-decode-ms-per-step": 10}
"""Decode steps paced like a real engine's (10 ms each): requests stay in flight across kills and
restarts, and the clients' closed loop does not spend the CPU the restarts need."""


class Clients:
    """Requests through the router from two threads until stopped: (sent at, status, version)."""

    def __init__(self, router: str):
        self.router, self.answers = router, []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run) for _ in range(2)]

    def _run(self) -> None:
        body = {"text": "heal me", "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
        while not self.stop.is_set():
            sent = time.monotonic()
            try:
                status, out = post(self.router + "/generate", body, timeout=120)
            except OSError as exc:
                status, out = 0, {"error": str(exc)}
            self.answers.append((sent, status, out.get("meta_info", {}).get("weight_version"), out))

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def failed(self, since: float = 0.0) -> list:
        return [a for a in self.answers if a[0] >= since and a[1] != 200]

    def answered_lately(self) -> list:
        """The answers (200) to requests sent in the last half second."""
        return [a for a in self.answers if a[0] > time.monotonic() - 0.5 and a[1] == 200]


def _run_processes(run_id: str) -> list[int]:
    """Every process on this machine whose environment carries the cluster's run id."""
    out = []
    needle = f"PDCTL_RUN_ID={run_id}".encode()
    for p in psutil.process_iter(["pid"]):
        try:
            if needle in Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0") and p.status() != "zombie":
                out.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return out


def test_killed_engines_and_router_come_back_on_their_ports_and_the_fleets_version(tmp_path) -> None:
    node = {"name": "me", "host": "127.0.0.1", "gpus": 4, "workdir": str(tmp_path / "runs")}
    topo = local_topology(
        tmp_path,
        "heal",
        free_port_base(),
        prefill={"replicas": 2},
        decode={"replicas": 2, "args": PACED},
        nodes=[node],
    )
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}
    save_checkpoint(resolve_model("sim://tiny?seed=5", "auto", None), tmp_path / "ckpt")
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    state = json.loads((tmp_path / "home" / "heal" / "state.json").read_text())
    try:
        status = _status(env)
        router = _router(env, "heal")
        urls = {i: status[i]["url"] for i in ("prefill-0", "prefill-1", "decode-0", "decode-1")}
        with Clients(router) as clients:
            # 1. kill -9 of a decode under load: back on its port, 0 failed requests. No pdctl command
            #    runs until it is back: its supervisor's file and the router say so.
            old = status["decode-0"]
            story = tmp_path / "runs" / "heal" / "logs" / "decode-0.log.exit"
            os.kill(old["pid"], signal.SIGKILL)
            eventually(
                lambda: json.loads(story.read_text()).get("pid") not in (old["pid"], None),
                60,
                what="decode-0's supervisor starting it again",
            )
            _wait_in_rotation(router, urls["decode-0"])
            back = _wait_back(env, "decode-0", old["pid"], 1)
            assert back["ports"] == old["ports"] and back["last_exit"]["code"] == -signal.SIGKILL
            _wait_in_rotation(router, urls["decode-0"])

            # 2. After a load from disk, a killed engine comes back holding the loaded version.
            load = pdctl("weights", "load", str(tmp_path / "ckpt"), "heal", "--version", "B", env=env)
            assert load.returncode == 0, load.stderr
            loaded_at = time.monotonic()
            old = _status(env)["prefill-0"]
            os.kill(old["pid"], signal.SIGKILL)
            _wait_back(env, "prefill-0", old["pid"], 1)
            assert _wait_in_rotation(router, urls["prefill-0"], "B")["weight_version"] == "B"
            old = _status(env)["decode-1"]
            os.kill(old["pid"], signal.SIGKILL)
            _wait_back(env, "decode-1", old["pid"], 1)
            _wait_in_rotation(router, urls["decode-1"], "B")
            # a request or two through the healed pair before the clients stop
            eventually(clients.answered_lately, 60, what="an answer through the healed pair")
        assert not clients.failed(), clients.failed()[:3]
        after = [a for a in clients.answers if a[0] > loaded_at]
        assert after and all(a[2] == "B" for a in after), {a[2] for a in after}

        # 3. kill -9 of the router: back on its port; it still keeps the fleet's version.
        old = _status(env)["router"]
        os.kill(old["pid"], signal.SIGKILL)
        back = _wait_back(env, "router", old["pid"], 1)
        assert back["ports"] == old["ports"]
        _wait_in_rotation(router, urls["decode-0"], "B")
        code, out = post(router + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4}})
        assert code == 200 and out["meta_info"]["weight_version"] == "B"
        final = _status(env)
        assert final[""]["ok"], final
        restarts = {i: final[i]["restarts"] for i in urls.keys() | {"router"}}
        assert restarts == {"prefill-0": 1, "prefill-1": 0, "decode-0": 1, "decode-1": 1, "router": 1}

        # 4. A rolling restart of every engine under load: 0 failed requests, every engine on a new
        #    pid and back on the fleet's version (loaded by the router), one at a time.
        bad = pdctl("restart", "heal", "nosuch", env=env)
        assert bad.returncode == 1 and "no engine or process 'nosuch'" in bad.stderr, bad.stderr
        with Clients(router) as clients:
            rolled = pdctl("restart", "heal", env=env, timeout=600)
        assert rolled.returncode == 0, rolled.stderr
        assert "restarted prefill-0, prefill-1, decode-0, decode-1" in rolled.stdout
        assert not clients.failed(), clients.failed()[:3]
        assert clients.answers and all(a[2] == "B" for a in clients.answers)
        after = _status(env)
        assert all(after[i]["pid"] != final[i]["pid"] for i in urls), (after, final)
        assert all(w["weight_version"] == "B" and not w["quarantined"] for w in _workers(router).values())
        final = after

        # 5. `down` while an engine is being restarted leaves nothing behind, supervisors included.
        old = final["decode-0"]
        os.kill(old["pid"], signal.SIGKILL)
        down = pdctl("down", "heal", env=env)
        assert down.returncode == 0, down.stderr
        assert _run_processes(state["run_id"]) == []
    finally:
        pdctl("down", "heal", env=env)


def test_apply_scales_and_replaces_under_load_without_failing_a_request(tmp_path) -> None:
    """`pdctl apply` of an edited file on a running cluster: decodes 2 -> 3 -> 2, prefills 1 -> 2,
    a decode flag changed; --dry-run changes nothing; a model change is refused naming its field."""
    import yaml

    node = {"name": "me", "host": "127.0.0.1", "gpus": 8, "workdir": str(tmp_path / "runs")}
    base = free_port_base()
    topo = local_topology(tmp_path, "grow", base, decode={"replicas": 2, "args": PACED}, nodes=[node])
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}
    assert pdctl("up", topo, env=env).returncode == 0

    def edit(**sections) -> str:
        data = yaml.safe_load(Path(topo).read_text())
        data.update(sections)
        Path(topo).write_text(yaml.safe_dump(data))
        return topo

    try:
        router = _router(env, "grow")
        with Clients(router) as clients:
            edit(decode={"replicas": 3, "args": PACED})
            dry = pdctl("apply", topo, "--dry-run", env=env)
            assert dry.returncode == 0 and "+ add decode-2" in dry.stdout, dry.stdout + dry.stderr
            assert "decode-2" not in _status(env), "--dry-run started nothing"
            before = _status(env)
            grown = pdctl("apply", topo, env=env, timeout=600)
            assert grown.returncode == 0, grown.stderr
            after = _status(env)
            assert after["decode-2"]["alive"] and after["decode-2"]["healthy"]
            assert {i: after[i]["pid"] for i in before if i} == {i: before[i]["pid"] for i in before if i}, (
                "adding an engine left the others alone"
            )
            _wait_in_rotation(router, after["decode-2"]["url"])

            edit(decode={"replicas": 2, "args": PACED})
            shrunk = pdctl("apply", topo, env=env, timeout=600)
            assert shrunk.returncode == 0 and "- remove decode-2" in shrunk.stdout, shrunk.stderr
            assert "decode-2" not in _status(env) and after["decode-2"]["url"] not in _workers(router)

            edit(prefill={"replicas": 2}, decode={"replicas": 2, "args": {**PACED, "max-running-requests": 16}})
            changed = pdctl("apply", topo, env=env, timeout=600)
            assert changed.returncode == 0, changed.stderr
            assert "+ add prefill-1" in changed.stdout and "~ replace decode-0" in changed.stdout, changed.stdout
            final = _status(env)
            assert final["prefill-0"]["pid"] == before["prefill-0"]["pid"]
            assert final["decode-0"]["pid"] != before["decode-0"]["pid"]
            assert final["router"]["pid"] == before["router"]["pid"], "the router learned its workers live"
            assert final["decode-0"]["ports"] == before["decode-0"]["ports"], "a replaced engine keeps its ports"
            for i in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
                _wait_in_rotation(router, final[i]["url"])
        assert clients.answers and not clients.failed(), clients.failed()[:3]

        edit(model={"path": "sim://small"})
        refused = pdctl("apply", topo, env=env)
        assert refused.returncode == 1 and "model.path: 'sim://tiny' -> 'sim://small'" in refused.stderr
        assert _status(env)[""]["ok"]

        # --recreate takes the cluster down and up on the edited file: new processes, the new model
        recreated = pdctl("apply", topo, "--recreate", env=env, timeout=600)
        assert recreated.returncode == 0, recreated.stderr
        again = _status(env)
        assert again[""]["ok"] and again["decode-0"]["pid"] != final["decode-0"]["pid"]
        code, info = get(again["decode-0"]["url"] + "/model_info", headers=engine_auth("grow", env["PDCTL_HOME"]))
        assert code == 200 and info["model_path"] == "sim://small", info
    finally:
        pdctl("down", "grow", env=env)


def test_the_sixth_crash_within_ten_minutes_leaves_the_engine_down_and_status_says_why(tmp_path) -> None:
    node = {"name": "me", "host": "127.0.0.1", "gpus": 2, "workdir": str(tmp_path / "runs")}
    topo = local_topology(tmp_path, "loop", free_port_base(), nodes=[node])
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}
    assert pdctl("up", topo, env=env).returncode == 0
    story = tmp_path / "runs" / "loop" / "logs" / "decode-0.log.exit"
    try:

        def started() -> dict | None:
            current = json.loads(story.read_text())
            return current if current["state"] != "backoff" and current.get("pid") else None

        def replaced(pid: int) -> bool:
            return json.loads(story.read_text()).get("pid") != pid

        for _ in range(6):  # kill -9 each new process as soon as its supervisor started it
            current = eventually(started, 60, interval=0.02, what="decode-0 started again")
            os.kill(current["pid"], signal.SIGKILL)
            eventually(partial(replaced, current["pid"]), 60, interval=0.02, what="the killed process replaced")
        eventually(lambda: json.loads(story.read_text())["state"] == "gave_up", 60, what="its supervisor giving up")
        st = pdctl("status", "--json", env=env)
        decode = next(p for p in json.loads(st.stdout)["processes"] if p["id"] == "decode-0")
        assert st.returncode == 1 and decode["alive"] is False and decode["supervisor"] == "gave_up"
        assert decode["restarts"] == 5 and "failed 6 times within 10 minutes" in decode["reason"], decode
        table = pdctl("status", env={**env, "COLUMNS": "200"})
        assert "left down" in table.stdout and "failed 6 times within 10 minutes" in table.stdout, table.stdout
    finally:
        assert pdctl("down", "loop", env=env).returncode == 0


def test_a_hung_engine_leaves_rotation_its_requests_go_on_elsewhere_and_its_supervisor_restarts_it(
    tmp_path,
) -> None:
    """`kill -STOP` of a decode under load (a hung process: it takes connections and answers
    nothing). The router takes it out once it has answered nothing for its liveness timeout and
    fails over what it ran, as a dead decode's (0 failed requests); its node's supervisor, whose
    liveness probe (the topology's liveness_timeout_secs) finds it silent, kills and restarts it;
    status shows why."""
    node = {"name": "me", "host": "127.0.0.1", "gpus": 4, "workdir": str(tmp_path / "runs")}
    topo = local_topology(
        tmp_path,
        "hung",
        free_port_base(),
        decode={"replicas": 2, "args": PACED, "liveness_timeout_secs": 4},
        router={"health": {"liveness_timeout_secs": 2}},
        nodes=[node],
    )
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    state = json.loads((tmp_path / "home" / "hung" / "state.json").read_text())
    try:
        status = _status(env)
        router = _router(env, "hung")
        url = status["decode-0"]["url"]
        old = status["decode-0"]
        with Clients(router) as clients:
            eventually(lambda: any(a[1] == 200 for a in clients.answers), 60, what="a first answer")
            os.kill(old["pid"], signal.SIGSTOP)
            stopped_at = time.monotonic()
            # out of rotation, the router's own doing
            eventually(lambda: not _workers(router)[url]["is_healthy"], 30, interval=0.1, what="the hung decode out")
            back = _wait_back(env, "decode-0", old["pid"], 1)  # killed and restarted by its supervisor
            assert back["last_exit"]["code"] == -signal.SIGKILL and "liveness" in back["last_exit"]["why"], back
            _wait_in_rotation(router, url)
            eventually(clients.answered_lately, 60, what="an answer through the healed decode")
        assert not clients.failed(), clients.failed()[:3]
        assert any(a[0] > stopped_at for a in clients.answers)
        shown = pdctl("status", "hung", env=env)
        assert "liveness" in shown.stdout, shown.stdout
    finally:
        pdctl("down", "hung", env=env)
    assert _run_processes(state["run_id"]) == []
