"""pdctl up / status / down / logs over real SSH to test hosts in network namespaces."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdctl.cluster import StateStore, down, logs, status, up
from pdctl.errors import LifecycleError, PdctlError
from pdctl.plan import make_plan
from pdctl.topology import load_topology_text
from tests.helpers import engine_auth, eventually, post

pytestmark = pytest.mark.netns


def topology(hosts, *, name="t", base=24000, decode_args=None, nodes=None, router_node="h0", decode_node="h1"):
    data = {
        "name": name,
        "model": {"path": "sim://tiny"},
        "engine": "sim",
        "nodes": nodes or [hosts.node(0), hosts.node(1)],
        "ports": {"base": base},
        "prefill": {"replicas": 1, "tp": 1, "nodes": ["h0"]},
        "decode": {"replicas": 1, "tp": 1, "nodes": [decode_node], "args": decode_args or {}},
        "router": {"host": "0.0.0.0", "node": router_node, "allow_unauthenticated": True},
    }
    return load_topology_text(yaml.safe_dump(data))[0]


def test_up_status_requests_down(clean_hosts, pdctl_home) -> None:
    top = topology(clean_hosts)
    plan = make_plan(top)
    state = up(top, plan, ready_timeout_secs=120)
    assert state.status == "up" and set(state.processes) == {"prefill-0", "decode-0", "router"}
    st = status("t")
    assert st.ok, st
    assert {p.weight_version for p in st.processes if p.role != "router"} == {"default"}
    assert {w["worker_type"] for w in st.router_workers} == {"prefill", "decode"}
    # a few requests through the router, from the control side
    for i in range(5):
        code, out = post(
            state.router_url + "/generate",
            {"text": f"hello {i}", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        )
        assert code == 200 and out["meta_info"]["completion_tokens"] == 8, out
    text = "".join(logs("t", "decode-0", lines=20))
    assert "fired up and ready to roll" in text
    # kill -9 of the decode on its test host: its node's supervisor restarts it on the same port,
    # with no pdctl command running meanwhile; status counts the restart
    before = next(p for p in st.processes if p.id == "decode-0")
    os.kill(before.pid, signal.SIGKILL)

    def back():
        after = next(p for p in status("t").processes if p.id == "decode-0")
        return after if after.pid != before.pid and after.alive and after.healthy else None

    after = eventually(back, 120, interval=0.2, what="decode-0 restarted and healthy")
    assert after.restarts == 1 and after.last_exit["code"] == -signal.SIGKILL and after.ports == before.ports
    eventually(lambda: status("t").ok, 30, interval=0.2, what="status ok")  # and the router takes it back
    code, out = post(state.router_url + "/generate", {"text": "back", "sampling_params": {"max_new_tokens": 4}})
    assert code == 200, out
    # the state file, the cluster's keys, the logs and their directory are private
    assert oct(StateStore().path("t").stat().st_mode & 0o777) == "0o600"
    assert oct((StateStore().dir("t") / "keys.json").stat().st_mode & 0o777) == "0o600"
    log = Path(state.processes["decode-0"].log_path)
    assert oct(log.stat().st_mode & 0o777) == "0o600" and oct(log.parent.stat().st_mode & 0o777) == "0o700"
    assert "down (3 processes stopped)" in down("t")
    assert "already down" in down("t")  # idempotent
    assert not status("t").ok


def test_busy_port_refuses_before_launching(clean_hosts, pdctl_home) -> None:
    top = topology(clean_hosts, base=24100)
    plan = make_plan(top)
    port = plan.process("decode-0").ports["http"]
    blocker = clean_hosts.hosts[1].exec(
        sys.executable,
        "-c",
        f"import socket,time; s=socket.socket(); s.bind(('0.0.0.0',{port})); s.listen(); time.sleep(120)",
    )
    try:
        host_ip = clean_hosts.hosts[1].ip

        def listens() -> bool:
            assert blocker.poll() is None, "the port blocker exited"
            socket.create_connection((host_ip, port), timeout=1).close()
            return True

        # until the blocker listens (an event, not a fixed second)
        eventually(listens, 60, ignore=(OSError,), what="the port blocker listening")
        with pytest.raises(LifecycleError) as info:
            up(top, plan, ready_timeout_secs=60)
        message = str(info.value)
        assert "preflight failed, nothing was started" in message
        assert f"node h1: port {port} is already in use by pid {blocker.pid}" in message
        assert "python" in message  # the owner's name
        assert clean_hosts.hosts[0].pids() == []  # nothing started on the other host either
    finally:
        blocker.kill()
        blocker.wait()


def test_engine_dying_at_start_rolls_back_and_shows_its_log(clean_hosts, pdctl_home) -> None:
    top = topology(clean_hosts, base=24200, decode_args={"max-running-requests": 0})
    with pytest.raises(LifecycleError) as info:
        up(top, make_plan(top), ready_timeout_secs=60)
    message = str(info.value)
    assert "decode-0 did not become ready: process exited" in message
    assert "--max-running-requests must be >= 1, got 0" in message  # its log tail
    state = StateStore().load("t")
    assert state.status == "down" and not state.processes


def test_up_killed_halfway_then_down_cleans_up(clean_hosts, pdctl_home, tmp_path) -> None:
    top_file = tmp_path / "t.yaml"
    top = topology(clean_hosts, base=24300)
    nodes = [clean_hosts.node(0), clean_hosts.node(1)]
    data = {
        "name": "t",
        "model": {"path": "sim://tiny"},
        "engine": "sim",
        "nodes": nodes,
        "ports": {"base": 24300},
        "prefill": {"nodes": ["h0"]},
        "decode": {"nodes": ["h1"]},
        "router": {"host": "0.0.0.0", "allow_unauthenticated": True},
    }
    top_file.write_text(yaml.safe_dump(data))
    assert top.name == "t"
    env = {**os.environ, "PDCTL_HOME": str(pdctl_home)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdctl", "up", str(top_file)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    state_path = pdctl_home / "t" / "state.json"
    eventually(
        lambda: state_path.exists() and json.loads(state_path.read_text())["processes"], 60, what="a process launched"
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    state = json.loads(state_path.read_text())
    assert state["status"] == "starting" and state["processes"]  # killed half way
    assert clean_hosts.stray_pids()  # engines are running without their pdctl
    result = subprocess.run(
        [sys.executable, "-m", "pdctl", "down", "t"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "is down" in result.stdout


def test_unreachable_host_is_a_clear_error(clean_hosts, pdctl_home) -> None:
    ghost = clean_hosts.node(1)
    ghost["host"] = f"10.77.{clean_hosts.subnet}.250"
    top = topology(clean_hosts, base=24400, nodes=[clean_hosts.node(0), ghost])
    with pytest.raises(LifecycleError) as info:
        up(top, make_plan(top), ready_timeout_secs=60)
    assert "preflight failed, nothing was started" in str(info.value)
    assert f"node h1 (root@{ghost['host']}:22): unreachable" in str(info.value)


def test_wrong_host_key_is_refused(clean_hosts, pdctl_home, tmp_path) -> None:
    bad = tmp_path / "known_hosts"
    lines = clean_hosts.known_hosts.read_text().splitlines()
    other_key = lines[0].split(" ", 1)[1]  # h0's key claimed for h1
    bad.write_text(f"{lines[0]}\n{clean_hosts.hosts[1].ip} {other_key}\n")
    nodes = [clean_hosts.node(0, ssh={"known_hosts": str(bad)}), clean_hosts.node(1, ssh={"known_hosts": str(bad)})]
    top = topology(clean_hosts, base=24500, nodes=nodes)
    with pytest.raises(LifecycleError) as info:
        up(top, make_plan(top), ready_timeout_secs=60)
    assert "node h1" in str(info.value) and "host key does not match" in str(info.value)
    # unknown host: refused by default, recorded with accept_new_host_key
    unknown = tmp_path / "empty_known_hosts"
    unknown.write_text("")
    nodes = [clean_hosts.node(0), clean_hosts.node(1, ssh={"known_hosts": str(unknown)})]
    top = topology(clean_hosts, base=24500, nodes=nodes)
    with pytest.raises(PdctlError, match="host key unknown"):
        up(top, make_plan(top), ready_timeout_secs=60)
    nodes[1]["ssh"]["accept_new_host_key"] = True
    top = topology(clean_hosts, base=24500, nodes=nodes)
    up(top, make_plan(top), ready_timeout_secs=120)
    assert clean_hosts.hosts[1].ip in unknown.read_text()
    down("t")


def test_trainer_starts_last_with_the_plan_env_and_stops_last(clean_hosts, pdctl_home) -> None:
    data = yaml.safe_load(
        yaml.safe_dump(
            {
                "name": "t",
                "model": {"path": "sim://tiny"},
                "engine": "sim",
                "nodes": [clean_hosts.node(0), clean_hosts.node(1)],
                "ports": {"base": 24600},
                "prefill": {"nodes": ["h0"]},
                "decode": {"nodes": ["h1"]},
                "router": {"host": "0.0.0.0", "allow_unauthenticated": True},
                "trainer": {
                    "command": [
                        "python",
                        "-c",
                        "import os,time; print('RANK', os.environ['RANK'], "
                        "os.environ['PDCTL_ROUTER_URL'], os.environ['PDCTL_WEIGHT_GROUP'], flush=True); "
                        "time.sleep(300)",
                    ],
                    "nproc_per_node": 1,
                    "nodes": ["h1"],
                    "startup_secs": 0.5,  # (it runs on: the 10 s default would be waited out in full)
                },
            }
        )
    )
    top, _ = load_topology_text(yaml.safe_dump(data))
    state = up(top, make_plan(top), ready_timeout_secs=120)
    assert state.processes["trainer.h1"].role == "trainer"

    def ranked() -> str:
        text = "".join(logs("t", "trainer.h1"))
        return text if "RANK 0" in text else ""

    text = eventually(ranked, 60, interval=0.5, what="the trainer printing its rank")
    assert "RANK 0" in text and state.router_url in text and '"world_size":3' in text
    order = []
    assert "down" in down("t", events=lambda p, m: order.append(p) if m == "stopped" else None)
    assert order[-1] == "trainer.h1"  # trainer rank 0 last


def test_status_fails_when_a_process_died(clean_hosts, pdctl_home) -> None:
    top = topology(clean_hosts, base=24700)
    state = up(top, make_plan(top), ready_timeout_secs=120)
    os.kill(state.processes["decode-0"].pid, signal.SIGKILL)  # shared pid namespace: visible here
    st = status("t")
    assert not st.ok
    assert next(p for p in st.processes if p.id == "decode-0").alive is False
    down("t")


def test_down_with_an_unreachable_node_keeps_state_and_a_retry_finishes(clean_hosts, pdctl_home) -> None:
    top = topology(clean_hosts, base=24800)
    up(top, make_plan(top), ready_timeout_secs=120)
    inner = f"{clean_hosts.prefix}p1"
    ns = clean_hosts.hosts[1].netns
    subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", inner, "down"], check=True)
    try:
        with pytest.raises(LifecycleError) as info:
            down("t")
        assert "node h1" in str(info.value) and "retry `pdctl down t`" in str(info.value)
        state = StateStore().load("t")
        assert state.status == "stopping" and set(state.processes) == {"decode-0"}  # h0's are gone
    finally:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", inner, "up"], check=True)
        subprocess.run(
            ["ip", "netns", "exec", ns, "ip", "route", "replace", "default", "via", clean_hosts.gateway], check=False
        )
    assert "down (1 processes stopped)" in down("t")


PUSH_SEEDED = (
    "from dataclasses import replace\n"
    "from pdctl.sim.model import PRESETS, TinyLM\n"
    "from pdctl.weights import WeightSync\n"
    "model = TinyLM(replace(PRESETS['tiny'], seed=41))\n"
    "with WeightSync.from_env(verify='full') as sync:\n"
    "    report = sync.push(list(model.named_parameters()), version='netns-41')\n"
    "print('PUSHED', report.engines, report.bytes, flush=True)\n"
)


def test_weight_push_across_hosts(clean_hosts, pdctl_home) -> None:
    """The trainer on one host, the engines and router on the other: a push over the network
    leaves both engines equal to the trainer's model."""
    from dataclasses import replace

    from pdctl.sim import weights_checksum
    from pdctl.sim.model import PRESETS, TinyLM

    data = {
        "name": "wx",
        "model": {"path": "sim://tiny"},
        "engine": "sim",
        "nodes": [clean_hosts.node(0), clean_hosts.node(1)],
        "ports": {"base": 24700},
        "prefill": {"nodes": ["h0"]},
        "decode": {"nodes": ["h0"]},
        "router": {"host": "0.0.0.0", "node": "h0", "allow_unauthenticated": True},
        "trainer": {"command": ["python", "-c", PUSH_SEEDED], "nproc_per_node": 1, "nodes": ["h1"]},
        "weights": {"backend": "gloo", "bucket_mb": 1},
    }
    top, _ = load_topology_text(yaml.safe_dump(data))
    up(top, make_plan(top), ready_timeout_secs=120)
    try:

        def exited():
            trainer = next(p for p in status("wx").processes if p.role == "trainer")
            return trainer if trainer.exit_code is not None else None

        trainer = eventually(
            exited, 90, interval=0.5, what=lambda: f"the trainer's exit:\n{''.join(logs('wx', 'trainer.h1'))[-2000:]}"
        )
        text = "".join(logs("wx", "trainer.h1"))
        assert trainer.exit_code == 0, text[-2000:]
        assert "PUSHED ['prefill-0', 'decode-0']" in text
        expected = weights_checksum(TinyLM(replace(PRESETS["tiny"], seed=41)))
        engines = [p for p in status("wx").processes if p.role in ("prefill", "decode")]
        assert {p.weight_version for p in engines} == {"netns-41"}
        for p in engines:
            code, out = post(p.url + "/weights_checker", {"action": "checksum"}, headers=engine_auth("wx"))
            assert code == 200 and out["checksums"] == expected, p.id
    finally:
        down("wx")


