"""How pdctl's long-running servers (sim, null engine, router) learn to stop, and how its commands
take every signal that asks them to stop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from typing import NoReturn

INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What a user or a terminal sends a command to stop it: Ctrl-C, kill, a closed terminal."""


def interrupt_on_every_stop_signal() -> None:
    """SIGTERM and SIGHUP raise KeyboardInterrupt, as SIGINT does: a command then stops the same
    way whichever it got (what it deferred runs whole, what it started is recorded or undone), not
    killed on the spot with a process it spawned unknown to the state. A signal the command was
    started with ignored stays ignored, as Python leaves an ignored SIGINT: ``nohup`` ignores SIGHUP
    so that a closed terminal does not stop the command (taking it over would stop `nohup pdctl
    planner` when its terminal closes). Main thread only."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler)


def stop_signals() -> tuple[signal.Signals, ...]:
    """The ``INTERRUPTS`` this process does not ignore (a command started by ``nohup`` ignores
    SIGHUP; one started in the background by a shell without job control, SIGINT)."""
    return tuple(sig for sig in INTERRUPTS if signal.getsignal(sig) is not signal.SIG_IGN)


def exit_interrupted() -> NoReturn:
    """How every pdctl command ends on Ctrl-C (or a SIGTERM or SIGHUP turned into one), wherever it
    was (importing its module, parsing, running): ``pdctl: interrupted`` on stderr, exit 130."""
    with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) takes stderr with it
        print("pdctl: interrupted", file=sys.stderr)
    sys.exit(130)


def stop_event() -> asyncio.Event:
    """An event that SIGTERM (``pdctl down``) or SIGINT (Ctrl-C) sets, on the running loop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
