"""Weights from a peer, driven as a user would on localhost sim engines under their supervisors and
the real router: a trainer pushes version B and exits; then, under a closed loop of clients and with
no push and no pdctl command, a decode killed with kill -9 comes back holding B (taken from a peer
over SGLang's engine-to-engine transfer through the seed relays), and `pdctl apply` adds a decode
that enters at B the same way. Without a peer of the same TP layout the old rule holds."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import replace

import pytest
import torch.distributed

from pdctl.node.peer_weights import (
    ARM_ROUTE,
    DISARM_ROUTE,
    INIT_ROUTE,
    SEND_ROUTE,
    WAIT_ROUTE,
    PeerPlan,
    PeerSource,
    SeedRelay,
    SeedSide,
)
from pdctl.sim import weights_checksum
from pdctl.sim.model import PRESETS, TinyLM
from tests.cluster.local_cluster import (
    PACED,
    Clients,
    router_url,
    router_workers,
    status_by_process,
    wait_back,
    wait_in_rotation,
)
from tests.helpers import engine_auth, eventually, free_port, free_port_base, get, local_topology, pdctl, post, sims

PUSH_B = (
    "from dataclasses import replace\n"
    "from pdctl.sim.model import PRESETS, TinyLM\n"
    "from pdctl.weights import WeightSync\n"
    "model = TinyLM(replace(PRESETS['tiny'], seed=41))\n"
    "with WeightSync.from_env(verify='full') as sync:\n"
    "    report = sync.push(list(model.named_parameters()), version='B')\n"
    "print('PUSHED', report.engines, flush=True)\n"
)
EXPECTED = weights_checksum(TinyLM(replace(PRESETS["tiny"], seed=41)))


def _topology(tmp_path, name: str, base: int, decodes: int, **decode) -> str:
    node = {"name": "me", "host": "127.0.0.1", "gpus": 6, "workdir": str(tmp_path / "runs")}
    return local_topology(
        tmp_path,
        name,
        base,
        nodes=[node],
        prefill={"replicas": 1},
        decode={"replicas": decodes, "args": PACED, **decode},
        trainer={"command": ["python", "-c", PUSH_B], "nproc_per_node": 1, "nodes": ["me"]},
        weights={"backend": "gloo", "bucket_mb": 1},
    )


def _checksums(url: str, name: str, env: dict) -> dict:
    headers = engine_auth(name, env["PDCTL_HOME"])
    code, out = post(url + "/weights_checker", {"action": "checksum"}, headers=headers, timeout=30)
    assert code == 200, out
    return out["checksums"]


def _story(tmp_path, name: str, proc: str) -> dict:
    return json.loads((tmp_path / "runs" / name / "logs" / f"{proc}.log.exit").read_text())


def _pushed(env: dict, name: str) -> None:
    def exited() -> dict | None:
        trainer = next(p for p in status_by_process(env).values() if p.get("role") == "trainer")
        return trainer if trainer.get("exit_code") is not None else None

    trainer = eventually(exited, 120, interval=0.3, what="the trainer's push and exit")
    assert trainer["exit_code"] == 0, pdctl("logs", name, "trainer", env=env).stdout[-2000:]


KEY = "ab" * 16


def _relay_call(relay: SeedRelay, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return post(relay.me.relay_url + path, body, headers=headers, timeout=30)


def _started_relay(seed_url: str) -> SeedRelay:
    """A seed relay, serving, in front of the engine at ``seed_url`` (one TP rank); stop it after."""
    relay = SeedRelay(SeedSide("seed", seed_url, "127.0.0.1", free_port(), (free_port(),)), KEY)
    relay.start()
    return relay


def _triggers(seed: SeedSide) -> tuple[dict, dict]:
    """SGLang's receiver's init and send bodies for ``seed`` (its pair group send_weights_x)."""
    ports = ",".join(str(p) for p in seed.ports)
    init = {"master_address": seed.host, "ports": ports, "group_rank": 0, "world_size": 2,
            "group_name": "send_weights_x", "backend": "nccl"}  # fmt: skip
    return init, {"master_address": seed.host, "ports": ports, "group_name": "send_weights_x"}


def test_a_seed_relay_passes_on_only_an_armed_transfer_on_its_own_ports(tmp_path, capfd) -> None:
    """The relay is open to the receiver's unauthenticated triggers: without an arm (which needs
    the engine key), or with a body that does not fit the seed (ports, pair group), nothing
    reaches the engine, and a port count that would end an SGLang seed never does."""
    with sims(tmp_path, ("--api-key", KEY)) as (seed,):
        relay = _started_relay(seed.url)
        me = relay.me
        try:
            init, send = _triggers(me)
            assert _relay_call(relay, ARM_ROUTE, {"receiver": "r"}, key=None)[0] == 401
            assert _relay_call(relay, ARM_ROUTE, {"receiver": "r"}, key="wrong" * 8)[0] == 401
            code, out = _relay_call(relay, INIT_ROUTE, init, key=None)
            assert code == 403 and "no transfer is armed" in out["message"]
            assert _relay_call(relay, ARM_ROUTE, {"receiver": "r"})[0] == 200
            assert _relay_call(relay, ARM_ROUTE, {"receiver": "other"})[0] == 409  # one transfer at a time
            for bad in ({"ports": f"{me.ports[0]},1"}, {"master_address": "10.9.9.9"}, {"world_size": 3},
                        {"group_name": ""}, {"group_name": "mine"}, {"backend": "gloo"}):  # fmt: skip
                code, out = _relay_call(relay, INIT_ROUTE, {**init, **bad}, key=None)
                assert code == 403, (bad, out)
            code, out = _relay_call(relay, SEND_ROUTE, send, key=None)
            assert code == 403 and "one send per transfer, of the group its init made" in out["message"]
            # A refused send ends the armed transfer (its receiver loads from disk): the seed is free.
            code, out = _relay_call(relay, WAIT_ROUTE, {"receiver": "r", "timeout_secs": 0})
            assert out["done"] and not out["success"] and "send refused" in out["message"], out
            assert _relay_call(relay, DISARM_ROUTE, {"receiver": "r"})[0] == 200
            assert _relay_call(relay, ARM_ROUTE, {"receiver": "other"})[0] == 200
            # Garbage and clients that go away: answers or a closed connection, no traceback.
            import socket

            for raw in (
                b"POST /pdctl/seed/arm HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                b"POST /pdctl/seed/arm HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n",
                b"POST /x HTTP/1.1\r\nContent-Length: nine\r\n\r\n",
                b"\x00\xff garbage\r\n\r\n",
            ):
                with socket.create_connection(("127.0.0.1", me.relay_port), timeout=10) as conn:
                    conn.sendall(raw)  # and hang up without reading the answer
            assert _relay_call(relay, ARM_ROUTE, {"receiver": "r"}, key=None)[0] == 401  # it still answers
            assert "Traceback" not in capfd.readouterr().err
            assert seed.proc.poll() is None  # nothing reached the engine that would have ended it
            assert get(seed.url + "/health")[0] == 200
        finally:
            relay.stop()


def test_an_arm_whose_receiver_stops_asking_lapses_and_frees_the_seed(tmp_path, monkeypatch) -> None:
    """A receiver's supervisor that dies (a Ctrl-C'd apply stopped it, a kill -9) must not keep
    the seed reserved: its arm lapses once it stops asking for the outcome; one that asks keeps it."""
    import pdctl.node.peer_weights as peer_weights

    monkeypatch.setattr(peer_weights, "ARM_IDLE_SECS", 1.0)
    relay = SeedRelay(SeedSide("seed", f"http://127.0.0.1:{free_port()}", "127.0.0.1", free_port(), (1,)), KEY)
    relay.start()
    try:
        assert _relay_call(relay, ARM_ROUTE, {"receiver": "alive"})[0] == 200
        for _ in range(3):  # asking keeps the arm past its idle time
            code, out = _relay_call(relay, WAIT_ROUTE, {"receiver": "alive", "timeout_secs": 0.5})
            assert code == 200 and out == {"done": False}, out
        assert _relay_call(relay, ARM_ROUTE, {"receiver": "other"})[0] == 409
        eventually(lambda: _relay_call(relay, ARM_ROUTE, {"receiver": "other"})[0] == 200, 30, what="the arm lapsing")
        code, out = _relay_call(relay, WAIT_ROUTE, {"receiver": "alive", "timeout_secs": 0})
        assert out["done"] and not out["success"] and "lapsed" in out["message"], out
    finally:
        relay.stop()


class _HeldSeed:
    """A seed engine's two routes on a real HTTP server: the init's answer is held until
    ``release`` is set (a seed still in its rendezvous), each call recorded."""

    def __init__(self) -> None:
        import http.server

        self.got_init, self.release, self.got_send = threading.Event(), threading.Event(), threading.Event()
        held = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == INIT_ROUTE:
                    held.got_init.set()
                    held.release.wait(120)
                else:
                    held.got_send.set()
                body = json.dumps({"success": True, "message": self.path}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_send_that_comes_before_its_inits_answer_goes_on_once_that_answer_comes(monkeypatch) -> None:
    """SGLang's receiver posts the send as soon as it joined the group, while the seed's answer to
    the init may still be on its way back through the relay: the send waits for that answer and
    then goes on. Found by CI: the init's answer did not wake the waiting send, which slept out
    the arm's idle time (30 s) and held a restarted engine out of rotation that long. With that
    time made an hour here, a lost wake-up would hang the send instead of passing."""
    import pdctl.node.peer_weights as peer_weights

    monkeypatch.setattr(peer_weights, "ARM_IDLE_SECS", 3600.0)
    engine = _HeldSeed()
    relay = _started_relay(engine.url)
    try:
        init, send = _triggers(relay.me)
        assert _relay_call(relay, ARM_ROUTE, {"receiver": "r"})[0] == 200
        answers: dict[str, tuple[int, dict]] = {}
        calls = [
            threading.Thread(target=lambda: answers.update(init=_relay_call(relay, INIT_ROUTE, init, key=None))),
            threading.Thread(target=lambda: answers.update(send=_relay_call(relay, SEND_ROUTE, send, key=None))),
        ]
        calls[0].start()
        assert engine.got_init.wait(60)
        calls[1].start()
        # the send is in the relay, waiting for the init's answer (the relay's one condition)
        eventually(lambda: len(relay._lock._waiters) == 1, 60, what="the send waiting in the relay")  # type: ignore[attr-defined]
        engine.release.set()
        assert engine.got_send.wait(60), "the send was not woken by the init's answer"
        for call in calls:
            call.join(60)
        assert answers["init"][0] == 200 and answers["send"][0] == 200, answers
        _, out = _relay_call(relay, WAIT_ROUTE, {"receiver": "r", "timeout_secs": 0})
        assert out["done"] and out["success"], out
    finally:
        engine.release.set()
        relay.stop()
        engine.server.shutdown()
        engine.server.server_close()


def test_a_seed_whose_receiver_left_between_init_and_send_seeds_no_more_until_its_engine_restarts(tmp_path) -> None:
    """SGLang's seed keeps the group an init made until a send uses it, and the group's port with
    it: a receiver that dies between the two (a kill, a Ctrl-C'd apply) leaves an engine whose
    every later init fails. Its relay then refuses arms and says why, so the next receiver starts
    from disk at once instead of starting for nothing, until the seed's engine restarts."""
    from pdctl.sglang.group import destroy_group, init_custom_process_group
    from pdctl.sim.remote_instance import SIM_BACKEND

    with sims(tmp_path, ("--api-key", KEY)) as (seed,):
        relay = _started_relay(seed.url)
        me = relay.me
        try:
            init, _ = _triggers(me)
            assert _relay_call(relay, ARM_ROUTE, {"receiver": "r"})[0] == 200
            joined: dict = {}

            def receiver_joins() -> None:  # this test is the receiver, as SGLang's joins the pair group
                group = init_custom_process_group(
                    backend=SIM_BACKEND, master_address="127.0.0.1", master_port=me.ports[0], world_size=2,
                    rank=1, group_name="send_weights_x", timeout_secs=120,
                )  # fmt: skip
                torch.distributed.barrier(group=group)
                joined["group"] = group

            receiving = threading.Thread(target=receiver_joins)
            receiving.start()
            code, out = _relay_call(relay, INIT_ROUTE, init, key=None)
            receiving.join(120)
            assert code == 200 and out["success"], out
            destroy_group(joined["group"])  # and the receiver goes away before its send
            assert _relay_call(relay, DISARM_ROUTE, {"receiver": "r"})[0] == 200
            code, out = _relay_call(relay, ARM_ROUTE, {"receiver": "next"})
            assert code == 409 and "never used" in out["error"] and "restarts" in out["error"], out
            # a receiver's supervisor then starts from disk and its story says why
            auth = {"Authorization": f"Bearer {KEY}"}
            assert post(seed.url + "/update_weight_version", {"new_version": "B"}, headers=auth)[0] == 200
            receiver = SeedSide("next", f"http://127.0.0.1:{free_port()}", "127.0.0.1", free_port(), (free_port(),))
            got = PeerSource(PeerPlan(receiver, (me,)), KEY).arm()
            armed, detail = got.armed, got.detail
            assert armed is None and "seed: cannot seed" in detail and "never used" in detail, detail
            # why: the engine's next init fails at once (the left group holds its port)
            code, out = post(seed.url + INIT_ROUTE, init, headers=auth, timeout=120)
            assert not out["success"] and "Failed to init group" in out["message"], (code, out)
            assert seed.proc.poll() is None and get(seed.url + "/health")[0] == 200  # it serves on
            relay.engine_started()  # its supervisor started a new engine process
            assert _relay_call(relay, ARM_ROUTE, {"receiver": "next"})[0] == 200
        finally:
            relay.stop()


def test_a_failed_transfer_ends_the_receiver_which_then_loads_from_disk_and_says_why(tmp_path) -> None:
    """A seed whose relay cannot reach its engine (gone): the receiver's supervisor learns that the
    transfer failed, ends the engine waiting for weights, and starts it from disk; the story says
    so, and the engine holds its boot version (the router keeps it out until the next push)."""
    with sims(tmp_path, ("--api-key", KEY, "--weight-version", "B")) as (peer,):
        dead = f"http://127.0.0.1:{free_port()}"
        relay = _started_relay(dead)
        port = free_port()
        me = SeedSide("me", f"http://127.0.0.1:{port}", "127.0.0.1", free_port(), (free_port(),))
        plan = PeerPlan(me, (replace(relay.me, url=peer.url),))  # versions from the live peer, relay to nothing
        (tmp_path / "plan.json").write_text(json.dumps(plan.to_dict()))
        story = tmp_path / "me.exit"
        cmd = [sys.executable, "-m", "pdctl.node.supervise", str(story), "--restart", "on-failure",
               "--peers", str(tmp_path / "plan.json"), "--",
               sys.executable, "-m", "pdctl.sim", "--model-path", "sim://tiny", "--host", "127.0.0.1",
               "--port", str(port), "--api-key", KEY]  # fmt: skip
        log = (tmp_path / "me.log").open("w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:

            def from_disk() -> dict | None:
                s = json.loads(story.read_text()) if story.exists() else {}
                return s if s.get("restarts") == 1 and (s.get("peer") or {}).get("state") == "none" else None

            s = eventually(from_disk, 120, what=lambda: (tmp_path / "me.log").read_text()[-2000:])
            assert "loads from disk: the last start from a peer failed" in s["peer"]["detail"]
            assert "weights from seed failed" in (s["last_exit"].get("why") or ""), s
            info = eventually(lambda: get(me.url + "/model_info", headers={"Authorization": f"Bearer {KEY}"})[1],
                              60, ignore=(OSError,), what="the receiver on its own weights")  # fmt: skip
            assert info["weight_version"] == "default"
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
            relay.stop()


def test_a_receiver_stopped_while_it_waits_for_its_weights_frees_its_seed_at_once(tmp_path) -> None:
    """`down`, or a Ctrl-C'd `apply` that stops the engine it added, SIGTERMs a supervisor whose
    engine waits for its weights: the supervisor disarms its seed as it stops, so the seed can
    serve another receiver at once rather than after its arm's idle time (30 s)."""
    with sims(tmp_path, ("--api-key", KEY, "--weight-version", "B")) as (peer,):
        relay = _started_relay(peer.url)
        me = SeedSide("me", f"http://127.0.0.1:{free_port()}", "127.0.0.1", free_port(), (free_port(),))
        (tmp_path / "plan.json").write_text(json.dumps(PeerPlan(me, (relay.me,)).to_dict()))
        story = tmp_path / "me.exit"
        # an engine that waits for weights that never come (it sends no trigger): the arm stays
        waits = "import time\nwhile True: time.sleep(3600)"
        cmd = [sys.executable, "-m", "pdctl.node.supervise", str(story), "--restart", "on-failure",
               "--peers", str(tmp_path / "plan.json"), "--", sys.executable, "-c", waits, "--api-key", KEY]  # fmt: skip
        proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, start_new_session=True)
        try:

            def receiving() -> bool:
                s = json.loads(story.read_text()) if story.exists() else {}
                return s.get("pid") is not None and (s.get("peer") or {}).get("state") == "receiving"

            eventually(receiving, 60, what="the engine waiting for its weights from the seed")
            assert _relay_call(relay, ARM_ROUTE, {"receiver": "other"})[0] == 409  # armed for "me"
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
            assert _relay_call(relay, ARM_ROUTE, {"receiver": "other"})[0] == 200
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            relay.stop()


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}


