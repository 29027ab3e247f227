"""Waiting for processes that are not ours to end (pdctl.node.proc.wait_gone, the agent's stop)."""

from __future__ import annotations

import subprocess
import sys

import psutil

from pdctl.node.proc import wait_gone

PARENT = "import subprocess, sys; c = subprocess.Popen(sys.argv[1:]); print(c.pid, flush=True); sys.stdin.read()"
"""Starts a child, prints its pid and never reaps it: once the child exits it stays a zombie."""


def test_an_exited_process_nobody_reaps_is_gone_and_a_running_one_is_not() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, sys.executable, "-c", "pass"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        # its exit is seen although nobody reaps it (psutil.wait_procs waits for a reaper that may
        # never come: a container's init)
        gone, alive = wait_gone([child], timeout=60)
        assert [p.pid for p in gone] == [child.pid] and alive == [] and child.status() == psutil.STATUS_ZOMBIE
        gone, alive = wait_gone([child, psutil.Process(sleeper.pid)], timeout=0.2)  # the sleeper outlives it
        assert [p.pid for p in gone] == [child.pid] and [p.pid for p in alive] == [sleeper.pid]
        sleeper.terminate()
        gone, alive = wait_gone([psutil.Process(sleeper.pid)], timeout=60)
        assert [p.pid for p in gone] == [sleeper.pid] and alive == []
    finally:
        sleeper.kill()
        sleeper.wait()
        parent.kill()
        parent.wait()


def test_a_step_of_the_wall_clock_leaves_every_recorded_process_known(tmp_path, monkeypatch) -> None:
    """The kernel derives the boot time psutil adds to a process's start from the wall clock (and
    rounds it to a second): a step of the clock (NTP, a VM paused or moved) moves every psutil
    create_time at once. The agent names processes by their start since boot, so after a step a
    spawned process is still alive to status and wait-ready, and stop still stops it. (Seen in
    CI: live engines reported exited, a stop that skipped one, its replacement died on its port.)
    The step is the kernel's boot time as psutil reads it, a second back; a test must not set the
    machine's clock (the real step was tried by hand: see the commit)."""
    import psutil._pslinux as pslinux

    from pdctl.node import agent
    from pdctl.node.proc import recorded_start, same_process, start_time

    proc = {"id": "p", "argv": [sys.executable, "-c", "import time; time.sleep(600)"], "env": {},
            "cwd": str(tmp_path), "log_path": str(tmp_path / "p.log")}  # fmt: skip
    started = agent.spawn({"processes": [proc]})["started"]["p"]
    ident = {"id": "p", "pid": started["pid"], "create_time": started["create_time"]}
    child = psutil.Process(started["pid"])
    legacy = child.create_time()  # what an earlier pdctl recorded: psutil's wall-clock time
    try:
        booted = pslinux.boot_time()
        monkeypatch.setattr(pslinux, "boot_time", lambda: booted - 1.0)
        assert psutil.Process(started["pid"]).create_time() == legacy - 1.0  # the step, as psutil sees it
        assert agent.status({"processes": [ident]})["processes"]["p"]["alive"] is True
        ready = agent.wait_ready({"targets": [{**ident, "url": "http://127.0.0.1:1/"}], "timeout_secs": 0.3})
        assert ready["ready"] is False and "exited" not in ready["reason"], ready
        assert same_process(started["pid"], legacy) is None  # an old record, read after the step: lost once
        monkeypatch.undo()
        assert same_process(started["pid"], legacy) is not None
        assert abs(recorded_start(legacy) - start_time(child)) < 1e-3
        monkeypatch.setattr(pslinux, "boot_time", lambda: booted - 1.0)
        stopped = agent.stop({"processes": [{**ident, "pgid": started["pgid"]}], "grace_secs": 10})
        assert stopped["terminated"] == 1 and stopped["left"] == [], stopped
        assert wait_gone([child], timeout=60)[1] == []
    finally:
        child.kill()
