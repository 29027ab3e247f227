"""Self-healing on localhost nodes, driven as a user would: `pdctl up`, clients through the
router, `kill -9` of engine and router processes, `pdctl weights load`, `pdctl status`, `pdctl
down`. No pdctl command runs while the cluster heals: the nodes' supervisors do it alone."""

from __future__ import annotations

import json
import os
import signal
import time
from functools import partial
from pathlib import Path

from pdctl.sim.model import resolve_model, save_checkpoint
from tests.cluster.local_cluster import (
    PACED,
    Clients,
    router_url,
    router_workers,
    status_by_process,
    wait_back,
    wait_in_rotation,
)
from tests.helpers import engine_auth, eventually, free_port_base, get, local_topology, pdctl, post, run_processes


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
        status = status_by_process(env)
        router = router_url(env, "heal", status)
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
            wait_in_rotation(router, urls["decode-0"])
            back = wait_back(env, "decode-0", old["pid"], 1)
            assert back["ports"] == old["ports"] and back["last_exit"]["code"] == -signal.SIGKILL
            wait_in_rotation(router, urls["decode-0"])

            # 2. After a load from disk, a killed engine comes back holding the loaded version.
            load = pdctl("weights", "load", str(tmp_path / "ckpt"), "heal", "--version", "B", env=env)
            assert load.returncode == 0, load.stderr
            loaded_at = time.monotonic()
            old = status_by_process(env)["prefill-0"]
            os.kill(old["pid"], signal.SIGKILL)
            wait_back(env, "prefill-0", old["pid"], 1)
            assert wait_in_rotation(router, urls["prefill-0"], "B")["weight_version"] == "B"
            old = status_by_process(env)["decode-1"]
            os.kill(old["pid"], signal.SIGKILL)
            wait_back(env, "decode-1", old["pid"], 1)
            wait_in_rotation(router, urls["decode-1"], "B")
            # a request or two through the healed pair before the clients stop
            eventually(clients.answered_lately, 60, what="an answer through the healed pair")
        assert not clients.failed(), clients.failed()[:3]
        after = [a for a in clients.answers if a[0] > loaded_at]
        assert after and all(a[2] == "B" for a in after), {a[2] for a in after}

        # 3. kill -9 of the router: back on its port; it still keeps the fleet's version.
        old = status_by_process(env)["router"]
        os.kill(old["pid"], signal.SIGKILL)
        back = wait_back(env, "router", old["pid"], 1)
        assert back["ports"] == old["ports"]
        wait_in_rotation(router, urls["decode-0"], "B")
        code, out = post(router + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4}})
        assert code == 200 and out["meta_info"]["weight_version"] == "B"
        final = status_by_process(env)
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
        after = status_by_process(env)
        assert all(after[i]["pid"] != final[i]["pid"] for i in urls), (after, final)
        assert all(w["weight_version"] == "B" and not w["quarantined"] for w in router_workers(router).values())
        final = after

        # 5. `down` while an engine is being restarted leaves nothing behind, supervisors included.
        old = final["decode-0"]
        os.kill(old["pid"], signal.SIGKILL)
        down = pdctl("down", "heal", env=env)
        assert down.returncode == 0, down.stderr
        assert run_processes(state["run_id"]) == []
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
        router = router_url(env, "grow")
        with Clients(router) as clients:
            edit(decode={"replicas": 3, "args": PACED})
            dry = pdctl("apply", topo, "--dry-run", env=env)
            assert dry.returncode == 0 and "+ add decode-2" in dry.stdout, dry.stdout + dry.stderr
            assert "decode-2" not in status_by_process(env), "--dry-run started nothing"
            before = status_by_process(env)
            grown = pdctl("apply", topo, env=env, timeout=600)
            assert grown.returncode == 0, grown.stderr
            after = status_by_process(env)
            assert after["decode-2"]["alive"] and after["decode-2"]["healthy"]
            assert {i: after[i]["pid"] for i in before if i} == {i: before[i]["pid"] for i in before if i}, (
                "adding an engine left the others alone"
            )
            wait_in_rotation(router, after["decode-2"]["url"])

            edit(decode={"replicas": 2, "args": PACED})
            shrunk = pdctl("apply", topo, env=env, timeout=600)
            assert shrunk.returncode == 0 and "- remove decode-2" in shrunk.stdout, shrunk.stderr
            assert "decode-2" not in status_by_process(env) and after["decode-2"]["url"] not in router_workers(router)

            edit(prefill={"replicas": 2}, decode={"replicas": 2, "args": {**PACED, "max-running-requests": 16}})
            changed = pdctl("apply", topo, env=env, timeout=600)
            assert changed.returncode == 0, changed.stderr
            assert "+ add prefill-1" in changed.stdout and "~ replace decode-0" in changed.stdout, changed.stdout
            final = status_by_process(env)
            assert final["prefill-0"]["pid"] == before["prefill-0"]["pid"]
            assert final["decode-0"]["pid"] != before["decode-0"]["pid"]
            assert final["router"]["pid"] == before["router"]["pid"], "the router learned its workers live"
            assert final["decode-0"]["ports"] == before["decode-0"]["ports"], "a replaced engine keeps its ports"
            for i in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
                wait_in_rotation(router, final[i]["url"])
        assert clients.answers and not clients.failed(), clients.failed()[:3]

        edit(model={"path": "sim://small"})
        refused = pdctl("apply", topo, env=env)
        assert refused.returncode == 1 and "model.path: 'sim://tiny' -> 'sim://small'" in refused.stderr
        assert status_by_process(env)[""]["ok"]

        # --recreate takes the cluster down and up on the edited file: new processes, the new model
        recreated = pdctl("apply", topo, "--recreate", env=env, timeout=600)
        assert recreated.returncode == 0, recreated.stderr
        again = status_by_process(env)
        assert again[""]["ok"] and again["decode-0"]["pid"] != final["decode-0"]["pid"]
        code, info = get(again["decode-0"]["url"] + "/model_info", headers=engine_auth("grow", env["PDCTL_HOME"]))
        assert code == 200 and info["model_path"] == "sim://small", info
    finally:
        pdctl("down", "grow", env=env)