def test_a_killed_decode_and_an_added_one_take_the_pushed_version_from_a_peer(tmp_path, env) -> None:
    base = free_port_base()
    topo = _topology(tmp_path, "peer", base, decodes=2)
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    try:
        _pushed(env, "peer")
        status = status_by_process(env)
        router = router_url(env, "peer", status)
        urls = {i: status[i]["url"] for i in ("prefill-0", "decode-0", "decode-1")}
        for url in urls.values():
            wait_in_rotation(router, url, "B")
        with Clients(router) as clients:
            # 1. kill -9 of a decode: its supervisor starts it from a peer at B, with no push.
            old = status["decode-0"]
            os.kill(old["pid"], signal.SIGKILL)
            wait_back(env, "decode-0", old["pid"], 1)
            wait_in_rotation(router, urls["decode-0"], "B")
            story = _story(tmp_path, "peer", "decode-0")
            assert story["peer"]["state"] == "done", story
            assert story["peer"]["seed"] in ("prefill-0", "decode-1") and story["peer"]["version"] == "B"
            assert _checksums(urls["decode-0"], "peer", env) == EXPECTED

            # 2. `apply` adds a decode: it enters at B the same way.
            grown = _topology(tmp_path, "peer", base, decodes=3)
            applied = pdctl("apply", grown, env=env, timeout=600)
            assert applied.returncode == 0, applied.stderr
            grown_status = status_by_process(env)
            added = grown_status["decode-2"]
            wait_in_rotation(router, added["url"], "B")
            assert _story(tmp_path, "peer", "decode-2")["peer"]["state"] == "done"
            assert _checksums(added["url"], "peer", env) == EXPECTED

            # 3. `pdctl restart` of an engine: its new process takes B from a peer too, and the roll
            #    goes on (it stopped before, for an engine that had to wait for a push).
            before = grown_status["decode-1"]
            restarted = pdctl("restart", "peer", "decode-1", env=env, timeout=600)
            assert restarted.returncode == 0, restarted.stderr
            assert status_by_process(env)["decode-1"]["pid"] != before["pid"]
            assert _story(tmp_path, "peer", "decode-1")["peer"]["state"] == "done"
            assert _checksums(urls["decode-1"], "peer", env) == EXPECTED

            # 4. two decodes killed at once, the trainer long gone: both take B from a peer (one
            #    found its seed busy with the other, loaded from disk and waited for a push that
            #    never came: now it asks again once a seed is free).
            now = status_by_process(env)
            first, second = now["decode-0"], now["decode-2"]
            os.kill(first["pid"], signal.SIGKILL)
            os.kill(second["pid"], signal.SIGKILL)
            wait_back(env, "decode-0", first["pid"], 2)
            wait_back(env, "decode-2", second["pid"], 1)
            for proc, url in (("decode-0", urls["decode-0"]), ("decode-2", added["url"])):
                wait_in_rotation(router, url, "B")
                assert _story(tmp_path, "peer", proc)["peer"]["state"] == "done", _story(tmp_path, "peer", proc)
                assert _checksums(url, "peer", env) == EXPECTED
            eventually(clients.answered_lately, 60, what="answers after the apply")
        assert not clients.failed(), clients.failed()[:3]
        versions = {a[2] for a in clients.answers}
        assert versions == {"B"}, versions  # no answer from an engine's initial weights
        workers = router_workers(router)
        assert all(w["weight_version"] == "B" and not w["quarantined"] for w in workers.values()), workers
        assert pdctl("status", "peer", env=env).returncode == 0
    finally:
        pdctl("down", "peer", env=env)


