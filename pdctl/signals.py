"""How pdctl's long-running servers (sim, null engine, router) learn to stop, and how its commands
take every signal that asks them to stop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
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


@contextlib.contextmanager
def interrupt_where_it_lands(*told: threading.Event) -> Iterator[threading.Event]:
    """Inside, a stop signal (Ctrl-C; SIGTERM and SIGHUP, which pdctl takes as one) sets the events
    ``told`` and the one yielded, and raises KeyboardInterrupt at once, even under asyncio.run,
    which installs its own SIGINT handler (cancel the main task) only over Python's default one.
    The block ends in KeyboardInterrupt whenever a signal came: also when it ended normally or in
    another error. Main thread only (elsewhere nothing is taken); a signal ignored stays so; the
    handlers are restored after.

    The events too, because an exception a signal handler raises goes wherever the main thread is,
    and some places drop it: CPython only prints one raised in a weakref callback (asyncio's set of
    tasks runs one whenever a task ends) and aiohttp's response parser turns one raised in its
    callbacks into a payload error. Seen: a planner under load did not stop on SIGINT; it decided on
    for minutes. A loop that looks at one of the events ends there (the planner's within a sample,
    `pdctl top`'s within a frame)."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    def raise_interrupt(signum: int, frame: object) -> None:
        interrupted.set()
        for event in told:
            event.set()
        raise KeyboardInterrupt

    taken = [sig for sig in stop_signals() if signal.getsignal(sig) is signal.default_int_handler]
    previous = {sig: signal.signal(sig, raise_interrupt) for sig in taken}
    try:
        yield interrupted
    except Exception as exc:  # (a stop signal's KeyboardInterrupt turned into another error on its way)
        if interrupted.is_set():
            raise KeyboardInterrupt from exc
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if interrupted.is_set():  # (one dropped where it landed: the block saw an event and ended)
        raise KeyboardInterrupt


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
