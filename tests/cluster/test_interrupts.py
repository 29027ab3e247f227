"""Ctrl-C at every phase of the day-2 commands on a local sim cluster, then what a user does next:
`pdctl status` (it must tell the truth), the same command again (it finishes or undoes), and
`pdctl down` (nothing left). The phases are the commands' own progress lines; SIGINT goes to the
command when its line appears (day 2 under fire: an interrupted command strands nothing)."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from pdctl.sim.model import resolve_model, save_checkpoint
from tests.cluster.local_cluster import interrupted, pdctl_status, settle
from tests.helpers import control_auth, eventually, free_port_base, get, local_topology, pdctl, post, run_processes

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[dict, str, str]]:
    tmp = tmp_path_factory.mktemp("interrupts")
    topo = local_topology(
        tmp,
        "intr",
        free_port_base(),
        nodes=[{"name": "me", "host": "127.0.0.1", "gpus": 4, "workdir": str(tmp / "runs")}],
        # paced (5 ms a step): the long request of the load test outlasts its Ctrl-C on a loaded machine;
        # a load from disk takes 1.5 s, as a GPU engine's takes seconds: a Ctrl-C lands inside it
        prefill={"args": {"sim-disk-load-ms": 1500}},
        decode={"replicas": 2, "args": {"sim-decode-ms-per-step": 5, "sim-disk-load-ms": 1500}},
        router={"policy": "round_robin", "admission": {"worker_wait_secs": 30}},
    )
    env = {**os.environ, "PDCTL_HOME": str(tmp / "home")}
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    try:
        yield env, "intr", topo
    finally:
        state = json.loads((tmp / "home" / "intr" / "state.json").read_text())
        down = pdctl("down", "intr", env=env)
        assert down.returncode == 0, down.stderr
        assert run_processes(state["run_id"]) == [], "down left processes of the cluster running"


@pytest.mark.parametrize(
    "phase, sig",
    [
        ("out of rotation", signal.SIGINT),
        ("stopping", signal.SIGTERM),
        ("starting", signal.SIGHUP),
        ("starting", signal.SIGINT),
        ("started pid", signal.SIGTERM),
    ],
    ids=["draining-SIGINT", "stopping-SIGTERM", "starting-SIGHUP", "starting-SIGINT", "started-SIGTERM"],
)
def test_a_restart_interrupted_at_every_phase_leaves_no_process_the_state_does_not_know(cluster, phase, sig) -> None:
    """Ctrl-C, kill or a closed terminal at each phase of a restart: the spawn and its record
    whole, then the step's undo or its record for the next command; `status` tells the truth and
    the same command finishes. Before, SIGTERM and SIGHUP killed the command on the spot: a stray
    engine the state did not know answered the health URL, the recorded supervisor crash-looped
    on 'address already in use' and only down removed it. (Each phase once, the three signals
    spread over them: the three reach one handler, which test_the_three_stop_signals_reach_one_
    handler checks; every phase x signal pair cost 10 cluster restarts, 560 s of the suite.)"""
    env, name, _ = cluster
    code, out = interrupted("restart", name, "decode-0", at=phase, env=env, sig=sig)
    assert code == 130 and "Traceback" not in out, out
    _, st = pdctl_status(env)
    assert _strays(env, name, st) == [], "processes of the cluster the state does not know"
    code, st = settle(env, name)
    if code != 0:  # what it left is named, with what to do
        assert st["step"] and "decode-0" in st["step"] and "again" in st["step"], st
    again = pdctl("restart", name, "decode-0", env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    code, st = settle(env, name)
    assert code == 0 and st["step"] is None and _strays(env, name, st) == [], st


def test_the_three_stop_signals_reach_one_handler() -> None:
    """What lets the cluster tests above and below spread the signals over the phases: a command
    takes SIGTERM and SIGHUP as it takes Ctrl-C, and a deferred block holds back all three."""
    from pdctl.cluster.journal import interrupts_deferred
    from pdctl.signals import INTERRUPTS, interrupt_on_every_stop_signal

    saved = {sig: signal.getsignal(sig) for sig in INTERRUPTS}
    try:
        interrupt_on_every_stop_signal()
        assert {signal.getsignal(sig) for sig in INTERRUPTS} == {signal.default_int_handler}
        with interrupts_deferred():
            held = {signal.getsignal(sig) for sig in INTERRUPTS}
            assert len(held) == 1 and signal.default_int_handler not in held
        assert {signal.getsignal(sig) for sig in INTERRUPTS} == {signal.default_int_handler}
        for sig in INTERRUPTS:  # each, raised inside a deferred block, arrives once it is done
            reached = []
            with pytest.raises(KeyboardInterrupt), interrupts_deferred():
                signal.raise_signal(sig)
                reached.append(sig)
            assert reached == [sig]
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_signal_the_command_was_started_with_ignored_stays_ignored() -> None:
    """`nohup pdctl planner ...` ignores SIGHUP and a shell's `cmd &` without job control ignores
    SIGINT: pdctl takes over neither (a closed terminal would stop a nohup'ed planner; a benchmark's
    SIGINT to a planner it started in the background was never seen), in a deferred block neither;
    SIGTERM still stops it."""
    from pdctl.cluster.journal import interrupts_deferred
    from pdctl.signals import INTERRUPTS, interrupt_on_every_stop_signal

    saved = {sig: signal.getsignal(sig) for sig in INTERRUPTS}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        interrupt_on_every_stop_signal()
        assert signal.getsignal(signal.SIGHUP) is signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler
        with interrupts_deferred():
            signal.raise_signal(signal.SIGHUP)
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        with pytest.raises(KeyboardInterrupt), interrupts_deferred():
            signal.raise_signal(signal.SIGTERM)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


class _StreamInUse(io.StringIO):
    """sys.stderr as a signal finds it while the command writes a progress line: any write from
    the handler is a reentrant one (what the real stream raised: "reentrant call inside
    <_io.BufferedWriter name='<stderr>'>")."""

    def write(self, text: str) -> int:
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")


def test_a_held_back_signal_writes_nothing_through_pythons_streams(monkeypatch, capfd) -> None:
    """The handler that holds a signal back says so with one raw write to fd 2: it touches neither
    sys.stderr nor logging, which the signal may have interrupted mid-write (two full-suite
    failures of the Ctrl-C tests above were "internal error: RuntimeError: reentrant call", from a
    handler that logged)."""
    from pdctl.cluster.journal import HELD_BACK, interrupts_deferred

    records: list[logging.LogRecord] = []
    catch = logging.Handler()
    catch.emit = records.append  # type: ignore[method-assign]
    logging.getLogger().addHandler(catch)
    monkeypatch.setattr(sys, "stderr", _StreamInUse())
    saved = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with pytest.raises(KeyboardInterrupt), interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # (said once)
    finally:
        signal.signal(signal.SIGINT, saved)
        logging.getLogger().removeHandler(catch)
    assert records == [] and capfd.readouterr().err == HELD_BACK.decode()


def _strays(env: dict, name: str, st: dict) -> list[str]:
    """Engine processes of the cluster's run (its run id in their environment) that no recorded
    process is, nor a recorded process's child (a supervisor's engine, an engine's TP helper)."""
    run_id = json.loads((Path(env["PDCTL_HOME"]) / name / "state.json").read_text())["run_id"]
    known = {p["pid"] for p in st["processes"]} | {p.get("supervisor_pid") for p in st["processes"]}
    strays = []
    for pid in run_processes(run_id):
        try:
            proc = psutil.Process(pid)
            lineage = {proc.pid, *(a.pid for a in proc.parents())}
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "pdctl.sim" in cmd and not lineage & known:
            strays.append(f"{pid}: {cmd}")
    return strays


@pytest.mark.parametrize(
    "phase, sig",
    [
        ("decode-2: starting", signal.SIGHUP),
        ("decode-2: started pid", signal.SIGINT),
    ],
    ids=["starting-SIGHUP", "started-SIGINT"],
)
def test_ctrl_c_during_an_apply_that_adds_an_engine(cluster, tmp_path, phase, sig) -> None:
    """Each phase of an added engine's start once, with a different signal (they reach one
    handler: test_the_three_stop_signals_reach_one_handler)."""
    env, name, topo = cluster
    body = yaml.safe_load(Path(topo).read_text())
    body["decode"] = {**body["decode"], "replicas": 3}  # (its args kept: decode-0 and -1 are not replaced)
    bigger = tmp_path / "bigger.yaml"
    bigger.write_text(yaml.safe_dump(body))
    code, out = interrupted("apply", str(bigger), at=phase, env=env, sig=sig)
    assert code == 130 and "Traceback" not in out, out
    # The engine that did not join is stopped and unregistered: the cluster is as it was.
    code, st = settle(env, name)
    assert (
        code == 0 and st["step"] is None and {e["id"] for e in st["engines"]} == {"prefill-0", "decode-0", "decode-1"}
    )
    again = pdctl("apply", str(bigger), env=env, timeout=300)
    assert again.returncode == 0, again.stderr + again.stdout
    code, st = settle(env, name)
    assert code == 0 and "decode-2" in {e["id"] for e in st["engines"]}, st
    back = pdctl("apply", topo, env=env, timeout=300)  # and back to two decodes
    assert back.returncode == 0, back.stderr + back.stdout
    assert settle(env, name)[0] == 0


def test_an_apply_from_pd_to_regular_is_refused_before_anything_starts(cluster, tmp_path) -> None:
    env, name, topo = cluster
    body = yaml.safe_load(Path(topo).read_text())
    body.pop("prefill")
    body.pop("decode")
    body["regular"] = {"replicas": 1}
    regular = tmp_path / "regular.yaml"
    regular.write_text(yaml.safe_dump(body))
    out = pdctl("apply", str(regular), env=env)
    assert out.returncode == 1 and "router mode: 'pd' -> 'regular'" in out.stderr + out.stdout, out.stderr
    assert settle(env, name)[0] == 0


def test_ctrl_c_on_a_weights_load_while_it_holds_the_fleet(cluster, tmp_path) -> None:
    """A long request in flight: the load's hold drains for it; Ctrl-C then lets requests in at
    once, leaves every engine in rotation (no weights moved), and the next load succeeds."""
    env, name, _ = cluster
    save_checkpoint(resolve_model("sim://tiny?seed=5", "auto", None), tmp_path / "ckpt")
    code, st = pdctl_status(env)
    router = next(p for p in st["processes"] if p["role"] == "router")["url"]
    # 2,000 steps of 5 ms (near the tiny model's 2,048 positions): it outlasts the Ctrl-C and the request after it
    long = {"text": "a long one", "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}
    answers: list = []
    client = threading.Thread(target=lambda: answers.append(post(router + "/generate", long, timeout=300)))
    client.start()
    eventually(
        lambda: any(
            w["load"] for w in get(router + "/workers", headers=control_auth(name, env["PDCTL_HOME"]))[1]["workers"]
        ),
        60,
        what="the long request on an engine",
    )
    code, out = interrupted("weights", "load", str(tmp_path / "ckpt"), name, at="draining the requests", env=env)
    assert code == 130 and "Traceback" not in out, out
    status_code, answer = post(router + "/generate", {"text": "right away", "sampling_params": {"max_new_tokens": 4}})
    assert status_code == 200, answer
    # (answered while the request the load drained for still runs: the router did not hold it behind the drain)
    assert client.is_alive() and not answers, "the router held requests after the load went away"
    client.join()
    assert answers[0][0] == 200
    weights = json.loads(pdctl("weights", "status", name, "--json", env=env).stdout)
    assert not any(e["out_of_rotation"] for e in weights["engines"]), weights
    ok = pdctl("weights", "load", str(tmp_path / "ckpt"), name, env=env)
    assert ok.returncode == 0, ok.stderr
    assert settle(env, name)[0] == 0


def test_ctrl_c_once_a_load_moves_weights_leaves_the_fleet_on_the_new_version(cluster, tmp_path) -> None:
    """Ctrl-C on the line "loading CKPT on N engine(s)" (the router has paused the engines and the
    load is under way): the router finishes the load on its own; every engine serves the new
    version at once and none leaves rotation (every engine left rotation for good before: 612 of
    648 requests got 503 until another load). Clients keep sending throughout and none fails."""
    env, name, _ = cluster
    save_checkpoint(resolve_model("sim://tiny?seed=6", "auto", None), tmp_path / "ckpt6")
    _, st = pdctl_status(env)
    router = next(p for p in st["processes"] if p["role"] == "router")["url"]
    stop = threading.Event()
    answers: list = []

    def client() -> None:
        while not stop.is_set():
            try:
                answers.append(post(router + "/generate", {"text": "go on", "sampling_params": {"max_new_tokens": 8}}))
            except OSError as exc:
                answers.append((0, str(exc)))

    clients = [threading.Thread(target=client) for _ in range(2)]
    for c in clients:
        c.start()
    try:
        code, out = interrupted(
            "weights", "load", str(tmp_path / "ckpt6"), name, "--version", "v6", at="loading ", env=env
        )
        assert code == 130 and "Traceback" not in out and "finishes it on its own" in out, out

        def on_v6() -> bool:
            workers = get(router + "/workers", headers=control_auth(name, env["PDCTL_HOME"]))[1]["workers"]
            return all(w["weight_version"] == "v6" and not w["quarantined"] and w["is_healthy"] for w in workers)

        eventually(on_v6, 60, interval=0.2, what="every engine in rotation on v6")
        done = len(answers)
        eventually(lambda: len(answers) >= done + 4, 60, what="answers after the interrupted load")
    finally:
        stop.set()
        for c in clients:
            c.join()
    assert [a for a in answers if a[0] != 200] == []
    assert settle(env, name)[0] == 0


def test_a_load_while_the_only_prefill_restarts_fails_no_request(cluster, tmp_path) -> None:
    """Found by a probe: a `weights load` while the only prefill restarted (kill -9, its supervisor
    bringing it back) went on without it, exited 0, and the router kept it out for good (a
    "missed weight push"), every request a 503. Now the load says which engine it missed (exit 1),
    the router loads the checkpoint into it once it answers, and requests wait for it meanwhile."""
    env, name, _ = cluster
    save_checkpoint(resolve_model("sim://tiny?seed=9", "auto", None), tmp_path / "ckpt9")
    _, st = pdctl_status(env)
    router = next(p for p in st["processes"] if p["role"] == "router")["url"]
    prefill = next(p for p in st["processes"] if p["id"] == "prefill-0")
    stop = threading.Event()
    answers: list = []

    def client() -> None:
        while not stop.is_set():
            try:
                answers.append(
                    post(
                        router + "/generate", {"text": "load me", "sampling_params": {"max_new_tokens": 8}}, timeout=120
                    )
                )
            except OSError as exc:
                answers.append((0, str(exc)))

    clients = [threading.Thread(target=client) for _ in range(2)]
    for c in clients:
        c.start()
    try:
        os.kill(prefill["pid"], signal.SIGKILL)
        load = pdctl("weights", "load", str(tmp_path / "ckpt9"), name, "--version", "v9", env=env)
        assert load.returncode in (0, 1), load.stderr
        if load.returncode == 1:  # it missed the prefill: it says so, and who finishes the job
            assert "prefill-0" in load.stderr and "once they answer again" in load.stderr, load.stderr

        def workers() -> list[dict]:
            return get(router + "/workers", headers=control_auth(name, env["PDCTL_HOME"]))[1]["workers"]

        eventually(  # the router loads the checkpoint into the prefill once it is back
            lambda: all(w["weight_version"] == "v9" and not w["quarantined"] and w["is_healthy"] for w in workers()),
            120,
            interval=0.2,
            what=lambda: f"every engine in rotation on v9: {workers()}",
        )
        done = len(answers)
        # served on the new version after it
        eventually(lambda: len(answers) >= done + 4, 60, what="four answers after the load")
    finally:
        stop.set()
        for c in clients:
            c.join()
    failed = [a for a in answers if a[0] != 200]
    assert not failed, failed[:3]
    assert answers[-1][1]["meta_info"]["weight_version"] == "v9"
    assert settle(env, name)[0] == 0


def test_restart_of_an_engine_only_an_update_can_bring_back_says_so_at_once(cluster) -> None:
    """An engine out of rotation for a failed weight update (nothing under way brings it back: no
    peer transfer, no load): restart used to wait its whole 900 s for it in silence. It says at
    once that the engine is up and what brings it back."""
    env, name, _ = cluster
    _, st = pdctl_status(env)
    router = next(p for p in st["processes"] if p["role"] == "router")["url"]
    decode = next(p for p in st["processes"] if p["id"] == "decode-1")["url"]
    auth = control_auth(name, env["PDCTL_HOME"])
    assert (
        post(router + "/pdctl/hold", {"txn": "t-failed", "engines": [decode], "lease_secs": 60}, headers=auth)[0] == 200
    )
    release = {"txn": "t-failed", "failed": {decode: "weight push t-failed failed: a test"}}
    assert post(router + "/pdctl/release", release, headers=auth)[0] == 200
    out = pdctl("restart", name, "decode-1", env=env, timeout=300)  # (it waited out 900 s before)
    assert out.returncode == 1 and "is up but stays out of rotation" in out.stderr, out.stderr
    assert "Only a weight update" in out.stderr
    assert post(router + "/pdctl/hold", {"txn": "t-ok", "engines": [decode], "lease_secs": 60}, headers=auth)[0] == 200
    assert post(router + "/pdctl/release", {"txn": "t-ok", "complete": [decode]}, headers=auth)[0] == 200
    assert settle(env, name)[0] == 0