def test_without_a_peer_of_its_tp_layout_a_killed_decode_waits_for_the_next_push_and_status_says_why(
    tmp_path, env
) -> None:
    topo = _topology(tmp_path, "lone", free_port_base(), decodes=1, tp=2)
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    try:
        _pushed(env, "lone")
        status = status_by_process(env)
        router = router_url(env, "lone", status)
        url = status["decode-0"]["url"]
        wait_in_rotation(router, url, "B")
        old = status["decode-0"]
        os.kill(old["pid"], signal.SIGKILL)
        wait_back(env, "decode-0", old["pid"], 1)

        def kept_out() -> dict | None:
            w = router_workers(router).get(url)
            return w if w and w["is_healthy"] and w["quarantined"] else None

        worker = eventually(kept_out, 120, interval=0.2, ignore=(OSError,), what="the decode back and kept out")
        assert "until the next weight push reaches it" in worker["quarantined"], worker
        story = _story(tmp_path, "lone", "decode-0")
        assert story["peer"]["state"] == "none" and "no peer of this TP layout" in story["peer"]["detail"], story
        st = pdctl("status", "lone", env=env)
        assert st.returncode == 1, st.stdout
        assert "weights from a peer: none: no peer of this TP layout" in " ".join(st.stdout.split()), st.stdout
    finally:
        pdctl("down", "lone", env=env)


