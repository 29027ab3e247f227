"""Failure rules of a push (pdctl.weights.sync docstring): an engine killed mid-push, a trainer
killed mid-push, and pushes while requests run through the router."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import replace

import pytest

from pdctl.sim import weights_checksum
from pdctl.sim.model import PRESETS, TinyLM
from pdctl.weights import WeightSync, WeightSyncError
from tests.helpers import SimProcess, eventually, free_port, get, post, sse
from tests.weights.conftest import targets

GREEDY = {"sampling_params": {"max_new_tokens": 16, "temperature": 0}}


def model(seed: int) -> TinyLM:
    return TinyLM(replace(PRESETS["tiny"], seed=seed))


def checksums(proc) -> dict:
    return post(proc.url + "/weights_checker", {"action": "checksum"})[1]["checksums"]


def workers(router) -> dict[str, dict]:
    return {w["url"]: w for w in get(router.url + "/workers")[1]["workers"]}


def running(proc) -> int:
    return sum(s.get("num_running_reqs", 0) for s in get(proc.url + "/server_info")[1]["internal_states"])


def test_engine_killed_mid_push(fleet, tmp_path):
    procs, router = fleet
    victim = procs[1]  # the tp-2 prefill: the fleet can still serve with the other prefill
    trainer = model(seed=21)
    params = list(trainer.named_parameters())
    killed = []

    def tensors():  # callable: the push can be redone on the survivors
        for i, pair in enumerate(params):
            if i == len(params) // 2 and not killed:
                os.killpg(victim.proc.pid, signal.SIGKILL)
                victim.proc.wait()
                killed.append(True)
            yield pair

    sync = WeightSync(
        targets(procs),
        master_address="127.0.0.1",
        master_port=free_port(),
        router_url=router.url,
        bucket_mb=0.01,
        timeout_secs=60,
    )
    try:
        sync.connect()
        started = time.monotonic()
        with pytest.raises(WeightSyncError) as err:
            sync.push(tensors, version="seed21")
        assert time.monotonic() - started < 30
        assert err.value.engine == "e1" and err.value.phase == "transfer"
        report = err.value.report
        assert report.retried and report.engines == ["e0", "e2"] and set(report.failed) == {"e1"}
        expected = weights_checksum(trainer)
        assert checksums(procs[0]) == expected and checksums(procs[2]) == expected
        state = workers(router)
        assert state[victim.url]["quarantined"] and not state[procs[0].url]["quarantined"]
        # The fleet serves on the engines holding the complete version.
        for _ in range(4):
            status, out = post(router.url + "/generate", {"text": "still up", **GREEDY})
            assert status == 200 and out["meta_info"]["weight_version"] == "seed21", out
        # Restart the engine (initial weights) on its flags, as a supervisor would: the same port and
        # bootstrap port (a new bootstrap port would leave the router pairing decodes with a dead
        # one: those requests are retried onto the other prefill, seconds late). A later push
        # rebuilds the group and takes it back.
        flags = list(victim.args)
        flags[flags.index("--disaggregation-bootstrap-port") + 1] = str(victim.bootstrap_port)
        restarted = SimProcess(tmp_path, *flags, port=victim.port, name="restarted").start()
        procs[1] = restarted
        report = sync.push(params, version="seed21-again")
        assert report.engines == ["e0", "e1", "e2"] and not report.failed
        assert checksums(restarted) == expected
        eventually(
            lambda: not workers(router)[victim.url]["quarantined"], 30, interval=0.2, what="the engine back in rotation"
        )
    finally:
        sync.close()


@pytest.mark.parametrize("refit", ["drain", "interrupt"])
def test_trainer_killed_mid_push(fleet, tmp_path, refit):
    """With ``interrupt``, two long requests (streamed and not) are in flight when the push
    starts: they are stopped, wait for the update, and when the trainer dies and its lease runs
    out each ends with an SGLang-shaped error (no engine holds a complete version), never a hang."""
    procs, router = fleet
    marker, go = tmp_path / "stalled", tmp_path / "go"
    answers: list = []
    long = {"text": "a long rollout", "sampling_params": {"max_new_tokens": 1900, "temperature": 0, "ignore_eos": True}}
    clients = [
        threading.Thread(target=lambda: answers.append(post(router.url + "/generate", long, timeout=120))),
        threading.Thread(target=lambda: answers.append(sse(router.url + "/generate", {**long, "stream": True}, 120))),
    ]
    argv = [
        sys.executable,
        "-m",
        "tests.weights.trainer_main",
        "--engines",
        json.dumps(targets(procs)),
        "--port",
        str(free_port()),
        "--router",
        router.url,
        "--stall-after",
        "9",
        "--marker",
        str(marker),
        "--refit",
        refit,
        "--go",
        str(go),
    ]
    log = (tmp_path / "trainer.log").open("w")
    trainer = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if refit == "interrupt":
            for client in clients:
                client.start()
            eventually(
                lambda: running(procs[2]) >= 2,
                60,
                interval=0.2,
                what=lambda: (
                    f"both clients' requests running (answers' ends {[str(a[-2:])[-400:] for a in answers]}, "
                    f"workers {workers(router)}, decode {get(procs[2].url + '/server_info')[1]['internal_states']})"
                ),
            )
        go.write_text("go")
        eventually(marker.exists, 60, interval=0.2, what="the trainer's stall marker")
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
        for client in clients if refit == "interrupt" else ():
            client.join()
        if refit == "interrupt":
            whole = next(a for a in answers if isinstance(a, tuple))
            assert whole[0] == 503 and "out of rotation" in json.dumps(whole[1]), whole
            events = next(a for a in answers if isinstance(a, list))
            assert events[-1] == "[DONE]" and "could not be continued" in json.dumps(events[-2]), events[-3:]
        # The lease (3 s) runs out: every engine of the push leaves rotation; the router admits again
        # and answers at once instead of holding requests.
        eventually(
            lambda: all(w["quarantined"] for w in workers(router).values()),
            20,
            interval=0.2,
            what="every engine out of rotation",
        )
        started = time.monotonic()
        status, out = post(router.url + "/generate", {"text": "anyone?", **GREEDY})
        assert status == 503 and "out of rotation" in json.dumps(out)
        assert time.monotonic() - started < 5
        # A new trainer connects (clearing the dead one's session and group) and pushes.
        fresh = model(seed=31)
        with WeightSync(
            targets(procs), master_address="127.0.0.1", master_port=free_port(), router_url=router.url, timeout_secs=60
        ) as sync:
            report = sync.push(list(fresh.named_parameters()), version="seed31")
        assert report.engines == ["e0", "e1", "e2"]
        expected = weights_checksum(fresh)
        assert all(checksums(p) == expected for p in procs)
        status, out = post(router.url + "/generate", {"text": "anyone?", **GREEDY})
        assert status == 200 and out["meta_info"]["weight_version"] == "seed31"
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)


def test_pushes_under_load_fail_no_request(fleet):
    procs, router = fleet
    stop = threading.Event()
    failures: list = []
    seen: Counter = Counter()
    outputs: dict = {}
    lock = threading.Lock()

    def client(i: int) -> None:
        while not stop.is_set():
            prompt = f"load {i % 3}"
            try:
                if i % 2:
                    events = sse(router.url + "/generate", {"text": prompt, "stream": True, **GREEDY})
                    chunks = [e for e in events if e != "[DONE]"]
                    if events[-1] != "[DONE]" or any("error" in c for c in chunks):
                        failures.append(events[-2:])
                        continue
                    versions = {c["meta_info"]["weight_version"] for c in chunks}
                    if len(versions) != 1:
                        failures.append(("mixed versions in one stream", versions))
                    result = chunks[-1]
                else:
                    status, result = post(router.url + "/generate", {"text": prompt, **GREEDY})
                    if status != 200:
                        failures.append((status, result))
                        continue
                version = result["meta_info"]["weight_version"]
                with lock:
                    seen[version] += 1
                    # Greedy: one prompt on one version always gives one output.
                    key = (prompt, version)
                    if outputs.setdefault(key, result["output_ids"]) != result["output_ids"]:
                        failures.append(("two outputs for one version", key))
            except Exception as exc:  # a broken stream or connection is a failure too
                failures.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        with WeightSync(
            targets(procs), master_address="127.0.0.1", master_port=free_port(), router_url=router.url, timeout_secs=60
        ) as sync:
            for seed in (41, 42, 43):
                time.sleep(1.0)
                sync.push(list(model(seed).named_parameters()), version=f"load-{seed}")
            time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not failures, failures[:5]
    assert {"load-41", "load-42", "load-43"} <= set(seen), seen
    assert sum(seen.values()) > 30
