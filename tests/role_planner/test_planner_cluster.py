"""The P:D planner on a real local cluster (issue 58): four sim engines costed as Llama-3.1-8B on
H100s (``--sim-profile``), the real router, closed-loop clients whose load turns from
prefill-heavy to decode-heavy, ``pdctl planner`` in advise and then in act mode."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import control_auth, eventually, free_port_base, get, local_topology, pdctl, post, run_processes

PROFILE = {"sim-profile": "llama3-8b-h100", "max-running-requests": 16, "sim-graph-capture-secs": 1}
"""(A 1 s capture, not the profile's 12 s: the planner's moves are the subject; what a capture costs is
benchmarks/planner.py's.)"""
INTERVAL = 2


class ShiftingLoad:
    """Closed-loop clients through the router. Prefill-heavy: 24 clients, 6,000-token prompts of
    random bytes (nothing cached), 4 tokens out; decode-heavy (``shift``): 48 clients (more than
    two decodes' 16 slots each hold), 50-token prompts, 300 tokens out. Every answer is kept as
    (sent at, status)."""

    def __init__(self, router: str):
        self.router = router
        self.heavy = "prefill"
        self.answers: list[tuple[float, int, str]] = []
        self.stop = threading.Event()
        self.shifted = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(48)]

    def shift(self) -> None:
        self.heavy = "decode"
        self.shifted.set()

    def _run(self, i: int) -> None:
        rng = random.Random(i)
        if i >= 24:
            self.shifted.wait()
        while not self.stop.is_set():
            if self.heavy == "prefill":
                ids, out = [rng.randrange(256) for _ in range(6000)], 4
            else:
                ids, out = [rng.randrange(256) for _ in range(50)], 300
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": out}}
            sent = time.monotonic()
            try:
                status, answer = post(self.router + "/generate", body, timeout=300)
            except OSError as exc:
                status, answer = 0, {"error": str(exc)}
            self.answers.append((sent, status, "" if status == 200 else str(answer)[:300]))

    def __enter__(self) -> ShiftingLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.shifted.set()
        for t in self.threads:
            t.join()


def split(home: Path, name: str) -> tuple[int, int]:
    engines = json.loads((home / name / "state.json").read_text())["plan"]["engines"]
    return sum(e["role"] == "prefill" for e in engines), sum(e["role"] == "decode" for e in engines)


def recorded(home: Path, name: str) -> list[dict]:
    """Every decision in the planner's record (``--history`` shows the latest 50)."""
    return [json.loads(line) for line in (home / name / "planner.jsonl").read_text().splitlines()]