def test_no_engine_seeds_while_a_fleet_update_moves_its_weights_or_after_one_left_them_half_done(tmp_path) -> None:
    """A fleet transaction labels every engine pdctl:updating:<txn> before the first weight moves
    and pdctl:partial:<txn> when it failed half way (pdctl.router.transaction): a restarting engine
    takes neither as a seed (it came back from a peer holding 8 new and 9 old tensors, labelled with
    the old version), and takes the seed once a whole update labels it."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with sims(tmp_path, ("--api-key", KEY)) as (seed,):
        relay = _started_relay(seed.url)
        try:
            receiver = SeedSide("r", f"http://127.0.0.1:{free_port()}", "127.0.0.1", free_port(), (free_port(),))
            source = PeerSource(PeerPlan(receiver, (relay.me,)), KEY)
            for label in ("pdctl:updating:framework-1", "pdctl:partial:framework-1"):
                assert post(seed.url + "/update_weight_version", {"new_version": label}, headers=auth)[0] == 200
                got = source.arm()
                armed, detail = got.armed, got.detail
                assert armed is None and "no peer of this TP layout holds weights past" in detail, (label, detail)
            assert post(seed.url + "/update_weight_version", {"new_version": "fw-2"}, headers=auth)[0] == 200
            got = source.arm()
            armed, detail = got.armed, got.detail
            assert armed is not None and armed.version == "fw-2", detail
            source.disarm(armed)
        finally:
            relay.stop()


def test_a_seed_that_dies_before_its_checksum_is_vouched_for_by_another_engine_at_its_version(tmp_path) -> None:
    """kill -9 of the seed while the receiver compares checksums (2 of 4 tries in a probe): the
    receiver compared with nothing, stayed at the receiving label and out of rotation for good,
    although another engine held the version. Now any engine of its layout at that version
    vouches; with none, it says so (its supervisor then starts it again, from a peer)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with sims(tmp_path, ("--api-key", KEY), ("--api-key", KEY, "--weight-version", "pdctl:receiving-from-peer")) as (
        peer,
        me,
    ):
        assert post(peer.url + "/update_weight_version", {"new_version": "B"}, headers=auth)[0] == 200
        dead = SeedSide("seed", f"http://127.0.0.1:{free_port()}", "127.0.0.1", free_port(), (free_port(),))
        other = SeedSide("peer", peer.url, "127.0.0.1", free_port(), (free_port(),))
        mine = SeedSide("me", me.url, "127.0.0.1", free_port(), (free_port(),))
        from pdctl.node.peer_weights import Armed

        alone = PeerSource(PeerPlan(mine, (dead,)), KEY)
        step = alone.verify_and_stamp(Armed(dead, "B"), lambda: True)
        ok, detail = step.ok, step.detail
        assert not ok and detail.startswith("could not compare checksums with any engine at 'B'"), detail
        source = PeerSource(PeerPlan(mine, (dead, other)), KEY)
        step = source.verify_and_stamp(Armed(dead, "B"), lambda: True)
        ok, detail = step.ok, step.detail
        assert ok and "checked against peer" in detail, detail
        assert get(me.url + "/model_info", headers=auth)[1]["weight_version"] == "B"