def test_apply_moves_an_engine_to_a_host_with_another_address(clean_hosts, pdctl_home) -> None:
    """Found by a probe: an apply that moved the decode to another node cordoned its new URL, which
    the router did not know (404), and stopped. The old worker goes, the new one is registered."""
    from pdctl.cluster.apply import apply

    top = topology(clean_hosts, name="mv")
    state = up(top, make_plan(top), ready_timeout_secs=120)
    try:
        old = next(e.url for e in state.plan.engines if e.id == "decode-0")
        moved = topology(clean_hosts, name="mv", decode_node="h0")
        changes = apply(moved, ready_timeout_secs=120)
        assert [(c.kind, c.unit) for c in changes.changes] == [("replace", "decode-0")], changes.text()
        st = status("mv")
        assert st.ok, st
        urls = {w["url"] for w in st.router_workers}
        new = next(e.url for e in StateStore().load("mv").plan.engines if e.id == "decode-0")
        assert new != old and new in urls and old not in urls, (old, new, urls)
        code, out = post(state.router_url + "/generate", {"text": "moved", "sampling_params": {"max_new_tokens": 4}})
        assert code == 200, out
    finally:
        down("mv")


def test_a_killed_engine_takes_the_pushed_weights_from_a_peer_on_another_host(clean_hosts, pdctl_home) -> None:
    """Weights from a peer across hosts: after a push, kill -9 of the decode on h1 brings it back
    from the prefill on h0 (its only peer of tp 1) over SGLang's engine-to-engine transfer, through
    the seed relay on h0, with no push; its weights equal the trainer's."""
    from dataclasses import replace

    from pdctl.sim import weights_checksum
    from pdctl.sim.model import PRESETS, TinyLM

    data = {
        "name": "px",
        "model": {"path": "sim://tiny"},
        "engine": "sim",
        "nodes": [clean_hosts.node(0), clean_hosts.node(1)],
        "ports": {"base": 24900},
        "prefill": {"nodes": ["h0"]},
        "decode": {"nodes": ["h1"]},
        "router": {"host": "0.0.0.0", "node": "h0", "allow_unauthenticated": True},
        "trainer": {"command": ["python", "-c", PUSH_SEEDED], "nproc_per_node": 1, "nodes": ["h0"]},
        "weights": {"backend": "gloo", "bucket_mb": 1},
    }
    top, _ = load_topology_text(yaml.safe_dump(data))
    state = up(top, make_plan(top), ready_timeout_secs=120)
    try:

        def exited():
            trainer = next(p for p in status("px").processes if p.role == "trainer")
            return trainer if trainer.exit_code is not None else None

        assert eventually(exited, 90, interval=0.5, what="the trainer's push").exit_code == 0
        decode = next(p for p in status("px").processes if p.id == "decode-0")
        assert decode.weight_version == "netns-41"
        os.kill(decode.pid, signal.SIGKILL)  # shared pid namespace: visible here

        def back():
            st = status("px")
            d = next(p for p in st.processes if p.id == "decode-0")
            return st if d.pid != decode.pid and d.weight_version == "netns-41" and st.ok else None

        st = eventually(back, 120, interval=0.5, what=lambda: "".join(logs("px", "decode-0"))[-3000:])
        d = next(p for p in st.processes if p.id == "decode-0")
        assert d.restarts == 1 and d.peer is not None, d
        assert d.peer["state"] == "done" and d.peer["seed"] == "prefill-0", d.peer
        code, out = post(d.url + "/weights_checker", {"action": "checksum"}, headers=engine_auth("px"))
        assert code == 200 and out["checksums"] == weights_checksum(TinyLM(replace(PRESETS["tiny"], seed=41)))
        code, out = post(state.router_url + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4}})
        assert code == 200 and out["meta_info"]["weight_version"] == "netns-41", out
    finally:
        down("px")