def decisions(env: dict, name: str) -> list[dict]:
    out = pdctl("planner", name, "--history", env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def fleet(tmp_path):
    switchable = {"replicas": 2, "role_switch": True, "args": PROFILE}
    topo = local_topology(
        tmp_path,
        "pdp",
        free_port_base(),
        nodes=[{"name": "me", "host": "127.0.0.1", "gpus": 4, "workdir": str(tmp_path / "runs")}],
        prefill=switchable,
        decode=switchable,
        router={"policy": "round_robin", "admission": {"worker_wait_secs": 120}},
        # mode off: no planner of its own (up starts one otherwise); the test runs them with --mode
        planner={"mode": "off", "interval_secs": INTERVAL, "cooldown_secs": 3 * INTERVAL, "sustain": 2},
    )
    home = tmp_path / "home"
    env = {**os.environ, "PDCTL_HOME": str(home)}
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    router = next(line.split()[-1] for line in up.stdout.splitlines() if line.startswith("router:"))
    try:
        yield env, home, "pdp", router
    finally:
        run_id = json.loads((home / "pdp" / "state.json").read_text())["run_id"]
        down = pdctl("down", "pdp", env=env)
        assert down.returncode == 0, down.stderr
        assert run_processes(run_id) == [], "down left processes of the cluster running"


def test_the_planner_follows_a_load_from_prefill_heavy_to_decode_heavy(fleet) -> None:
    """While a weight update or a framework's pause holds the fleet, act waits; advise changes
    nothing and says what it would do; act moves an engine toward the bottleneck each time the
    load shifts, down to the minimum of the other role, then holds the split through 60 s of the
    steady load; no request fails."""
    env, home, name, router = fleet
    auth = control_auth(name, env["PDCTL_HOME"])
    with ShiftingLoad(router) as load:
        # a weight update holds the fleet: act mode waits and says why, whatever the queues
        assert post(router + "/pdctl/hold", {"txn": "t-held", "engines": [], "lease_secs": 120}, headers=auth)[0] == 200
        held = pdctl("planner", name, "--mode", "act", "--intervals", "2", env=env)
        assert held.returncode == 0, held.stderr
        waits = decisions(env, name)
        assert [d["action"] for d in waits] == ["wait", "wait"] and "held by" in waits[0]["reason"], waits
        assert split(home, name) == (2, 2)
        assert post(router + "/pdctl/release", {"txn": "t-held"}, headers=auth)[0] == 200
        # a framework's pause through the router's SGLang facade (AReaL's and slime's call): it waits too
        assert post(router + "/pause_generation", {"mode": "in_place"}, headers=auth)[0] == 200
        paused = pdctl("planner", name, "--mode", "act", "--intervals", "1", env=env)
        assert paused.returncode == 0, paused.stderr
        last = decisions(env, name)[-1]
        assert last["action"] == "wait" and "held by" in last["reason"], last
        assert post(router + "/continue_generation", {}, headers=auth)[0] == 200
        assert split(home, name) == (2, 2)
        # advise: three intervals under prefill-heavy load, the split as it was
        advise = pdctl("planner", name, "--mode", "advise", "--intervals", "5", env=env)
        assert advise.returncode == 0, advise.stderr
        assert split(home, name) == (2, 2)
        advised = [d for d in decisions(env, name) if d["action"] == "switch"]
        assert advised and advised[-1]["to_role"] == "prefill" and advised[-1]["outcome"].startswith("advised"), [
            (d["reason"], d["figures"]) for d in decisions(env, name)
        ]
        # act, in the background as an operator runs it
        log = (home / "planner.log").open("w")
        planner = subprocess.Popen(
            [sys.executable, "-m", "pdctl", "planner", name, "--mode", "act"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            shifted = time.monotonic()
            eventually(lambda: split(home, name) == (3, 1), 120, what=lambda: f"3:1 ({split(home, name)})")
            reacted = time.monotonic() - shifted
            load.shift()
            eventually(lambda: split(home, name) == (1, 3), 240, what=lambda: f"1:3 ({split(home, name)})")

            # settled on a steady load: no switch for 30 intervals (60 s), though it could still move a
            # decode back to prefill (the prefills are at their minimum, the decodes are not)
            def moved() -> int:  # engines switched (a decision may move several at once)
                done = [d for d in recorded(home, name) if str(d.get("outcome") or "").startswith("switched")]
                return sum(len(d.get("engines") or [d["engine"]]) for d in done)

            eventually(lambda: moved() == 3, 60, what="the last switch's record")  # (written once it is done)
            settled = len(recorded(home, name))
            eventually(lambda: len(recorded(home, name)) >= settled + 30, 240, what="30 more intervals")
            steady = recorded(home, name)[settled:]
            assert all(d["action"] != "switch" for d in steady), [d["reason"] for d in steady]
            assert split(home, name) == (1, 3)
        finally:
            planner.send_signal(signal.SIGINT)
            try:
                code = planner.wait(timeout=120)
            except subprocess.TimeoutExpired:  # where it is stuck: its stacks (pdctl planner's SIGUSR1)
                planner.send_signal(signal.SIGUSR1)
                eventually(lambda: "most recent call first" in (home / "planner.log").read_text(), 30, what="stacks")
                planner.kill()
                stacks = (home / "planner.log").read_text()[-6000:]
                raise AssertionError(f"the planner did not stop on SIGINT:\n{stacks}") from None
            assert code == 0, (home / "planner.log").read_text()[-3000:]
    switched = [d for d in decisions(env, name) if d.get("outcome", "") and d["outcome"].startswith("switched")]
    assert [d["to_role"] for d in switched for _ in d["engines"]] == ["prefill", "decode", "decode"], switched
    assert all(d["figures"] and d["reason"] for d in switched)
    # decided, then drained and switched: the record says both (the cooldown runs from the end)
    assert all(d["decided_at"] < d["at"] for d in switched), [(d["decided_at"], d["at"]) for d in switched]
    status = json.loads(pdctl("status", name, "--json", env=env).stdout)
    assert status["planner"] and status["planner"][-1]["reason"], status.get("planner")
    frame = json.loads(pdctl("top", name, "--once", "--json", env=env).stdout)
    assert frame["planner"]["last"]["reason"] == status["planner"][-1]["reason"], frame["planner"]
    metrics = get(router + "/metrics")[1]  # each decision counted by the router (pdctl.router.planner_api)
    said = f'pdctl_planner_decisions_total{{action="switch",mode="act",outcome="switched"}} {len(switched)}.0'
    assert said in metrics, metrics
    assert 'pdctl_planner_decisions_total{action="wait",mode="act",outcome="none"} 3.0' in metrics
    assert 'action="switch",mode="advise",outcome="advised"' in metrics
    failed = [a for a in load.answers if a[1] != 200]
    assert not failed and len(load.answers) > 100, (failed[:3], len(load.answers))
    print(f"reacted in {reacted:.1f} s; {len(load.answers)} requests")
