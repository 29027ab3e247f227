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
    killed on the spot with a process it spawned unknown to the state. Main thread only."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)


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
