"""Process identity on a node, shared by the agent and the MPS daemon code (light: psutil only)."""

from __future__ import annotations

import os

import psutil


def expand(path: str) -> str:
    """A path as the topology spells it (``~/...``), for this node's user."""
    return os.path.expanduser(path)


def running(proc: psutil.Process) -> bool:
    """Still running: a zombie has exited (and may never be reaped by a container's init)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def same_process(pid: int, create_time: float) -> psutil.Process | None:
    """The process if it is still the one recorded (pids are reused) and running."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) < 0.05 and running(proc):
            return proc
    except psutil.Error:
        pass
    return None


SECRET_FLAGS = ("--api-key", "--admin-api-key")


def redact(argv: list[str]) -> list[str]:
    """``argv`` with the values of SGLang's key flags replaced by ``***`` (both ``--api-key KEY``
    and ``--api-key=KEY``): for anything that shows a command line (a busy port's owner, the
    sim's /server_info)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg in SECRET_FLAGS and i + 1 < len(out):
            out[i + 1] = "***"
        elif arg.startswith(tuple(f"{flag}=" for flag in SECRET_FLAGS)):
            out[i] = arg.split("=", 1)[0] + "=***"
    return out
