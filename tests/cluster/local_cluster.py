"""What the cluster tests that drive a local sim cluster through the CLI share (test_heal,
test_interrupts, test_peer_weights, test_role_switch): `pdctl status` read back, the router's
view of its workers, waits for a restarted process and for a worker back in rotation, clients
that keep requests in flight, and a pdctl command interrupted at one of its progress lines."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers import control_auth, eventually, get, pdctl, post

CONTROL: dict[str, dict[str, str]] = {}
"""Router URL -> its cluster's control-plane header (``/workers`` is control plane)."""


def status_by_process(env: dict) -> dict[str, dict]:
    """`pdctl status --json`'s processes by id, and under "" whether the command exited 0."""
    st = pdctl("status", "--json", env=env)
    return {p["id"]: p for p in json.loads(st.stdout)["processes"]} | {"": {"ok": st.returncode == 0}}


def router_url(env: dict, name: str, status: dict[str, dict] | None = None) -> str:
    """The cluster's router URL (its control-plane header kept in CONTROL for router_workers), from
    ``status`` (a ``status_by_process`` already read) or a new one."""
    url = (status or status_by_process(env))["router"]["url"]
    CONTROL[url] = control_auth(name, env["PDCTL_HOME"])
    return url


def router_workers(router: str) -> dict[str, dict]:
    """The router's /workers by URL (``router`` as router_url returned it)."""
    return {w["url"]: w for w in get(router + "/workers", timeout=10, headers=CONTROL[router])[1]["workers"]}


def story_of(env: dict, proc: str) -> Path:
    """The supervisor's story file of process ``proc`` (pdctl.node.supervise: its state, pid and
    restarts), found in the state file of the cluster under ``env``'s PDCTL_HOME that has it."""
    for state in Path(env["PDCTL_HOME"]).glob("*/state.json"):
        record = json.loads(state.read_text())["processes"].get(proc)
        if record and record.get("exit_file"):
            return Path(record["exit_file"])
    raise AssertionError(f"no supervised process {proc!r} in {env['PDCTL_HOME']}")


def wait_back(env: dict, proc: str, old_pid: int, restarts: int) -> dict:
    """Wait until ``proc`` runs again under a new pid, healthy, with its restart counted (and fail at
    once if it was restarted more often than that). The wait reads the supervisor's story file, then
    `pdctl status` until it says healthy: a status call every 0.2 s for the whole restart spent a core
    that the restarting engine needs."""
    story = story_of(env, proc)

    def restarted() -> bool:
        told = json.loads(story.read_text())
        assert told["restarts"] <= restarts, f"{proc} was restarted {told['restarts']} times, not {restarts}: {told}"
        return told["state"] == "running" and told["pid"] not in (None, old_pid) and told["restarts"] == restarts

    eventually(restarted, 120, interval=0.1, ignore=(OSError, ValueError), what=f"{proc} restarted ({restarts})")

    def back() -> dict | None:
        p = status_by_process(env)[proc]
        assert p["restarts"] <= restarts, f"{proc} was restarted {p['restarts']} times, not {restarts}: {p}"
        return p if p["pid"] != old_pid and p["alive"] and p["healthy"] and p["restarts"] == restarts else None

    return eventually(back, 120, interval=0.5, what=f"{proc} back (restart {restarts})")


def wait_in_rotation(router: str, url: str, version: str | None = None) -> dict:
    """Wait until the router has ``url`` in rotation (on ``version``, when given)."""

    def in_rotation() -> dict | None:
        w = router_workers(router).get(url)
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


def interrupted(
    *args: str,
    at: str,
    env: dict,
    timeout: float = 180,
    sig: signal.Signals = signal.SIGINT,
    command: list[str] | None = None,
    nth: int = 1,
) -> tuple[int, str]:
    """Run ``pdctl ARGS`` (or ``command``); send it ``sig`` (SIGINT: a Ctrl-C) once the ``nth``
    progress line containing ``at`` appears (its exit code and output). Fails when the command ends
    before that line."""
    proc = subprocess.Popen(
        command or [sys.executable, "-m", "pdctl", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []
    sent = threading.Event()
    matched = 0

    def read() -> None:
        nonlocal matched
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            matched += at in line
            if matched == nth and not sent.is_set():
                proc.send_signal(sig)
                sent.set()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join()
    output = "".join(seen)
    assert sent.is_set(), f"pdctl {' '.join(args)} printed {at!r} {matched} times, not {nth}:\n{output}"
    return code, output


def pdctl_status(env: dict) -> tuple[int, dict]:
    """`pdctl status --json`: its exit code and its JSON."""
    st = pdctl("status", "--json", env=env)
    return st.returncode, json.loads(st.stdout)


def truth(env: dict, name: str, st: dict | None = None) -> bool:
    """What is really so, asked of the processes themselves: every planned engine answers and
    the router routes to it (``st``: a `pdctl status --json` just read, else one is read)."""
    if st is None:
        _, st = pdctl_status(env)
    router = next(p for p in st["processes"] if p["role"] == "router")["url"]
    workers = {
        w["url"]: w
        for w in get(router + "/workers", timeout=10, headers=control_auth(name, env["PDCTL_HOME"]))[1]["workers"]
    }
    for engine in st["engines"]:
        url = next((p["url"] for p in st["processes"] if p["id"] in engine["processes"] and p["url"]), None)
        if url is None:  # stopped, none of its processes runs
            return False
        w = workers.get(url)
        try:
            healthy = get(url + "/health", timeout=10)[0] == 200
        except OSError:
            healthy = False
        if not (healthy and w and w["is_healthy"] and not w["cordoned"] and not w["quarantined"]):
            return False
    return True


def settle(env: dict, name: str, deadline_secs: float = 90) -> tuple[int, dict]:
    """Status once what the last command left has settled (a started engine passing its checks):
    its claim must match the truth. Returns the final status."""
    deadline = time.monotonic() + deadline_secs
    while True:
        code, st = pdctl_status(env)
        real = truth(env, name, st)  # after status: while things settle they only get better, so a status
        # that says ok must find the truth ok right after it
        left = st.get("step") and not str(st["step"]).startswith("in progress")
        # settled: true and ok; or true and not ok with a step left in the journal (nothing changes that
        # but the next command: waiting out the deadline for it cost 90 s a test)
        if (code == 0) == real and (real or left or time.monotonic() > deadline):
            return code, st
        assert not (code == 0 and not real), f"status says ok while an engine does not serve: {st}"
        if time.monotonic() > deadline:
            return code, st
        time.sleep(0.3)
