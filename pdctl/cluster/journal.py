"""A day-2 command's journal: the one engine step in progress, in the state file, so that an
interrupted ``restart`` or ``apply`` strands nothing that ``status``, the next run and ``down``
cannot see.

Each step of ``restart`` and ``apply`` on one engine (add, replace, remove) writes its phase into
``state.journal`` before it acts, and clears it when the step is done. A step that stops (Ctrl-C,
an error) undoes what it can undo at once and safely (an engine it added is stopped and
unregistered; a cordon it set on an engine still running is lifted) and otherwise leaves its
entry: ``status`` then says which command left which engine in which phase and exits 1, the next
``restart`` or ``apply`` finishes it first (``recover``), and ``down`` stops everything the state
records. Ctrl-C is held back while processes are spawned and recorded (``interrupts_deferred``),
so that no process runs that the state file does not name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

from pdctl.choices import Choice
from pdctl.cluster.state import ClusterState, StateStore
from pdctl.signals import stop_signals


class ChangeKind(Choice):
    """What a step does to one engine (or the router)."""

    ADD = "add"
    REPLACE = "replace"
    REMOVE = "remove"
    SWITCH = "switch"
    """Its PD role, live (pdctl.cluster.switch)."""


class StepPhase(Choice):
    """How far a step got."""

    BEGUN = "begun"
    CORDONED = "cordoned"
    """Out of the router's rotation; its processes still run."""
    STOPPED = "stopped"
    """Its old processes are stopped; the new ones are not started yet."""
    STARTED = "started"
    """Its new processes run (recorded in the state); not back in rotation yet."""


@dataclass(frozen=True)
class Entry:
    """The journal's one entry: which command (restart or apply) was changing which engine, how, and
    how far it got, with the pid and time of its last write."""

    command: str  # restart | apply
    unit: str
    kind: ChangeKind
    phase: StepPhase
    url: str | None
    processes: tuple[str, ...]
    pid: int
    at: float

    def to_json(self) -> dict[str, Any]:
        """The entry as ``state.journal`` holds it (JSON-ready data)."""
        return {**asdict(self), "kind": self.kind.value, "phase": self.phase.value, "processes": list(self.processes)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Entry:
        """The entry that ``to_json`` wrote; raises ``KeyError`` or ``ValueError`` on a malformed one."""
        return cls(
            command=str(raw["command"]),
            unit=str(raw["unit"]),
            kind=ChangeKind(raw["kind"]),
            phase=StepPhase(raw["phase"]),
            url=raw.get("url"),
            processes=tuple(raw.get("processes") or ()),
            pid=int(raw.get("pid") or 0),
            at=float(raw.get("at") or 0.0),
        )

    def describe(self) -> str:
        """What it left, for ``status`` and errors."""
        what = {
            StepPhase.BEGUN: "before it changed anything",
            StepPhase.CORDONED: "out of the router's rotation (its processes still run)",
            StepPhase.STOPPED: "stopped (its new processes were not started)",
            StepPhase.STARTED: "started again but not yet back in the router's rotation",
        }[self.phase]
        return f"`pdctl {self.command}` stopped while it was to {self.kind.value} {self.unit}: {what}"


def entry_of(state: ClusterState) -> Entry | None:
    return Entry.from_json(state.journal) if state.journal else None


class Journal:
    """Writes one command's steps into ``state.journal`` (saved at once)."""

    def __init__(self, state: ClusterState, store: StateStore, command: str):
        self.state, self.store, self.command = state, store, command

    def begin(self, unit: str, kind: ChangeKind, url: str | None, processes: tuple[str, ...]) -> None:
        """Record a new step on ``unit``, in phase ``BEGUN``, and save the state before the step acts.
        A unit cordoned ahead (``cordon_ahead``) leaves that record in the same save: the entry
        names it from now on."""
        entry = Entry(self.command, unit, kind, StepPhase.BEGUN, url, processes, os.getpid(), time.time())
        self.state.journal = entry.to_json()
        ahead = self.state.cordoned_ahead
        if ahead is not None and unit in ahead["engines"]:
            rest = {k: v for k, v in ahead["engines"].items() if k != unit}
            self.state.cordoned_ahead = {**ahead, "engines": rest} if rest else None
        self.store.save(self.state)

    def cordon_ahead(self, engines: dict[str, str], command: str) -> None:
        """Record ``engines`` (id -> URL) as cordoned ahead of their own steps by ``command``, and
        save the state before they are cordoned."""
        self.state.cordoned_ahead = {"command": command, "pid": os.getpid(), "engines": dict(engines)}
        self.store.save(self.state)

    def forget_ahead(self) -> None:
        """Forget the engines cordoned ahead (their cordons lifted, or theirs to keep), and save."""
        if self.state.cordoned_ahead is not None:
            self.state.cordoned_ahead = None
            self.store.save(self.state)

    def phase(self, phase: StepPhase) -> None:
        """Record that the step under way reached ``phase``, and save the state; a step must have
        begun."""
        assert self.state.journal is not None, "a step has begun"
        self.state.journal = {**self.state.journal, "phase": phase.value, "at": time.time()}
        self.store.save(self.state)

    def end(self) -> None:
        """Clear the journal (the step is done or fully undone) and save the state."""
        self.state.journal = None
        self.store.save(self.state)


HELD_BACK = b"pdctl: interrupted: finishing the step in progress first (it records what it started)\n"
_held_back: list[list[int]] = []
"""The signals each ``interrupts_deferred`` block under way holds back, innermost last."""


def interrupt_held() -> bool:
    """Whether a stop signal is held back by an ``interrupts_deferred`` block under way: what
    such a block may wait on for long (a switch asked again, say) stops waiting."""
    return any(_held_back)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold back Ctrl-C (SIGINT), SIGTERM and SIGHUP until the block is done, then raise
    KeyboardInterrupt: for what
    must happen whole (spawn a process and record it; undo a step). Only on the main thread (the
    only one Python delivers signals to); elsewhere the block simply runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        # One raw write, not logging: the signal may land while the main thread is inside a write
        # to stderr (a progress line), and a second write into that buffered stream from here
        # raised "reentrant call inside <_io.BufferedWriter name='<stderr>'>" (a full suite's
        # Ctrl-C tests met it as "internal error").
        if not caught:
            with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) takes stderr with it
                os.write(2, HELD_BACK)
        caught.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in stop_signals()}  # (an ignored one stays ignored)
    _held_back.append(caught)
    try:
        yield
    finally:
        _held_back.pop()  # (blocks nest on the main thread: this one is the innermost)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if caught:
        raise KeyboardInterrupt
