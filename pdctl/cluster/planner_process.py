"""The planner as a process of the cluster: ``up`` starts it (a topology with ``planner.mode``
advise or act), ``down`` stops it, its supervisor restarts it when it fails.

It runs on the control machine (it reads the cluster's state and switches engines as
``pdctl switch`` does, over the same SSH connections), as ``pdctl planner NAME`` under
``pdctl.node.supervise`` (restart on failure, the story in ``planner.exit``), in a session of its own
so that the command that started it may end. It carries the cluster's run id in its environment,
as every process of the cluster does, so ``down``'s sweep finds it too. Its output goes to
``planner.log`` beside the state (0600).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from typing import Any

import psutil

from pdctl.cluster.state import ClusterState, StateStore
from pdctl.node.agent import RUN_ID_ENV
from pdctl.node.proc import running, same_process, start_time
from pdctl.role_planner.config import PlannerConfig, PlannerMode

STOP_GRACE_SECS = 10.0


def wanted(state: ClusterState) -> PlannerConfig | None:
    """The cluster's planner settings when its topology runs one (mode advise or act)."""
    raw = state.plan.planner
    if not raw:
        return None
    config = PlannerConfig.from_dict(dict(raw))
    return None if config.mode is PlannerMode.OFF else config


def start(state: ClusterState, store: StateStore) -> dict[str, Any] | None:
    """Start the cluster's planner (when its topology has one) and record it in ``state.planner``
    (the caller saves the state). None when there is none to run."""
    if wanted(state) is None:
        return None
    home = store.dir(state.name)
    log_path, exit_file = home / "planner.log", home / "planner.exit"
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    env = {**os.environ, "PDCTL_HOME": str(store.root), RUN_ID_ENV: state.run_id}
    argv = [sys.executable, "-m", "pdctl.node.supervise", str(exit_file), "--restart", "on-failure", "--"]
    argv += [sys.executable, "-m", "pdctl", "planner", state.name]
    with os.fdopen(fd, "a") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    record = {
        "pid": proc.pid,
        "create_time": _create_time(proc.pid),
        "log": str(log_path),
        "exit_file": str(exit_file),
    }
    state.planner = record
    return record


def stop(state: ClusterState) -> None:
    """Stop the recorded planner (its supervisor's whole group: SIGTERM, then SIGKILL after
    ``STOP_GRACE_SECS``) and forget it. A planner already gone is forgotten at once."""
    record = state.planner
    if not record:
        return
    proc = _alive(record)
    if proc is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_SECS)
        except psutil.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(psutil.Error):
                proc.wait(STOP_GRACE_SECS)
    state.planner = {}


def describe(state: ClusterState) -> dict[str, Any] | None:
    """The planner process as ``status`` shows it: alive, pid, restarts, its supervisor's state, log."""
    record = state.planner
    if not record:
        return None
    story: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        story = json.loads(open(record["exit_file"]).read())  # noqa: SIM115 - one small read
    return {
        "alive": _alive(record) is not None,
        "pid": story.get("pid"),
        "supervisor_pid": record.get("pid"),
        "restarts": story.get("restarts", 0),
        "state": story.get("state"),
        "log": record.get("log"),
    }


def _create_time(pid: int) -> float | None:
    with contextlib.suppress(psutil.Error):
        return start_time(psutil.Process(pid))
    return None


def _alive(record: dict[str, Any]) -> psutil.Process | None:
    """The recorded supervisor, if it still runs (the same process: pid and start time)."""
    try:
        created = record.get("create_time")
        if created is not None:
            return same_process(int(record["pid"]), float(created))
        proc = psutil.Process(int(record["pid"]))
        return proc if running(proc) else None
    except (psutil.Error, KeyError, TypeError, ValueError):
        return None
