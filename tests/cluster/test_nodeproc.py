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
