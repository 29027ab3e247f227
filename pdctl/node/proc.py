"""Process identity on a node, shared by the agent and the MPS daemon code (light: psutil only)."""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Iterable

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


def wait_gone(procs: Iterable[psutil.Process], timeout: float) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(gone, alive) once every process has exited or ``timeout`` seconds passed.

    Event-driven where the kernel offers it: a pidfd (Linux 5.3+) becomes readable the moment
    its process exits, zombie or not. psutil.wait_procs waits for a zombie to be *reaped*, which
    a container's init may do late or never (its ``down`` then took the whole grace period); and
    it checks one process at a time for up to 1/n s each. Without pidfds: a 20 ms poll.
    """
    gone: list[psutil.Process] = []
    watched: dict[int, psutil.Process] = {}
    polled: list[psutil.Process] = []
    for proc in procs:
        try:
            watched[os.pidfd_open(proc.pid)] = proc
        except ProcessLookupError:
            gone.append(proc)
        except (OSError, AttributeError):  # an older kernel, or a platform without pidfd_open
            polled.append(proc)
    deadline = time.monotonic() + timeout
    poller = select.poll()
    for fd in watched:
        poller.register(fd, select.POLLIN)
    try:
        while watched or polled:
            still: list[psutil.Process] = []
            for proc in polled:
                (still if running(proc) else gone).append(proc)
            polled = still
            left = deadline - time.monotonic()
            if left <= 0 or not (watched or polled):
                break
            wait_ms = min(left, 0.02) * 1000 if polled else left * 1000
            for fd, _ in poller.poll(wait_ms):
                poller.unregister(fd)
                os.close(fd)
                gone.append(watched.pop(fd))
    finally:
        for fd in watched:
            with contextlib.suppress(OSError):
                os.close(fd)
    return gone, [*watched.values(), *polled]


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_EPOCH_FLOOR = 1e9
"""A recorded start above this is psutil's wall-clock create_time (2001 on), not seconds since boot."""


def start_time(proc: psutil.Process) -> float:
    """When ``proc`` started, in seconds since its node booted: with the pid, what names a process
    (pids are reused). This is what every ``create_time`` pdctl records holds.

    Not psutil's ``create_time()``: that adds the boot time, which the kernel derives from the wall
    clock and rounds down to a whole second, so a step of the clock (NTP, a VM paused or moved)
    shifts every process's create_time at once. A record taken before such a step then matched
    no live process after it: running engines were reported exited, and a stop skipped them (they
    kept their ports, and the engine started in their place died on them). The start in clock
    ticks since boot (/proc/PID/stat) never changes. Without /proc: psutil's create_time."""
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "PID (COMM)": COMM may hold spaces
    except FileNotFoundError as exc:
        if os.path.isdir("/proc/self"):
            raise psutil.NoSuchProcess(proc.pid) from exc
        return proc.create_time()
    return int(fields[19]) / _CLOCK_TICKS  # field 22, starttime


def recorded_start(create_time: float) -> float:
    """A recorded ``create_time`` as start_time counts: one written by an earlier pdctl (psutil's
    wall-clock time; a cluster that was up across an upgrade) is converted once, with the fragility
    it always had."""
    if create_time > _EPOCH_FLOOR and os.path.isdir("/proc/self"):
        return create_time - psutil.boot_time()
    return create_time


def same_process(pid: int, create_time: float) -> psutil.Process | None:
    """The process if it is still the one recorded (pids are reused) and running. ``create_time``:
    its start_time when it was recorded."""
    try:
        proc = psutil.Process(pid)
        if abs(start_time(proc) - recorded_start(create_time)) < 0.05 and running(proc):
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
