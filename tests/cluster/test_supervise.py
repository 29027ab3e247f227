"""pdctl.node.supervise, the wrapper every cluster process runs under on its node: what it restarts,
what it leaves alone, and what it writes down. Real processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from pdctl.node.supervise import MAX_RESTARTS, failed
from tests.helpers import eventually

CHILD = """
import os, sys, time
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\\n")
code = int(sys.argv[2])
if code >= 0:
    sys.exit(code)
time.sleep(3600)
"""


def _supervise(tmp: Path, code: int, restart: str = "on-failure") -> tuple[subprocess.Popen, Path, Path]:
    runs, story = tmp / "runs", tmp / "story.json"
    script = tmp / "child.py"
    script.write_text(CHILD)
    argv = [sys.executable, "-m", "pdctl.node.supervise", str(story), "--restart", restart, "--"]
    proc = subprocess.Popen(
        [*argv, sys.executable, str(script), str(runs), str(code)], start_new_session=True, stderr=subprocess.PIPE
    )
    return proc, story, runs


def _read(story: Path) -> dict:
    """The story, once there is one to read (a 1-tuple: truthy whatever the story holds)."""
    (read,) = eventually(
        lambda: (json.loads(story.read_text()),), 60, interval=0.02, ignore=(OSError, ValueError), what="the story"
    )
    return read


def _pids(runs: Path, count: int) -> list[str]:
    """The pids of the child's runs, once it has started ``count`` times."""

    def started() -> list[str]:
        pids = runs.read_text().split() if runs.exists() else []
        return pids if len(pids) >= count else []

    return eventually(started, 60, interval=0.02, what=f"{count} runs of the child")


def _wait(story: Path, check) -> dict:
    """Wait until the story satisfies ``check`` (the wrapper writes it at every change)."""

    def met() -> dict | None:
        current = _read(story)
        return current if check(current) else None

    return eventually(met, 60, interval=0.02, what="the story's change")


def test_exit_statuses_that_count_as_failures() -> None:
    assert failed(1) and failed(127) and failed(-signal.SIGKILL) and failed(-signal.SIGSEGV)
    assert not failed(0) and not failed(-signal.SIGTERM) and not failed(-signal.SIGINT)


def test_a_killed_child_is_restarted_and_a_stop_is_not(tmp_path) -> None:
    proc, story, runs = _supervise(tmp_path, -1)
    try:
        first = _wait(story, lambda s: s["state"] == "running" and s["pid"])
        _pids(runs, 1)
        os.kill(first["pid"], signal.SIGKILL)
        second = _wait(story, lambda s: s["restarts"] == 1 and s["state"] == "running" and s["pid"])
        assert second["pid"] != first["pid"] and second["last_exit"]["code"] == -signal.SIGKILL
        assert _pids(runs, 2) == [str(first["pid"]), str(second["pid"])]
        os.killpg(proc.pid, signal.SIGTERM)  # as `down` does: the whole group
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    final = _read(story)
    assert final["state"] == "exited" and final["restarts"] == 1 and final["pid"] is None
    assert len(runs.read_text().split()) == 2, "nothing was restarted after the stop"
    assert b"restart 1 in 0.1s" in proc.stderr.read()


def test_a_clean_exit_is_kept_and_never_means_never(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    proc, story, _ = _supervise(tmp_path / "a", 0)
    assert proc.wait(timeout=60) == 0 and _read(story)["exit_code"] == 0
    proc, story, runs = _supervise(tmp_path / "b", 7, "never")
    assert proc.wait(timeout=60) == 7
    final = _read(story)
    assert final["exit_code"] == 7 and final["restarts"] == 0 and len(runs.read_text().split()) == 1


def test_the_sixth_failure_within_the_window_leaves_it_down(tmp_path) -> None:
    proc, story, runs = _supervise(tmp_path, 3)
    assert proc.wait(timeout=100) == 3
    final = _read(story)
    assert final["state"] == "gave_up" and final["restarts"] == MAX_RESTARTS
    assert f"failed {MAX_RESTARTS + 1} times within 10 minutes" in final["reason"]
    assert len(runs.read_text().split()) == MAX_RESTARTS + 1
    assert oct(story.stat().st_mode & 0o777) == "0o600"


def test_a_stop_during_the_backoff_ends_it_at_once(tmp_path) -> None:
    proc, story, runs = _supervise(tmp_path, 3)
    _wait(story, lambda s: s["state"] == "backoff" and s["last_exit"])
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    final = _read(story)
    assert final["state"] == "exited" and len(runs.read_text().split()) == final["restarts"] + 1


def test_the_child_does_not_outlive_a_killed_wrapper(tmp_path) -> None:
    """A ``kill -9`` (or an OOM kill) of the wrapper takes its child with it: an orphan engine
    would go on serving while status says it is down, and nothing would heal it."""
    import psutil

    proc, story, runs = _supervise(tmp_path, -1)
    try:
        child = psutil.Process(_wait(story, lambda s: s["state"] == "running" and s["pid"])["pid"])
        _pids(runs, 1)
        proc.kill()
        proc.wait(timeout=60)
        gone, alive = psutil.wait_procs([child], timeout=60)  # (a bound; it goes at once)
        assert gone and not alive, f"child {child.pid} outlived its wrapper"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # (the child, were it left)
        except ProcessLookupError:
            pass
