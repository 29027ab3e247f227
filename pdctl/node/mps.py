"""CUDA MPS control daemons on a node, for colocated plans (run by the agent: ``mps-start``,
``mps-stop``, ``mps-status``).

One daemon per pipe directory (``CUDA_MPS_PIPE_DIRECTORY``). ``start`` reuses a daemon that
already serves the directory (and says so: ``down`` leaves such a daemon alone), else runs
``nvidia-cuda-mps-control -d`` found on the node's PATH and waits for its control pipe.
``stop`` sends ``quit`` on the control program's stdin, waits for the daemon to exit, and
kills it (and its MPS servers) if its clients keep it past the grace period.

A daemon is recognised by its command line (the control program with ``-d`` or ``-f``) and
its environment's pipe directory, or by the pid file MPS writes in that directory; the
control pipe itself is never opened here, so nothing is sent to a daemon but ``quit``.
Imports stay light (the agent runs this on every node).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from pdctl.node.proc import expand, running, same_process, start_time
from pdctl.node.replies import MpsStartReply, MpsStatusReply, MpsStopReply

CONTROL_BINARY = "nvidia-cuda-mps-control"
SERVER_BINARY = "nvidia-cuda-mps-server"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_PIPE = "control"
START_TIMEOUT_SECS = 20.0
QUIT_TIMEOUT_SECS = 10.0


class MpsError(Exception):
    """MPS cannot run on this node; the message says why and what to do."""


def start(req: dict[str, Any]) -> MpsStartReply:
    """Make sure a control daemon serves ``pipe_dir``. Returns ``pid``, ``create_time`` and
    ``started`` (false: one was already running and is not ours to stop)."""
    pipe_dir, log_dir = Path(expand(req["pipe_dir"])), Path(expand(req["log_dir"]))
    env = _env(req, pipe_dir, log_dir)
    for directory in (pipe_dir, log_dir):
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    running = find_daemon(pipe_dir)
    if running is not None and (pipe_dir / CONTROL_PIPE).exists():
        return _start_reply(running, started=False, pipe_dir=pipe_dir)
    binary = shutil.which(CONTROL_BINARY, path=env.get("PATH"))
    if binary is None:
        raise MpsError(
            f"{CONTROL_BINARY} is not on the node's PATH ({env.get('PATH', '')}); install the NVIDIA driver's "
            "compute utilities, or set placement.mps: false to run colocated processes without MPS"
        )
    timeout = float(req.get("timeout_secs", START_TIMEOUT_SECS))
    log_start = _size(log_dir / "control.log")
    # Output to a file, not a pipe: a daemon that keeps the pipe open would hang the read.
    with tempfile.TemporaryFile() as out:
        try:
            code = subprocess.run(
                [binary, "-d"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                timeout=timeout,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            code = None
        out.seek(0)
        said = out.read().decode(errors="replace").strip()
    if code != 0:
        why = "did not return" if code is None else f"exited {code}"
        raise MpsError(f"{binary} -d {why}: {said or 'no output'}{_log_tail(log_dir, log_start)}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        daemon = find_daemon(pipe_dir)
        if daemon is not None and (pipe_dir / CONTROL_PIPE).exists():
            return _start_reply(daemon, started=True, pipe_dir=pipe_dir)
        time.sleep(0.05)
    _kill(_daemon_and_servers(pipe_dir))
    raise MpsError(
        f"{binary} -d did not open {pipe_dir / CONTROL_PIPE} within {timeout:g}s{_log_tail(log_dir, log_start)}"
    )


def stop(req: dict[str, Any]) -> MpsStopReply:
    """Stop the daemon ``pid``/``create_time`` on ``pipe_dir``: ``quit``, then force after
    ``grace_secs``. Returns ``forced`` and ``detail``; a daemon already gone is fine."""
    pipe_dir, log_dir = Path(expand(req["pipe_dir"])), Path(expand(req["log_dir"]))
    daemon = same_process(int(req["pid"]), float(req["create_time"]))
    if daemon is None:
        return {"forced": False, "detail": "not running"}
    env = _env(req, pipe_dir, log_dir)
    grace = float(req.get("grace_secs", QUIT_TIMEOUT_SECS))
    detail = "quit"
    binary = shutil.which(CONTROL_BINARY, path=env.get("PATH"))
    if binary is None:
        detail = f"{CONTROL_BINARY} is no longer on PATH"
    else:
        try:
            subprocess.run(
                [binary],
                env=env,
                input=b"quit\n",
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=grace,
                check=False,
            )
        except subprocess.TimeoutExpired:
            detail = f"quit did not return within {grace:g}s"
    if not _wait_gone([daemon], grace):
        return {"forced": False, "detail": detail}
    left = _kill([daemon, *_daemon_and_servers(pipe_dir)])
    detail += f"; still running after {grace:g}s (clients hang?), killed"
    return {"forced": True, "detail": detail, "left": left}


def status(req: dict[str, Any]) -> MpsStatusReply:
    """Whether the daemon ``pid``/``create_time`` still runs, and its control pipe exists."""
    pipe_dir = Path(expand(req["pipe_dir"]))
    daemon = same_process(int(req["pid"]), float(req["create_time"]))
    return {"running": daemon is not None, "control_pipe": (pipe_dir / CONTROL_PIPE).exists()}


def find_daemon(pipe_dir: Path) -> psutil.Process | None:
    """The control daemon serving ``pipe_dir``, if one runs (pid file first, then a scan)."""
    try:
        pid = int((pipe_dir / PID_FILE).read_text().strip())
        proc = psutil.Process(pid)
        if _is_program(proc, CONTROL_BINARY) and running(proc):
            return proc
    except (OSError, ValueError, psutil.Error):
        pass
    return next(iter(_daemon_and_servers(pipe_dir, servers=False)), None)


def _daemon_and_servers(pipe_dir: Path, servers: bool = True) -> list[psutil.Process]:
    wanted = os.path.realpath(pipe_dir)
    out = []
    for proc in psutil.process_iter(["pid"]):
        try:
            daemon = _is_program(proc, CONTROL_BINARY, daemon=True)
            if not (daemon or (servers and _is_program(proc, SERVER_BINARY))) or not running(proc):
                continue
            pipe = proc.environ().get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIRECTORY)
            if os.path.realpath(pipe) == wanted:
                out.append(proc)
        except psutil.Error:  # gone, or another user's (whose environment we cannot read)
            continue
    return out


def _is_program(proc: psutil.Process, name: str, daemon: bool = False) -> bool:
    """``proc`` runs ``name`` (directly, or as a script under an interpreter: the test stand-in)."""
    cmdline = proc.cmdline()
    head = [os.path.basename(a) for a in cmdline[:2]]
    if name not in head and proc.name() != name:
        return False
    return not daemon or any(a in ("-d", "-f") for a in cmdline[1:])


def _start_reply(proc: psutil.Process, *, started: bool, pipe_dir: Path) -> MpsStartReply:
    return {"pid": proc.pid, "create_time": start_time(proc), "started": started, "pipe_dir": str(pipe_dir)}


def _kill(procs: list[psutil.Process]) -> list[int]:
    """SIGTERM, a short wait, SIGKILL; the pids that survived."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        procs = _wait_gone(procs, 3.0)
        if not procs:
            return []
    return [p.pid for p in procs]


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until each process has exited (a zombie counts: a daemon is no child of ours to
    reap, and a container's init may never reap it); the ones still running."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if running(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _env(req: dict[str, Any], pipe_dir: Path, log_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        **{k: str(v) for k, v in req.get("env", {}).items()},
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
        "CUDA_MPS_LOG_DIRECTORY": str(log_dir),
    }


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _log_tail(log_dir: Path, since: int, lines: int = 10) -> str:
    """The last lines the daemon logged (control.log) since byte ``since``: this start's."""
    try:
        with open(log_dir / "control.log", "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return ("\ncontrol.log: " + "\n".join(text)) if text else ""