def test_the_sixth_crash_within_ten_minutes_leaves_the_engine_down_and_status_says_why(tmp_path) -> None:
    node = {"name": "me", "host": "127.0.0.1", "gpus": 2, "workdir": str(tmp_path / "runs")}
    null = {"args": {"sim-null": True}}  # (its supervisor is the subject, not the model: no torch to import)
    topo = local_topology(tmp_path, "loop", free_port_base(), nodes=[node], prefill=null, decode=null)
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
        # (8 s: a restarted engine answering late on a loaded 2-core machine must not be taken for hung again)
        decode={"replicas": 2, "args": PACED, "liveness_timeout_secs": 8},
        router={"health": {"liveness_timeout_secs": 2}},
        nodes=[node],
    )
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    state = json.loads((tmp_path / "home" / "hung" / "state.json").read_text())
    try:
        status = status_by_process(env)
        router = router_url(env, "hung")
        url = status["decode-0"]["url"]
        old = status["decode-0"]
        with Clients(router) as clients:
            eventually(lambda: any(a[1] == 200 for a in clients.answers), 60, what="a first answer")
            os.kill(old["pid"], signal.SIGSTOP)
            stopped_at = time.monotonic()
            # out of rotation, the router's own doing
            eventually(
                lambda: not router_workers(router)[url]["is_healthy"], 30, interval=0.1, what="the hung decode out"
            )
            back = wait_back(env, "decode-0", old["pid"], 1)  # killed and restarted by its supervisor
            assert back["last_exit"]["code"] == -signal.SIGKILL and "liveness" in back["last_exit"]["why"], back
            wait_in_rotation(router, url)
            eventually(clients.answered_lately, 60, what="an answer through the healed decode")
        assert not clients.failed(), clients.failed()[:3]
        assert any(a[0] > stopped_at for a in clients.answers)
        shown = pdctl("status", "hung", env=env)
        assert "liveness" in shown.stdout, shown.stdout
    finally:
        pdctl("down", "hung", env=env)
    assert run_processes(state["run_id"]) == []