def test_two_engines_restarted_at_once_share_the_only_seed_one_after_the_other(tmp_path, caplog) -> None:
    """Two decodes killed at once: the second found the only seed busy, loaded from disk and
    waited for a push that never came (the trainer had exited). Now it asks again once the seed
    may be free, and arms it when the first transfer ends."""
    with sims(tmp_path, ("--api-key", KEY, "--weight-version", "B")) as (seed,):
        relay = _started_relay(seed.url)
        try:
            assert _relay_call(relay, ARM_ROUTE, {"receiver": "first"})[0] == 200  # the first restarted decode
            second = SeedSide("second", f"http://127.0.0.1:{free_port()}", "127.0.0.1", free_port(), (free_port(),))
            source = PeerSource(PeerPlan(second, (relay.me,)), KEY)
            got: dict = {}
            caplog.set_level(logging.INFO, logger="pdctl.node.peer_weights")
            asking = threading.Thread(target=lambda: got.update(armed=source.arm().armed))
            asking.start()
            # refused as busy, it asks again (it returned at once with no seed before, to load from disk)
            eventually(lambda: "asking again" in caplog.text, 30, what="the second receiver refused as busy")
            assert _relay_call(relay, DISARM_ROUTE, {"receiver": "first"})[0] == 200  # the first transfer ended
            asking.join(60)
            assert got["armed"] is not None and got["armed"].version == "B", got
            source.disarm(got["armed"])
        finally:
            relay.stop()


def test_the_seed_relay_binds_without_a_reverse_dns_lookup(monkeypatch) -> None:
    """http.server looks up the bound address's name (socket.getfqdn) as it binds: on a node whose
    resolver does not answer that took 12 s, and every engine's start waited for it (found by
    benchmarks/lifecycle_scale.py on network-namespace hosts). The relay binds without it."""
    import socket
    from http.server import BaseHTTPRequestHandler

    from pdctl.node.peer_weights import _QuietServer

    def no_dns(*_: object) -> str:
        raise AssertionError("a reverse DNS lookup while binding")

    monkeypatch.setattr(socket, "getfqdn", no_dns)
    server = _QuietServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    try:
        assert server.server_port == server.socket.getsockname()[1] and server.server_name == "127.0.0.1"
    finally:
        server.server_close()
