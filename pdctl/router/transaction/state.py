"""A fleet transaction's explicit states, and what it did to each engine.

A transaction (pdctl.router.transaction.runner) moves through ``TxnState`` by ``FleetTxn.move``,
which refuses every step the table does not list:

    HELD ──> MOVING ──> ENDED
      └────────────────────┘      (a pause that no update followed, a failure before any weight moved)

Each engine carries a ``Mark``, set from its answers by ``FleetTxn.mark``; the marks decide the
end: engines whose weights may have changed (``Mark.changed``) and did not take the whole update
leave rotation, the others keep their weights and version and serve on.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdctl.choices import Choice
from pdctl.refit import PARTIAL_LABEL, RefitMode
from pdctl.router.fanout import WorkerAnswer
from pdctl.router.transaction.groups import FleetGroup, Member
from pdctl.router.updates import Driver
from pdctl.router.workers import Worker
from pdctl.sglang import PauseMode
from pdctl.sglang.control import left_untouched


class TxnState(Choice):
    """Where a fleet transaction stands: ``HELD``, then ``MOVING`` (any number of times), then ``ENDED``; ``HELD`` may
    end at once."""

    HELD = "held"
    """The router holds new requests and the engines are paused; no weight has moved."""
    MOVING = "moving"
    """Weights move into the engines (update calls forwarded, or a load from disk)."""
    ENDED = "ended"
    """Continued and released: by its end, a failure, or its lapse."""


_NEXT: Mapping[TxnState, frozenset[TxnState]] = {
    TxnState.HELD: frozenset({TxnState.MOVING, TxnState.ENDED}),
    TxnState.MOVING: frozenset({TxnState.MOVING, TxnState.ENDED}),
    TxnState.ENDED: frozenset(),
}


class Opener(Choice):
    """What opened a transaction (and so what ends it)."""

    PAUSE = "a framework's pause"
    """``/pause_generation``: ends at ``/continue_generation``."""
    UPDATE = "an update sent with no pause"
    """The router paused the fleet itself: ends at the framework's next call of another kind."""
    MEMORY = "a memory release"
    """``/release_memory_occupation`` with no pause: ends when every tag is resumed."""
    LOAD = "pdctl weights load"
    """A load from disk that ``pdctl weights load`` asked of the router: ends when it is done."""
    PUSH = "a pdctl.weights push"
    """A trainer's push (``/pdctl/push/open``): ends at its commit or abort. A failed update call
    leaves it open: its driver redoes the update on the engines that survived, or aborts."""


LEFT_OPEN = {
    Opener.PAUSE: "a pause with no continue",
    Opener.UPDATE: "an update with no end",
    Opener.MEMORY: "memory released and not resumed",
    Opener.LOAD: "a load from disk with no end",
    Opener.PUSH: "a push with no commit",
}
"""How a transaction that lapsed was left, by what opened it (its driver's last word)."""


class Moved(Choice):
    """What moves the weights in a transaction (at most one kind per transaction)."""

    NOTHING = "nothing"
    DISTRIBUTED = "distributed"
    DISK = "disk"


class Mark(Choice):
    """What a transaction did to one engine's weights."""

    UNTOUCHED = "untouched"
    """Nothing reached its model: no call yet, or every call was refused before its receive."""
    TAKING = "taking"
    """It took every update call so far."""
    LOADED = "loaded"
    """It loaded the checkpoint from disk."""
    REFUSED = "refused"
    """It refused the update without touching its model (a load from disk it rolled back, a
    receive that failed): it keeps its weights and version."""
    PARTIAL = "partial"
    """It may hold part of the update: a failure after its receive began, or the update stopped
    after it took some of it."""
    GONE = "gone"
    """It did not answer (dead or hung) after the update began: it may hold anything."""

    @property
    def changed(self) -> bool:
        """Its weights may differ from what it held before the transaction."""
        return self in (Mark.TAKING, Mark.LOADED, Mark.PARTIAL, Mark.GONE)


_MARK_NEXT: Mapping[Mark, frozenset[Mark]] = {
    Mark.UNTOUCHED: frozenset(Mark),
    Mark.TAKING: frozenset({Mark.TAKING, Mark.PARTIAL, Mark.GONE}),
    Mark.REFUSED: frozenset({Mark.REFUSED}),
    Mark.LOADED: frozenset({Mark.LOADED, Mark.GONE}),
    Mark.PARTIAL: frozenset({Mark.PARTIAL, Mark.GONE}),
    Mark.GONE: frozenset({Mark.GONE}),
}


def hold_modes(refit: RefitMode, pause: PauseMode | None, drain_pause: PauseMode) -> tuple[RefitMode, PauseMode]:
    """How a transaction holds the router, and the mode its engines are paused in: with the
    driver's own ``pause``, requests wait at the router and those in flight get what that mode
    gives them (an ``abort`` on an ``interrupt`` router is continued after the update); without
    one, ``refit`` decides (drain: wait for requests in flight, then ``drain_pause``; interrupt:
    ``abort`` at once, continued after)."""
    if pause is not None:
        interrupt = refit is RefitMode.INTERRUPT and pause is PauseMode.ABORT
        return (RefitMode.INTERRUPT if interrupt else RefitMode.DRAIN), pause
    return refit, (PauseMode.ABORT if refit is RefitMode.INTERRUPT else drain_pause)


class StateError(RuntimeError):
    """A step the transaction's table does not allow (a bug in its driver, never a client's doing)."""


def mark_of_update(before: Mark, answer: WorkerAnswer) -> Mark:
    """An engine's mark after its answer to one update call."""
    if answer.ok:
        return Mark.TAKING
    if not answer.reached:
        return Mark.GONE
    if left_untouched(answer.message):
        return Mark.REFUSED if before is Mark.UNTOUCHED else Mark.PARTIAL
    return Mark.PARTIAL


def mark_of_load(answer: WorkerAnswer) -> Mark:
    """An engine's mark after its answer to a load from disk (SGLang keeps the old weights when a
    load fails; the sim reads the whole file before it touches the model)."""
    if answer.ok:
        return Mark.LOADED
    return Mark.REFUSED if answer.reached else Mark.GONE


@dataclass(frozen=True)
class Closing:
    """What the end of a transaction does to labels and rotation (``FleetTxn.closing``)."""

    reasons: dict[str, str]
    """URL -> why it leaves rotation (it may hold part of the update)."""
    restore: list[Worker]
    """Engines it never changed: they keep their weights and get their prior labels back."""
    labels: list[tuple[str, list[Worker]]]
    """Each label to set, on which engines (the partial label, then each prior version)."""


@dataclass
class FleetTxn:
    """One fleet transaction: its state, its engines and what it did to each. Changed only
    through its methods (``move``, ``mark``, ``begun``, ``released``...)."""

    id: str
    opener: Opener
    pause: PauseMode
    """The mode the engines were paused in."""
    engines: tuple[Worker, ...]
    """Every engine it paused (continued at its end)."""
    driver: Driver = Driver.FRAMEWORK
    state: TxnState = TxnState.HELD
    moved: Moved = Moved.NOTHING
    marks: dict[str, Mark] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    """URL -> what went wrong there (engines whose mark is not UNTOUCHED, TAKING or LOADED)."""
    prior: dict[str, str | None] = field(default_factory=dict)
    """URL -> the version label an engine had before the transaction relabelled it."""
    groups: dict[str, FleetGroup] = field(default_factory=dict)
    """The groups whose updates it forwarded (one per pipeline stage for some frameworks)."""
    sessions: dict[str, Member] = field(default_factory=dict)
    """Engines in an SGLang weight-update session (0.5.21+) it opened, by URL."""
    names: list[str] = field(default_factory=list)
    """Tensors updated from distributed, in order (verified at the end)."""
    sending: set[str] = field(default_factory=set)
    """URLs an update call is in flight to: each may be receiving into its model until it answers."""
    released: dict[str, frozenset[str]] = field(default_factory=dict)
    """URL -> memory tags released on that engine and not resumed yet."""
    version: str | None = None
    source: str | None = None
    failure: str | None = None
    """Why it failed (it ends at once when a call fails, unless its driver may redo it)."""
    phases: dict[str, float] = field(default_factory=dict)
    refit: RefitMode = RefitMode.DRAIN
    """How the hold treated requests in flight (drained, or interrupted and continued after)."""
    call_secs: float | None = None
    """The limit on each engine's answer to an update call (None: the router's request timeout)."""
    lease_secs: float | None = None
    """How long it may go without a call from its driver (None: the router's framework lease)."""
    phase_of: dict[str, str] = field(default_factory=dict)
    """URL -> the step in which it went wrong there (``transfer``, ``end``, ``verify``, ``version``)."""
    opened_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        for worker in self.engines:
            self.marks.setdefault(worker.url, Mark.UNTOUCHED)

    @property
    def implicit(self) -> bool:
        """Opened by the router for a call, not by the framework's pause."""
        return self.opener is not Opener.PAUSE

    @property
    def ended(self) -> bool:
        """Whether the transaction has ended (``TxnState.ENDED``)."""
        return self.state is TxnState.ENDED

    def adopt(self, pause: PauseMode) -> None:
        """The driver paused (again): the engines are in ``pause`` now, and the driver's continue
        ends the transaction, whoever opened it."""
        self.pause = pause
        self.opener = Opener.PAUSE

    def move(self, to: TxnState, moved: Moved | None = None) -> None:
        """Step to ``to`` (with what moves the weights, on the first step to MOVING)."""
        if to not in _NEXT[self.state]:
            raise StateError(f"transaction {self.id}: {self.state} -> {to} is not a step it can take")
        if moved is not None:
            if self.moved not in (Moved.NOTHING, moved):
                raise StateError(f"transaction {self.id}: weights already moved {self.moved}, not {moved}")
            self.moved = moved
        self.state = to

    @property
    def redoable(self) -> bool:
        """A failed update call leaves it open for its driver to redo or abort (a push), rather
        than ending it at once (a framework may never come back: AReaL raises without a continue)."""
        return self.opener is Opener.PUSH

    def mark(self, url: str, mark: Mark, why: str | None = None, step: str = "transfer") -> None:
        """Set engine ``url``'s mark; the first ``why`` given for it is kept, with the ``step`` it went wrong in. Raises
        StateError for a step its mark cannot take."""
        before = self.marks.get(url, Mark.UNTOUCHED)
        if mark not in _MARK_NEXT[before]:
            raise StateError(f"transaction {self.id}: engine {url} {before} -> {mark} is not a step it can take")
        self.marks[url] = mark
        if why is not None and url not in self.why:
            self.why[url] = why
            self.phase_of[url] = step

    def redo(self, survivors: frozenset[str]) -> None:
        """Its driver sends the update again from its first tensor to ``survivors`` only, within
        the same hold: their failures are forgotten and an engine that took part of it counts as
        taking it (whole only if it takes every call again); every other engine keeps its mark,
        an engine still taking leaves as partial. The first attempt's groups and names go."""
        if self.state is not TxnState.MOVING or self.moved is not Moved.DISTRIBUTED:
            raise StateError(f"transaction {self.id}: nothing to redo ({self.state}, moved {self.moved})")
        for url, mark in list(self.marks.items()):
            if url in survivors:
                self.why.pop(url, None)
                self.phase_of.pop(url, None)
                self.marks[url] = Mark.TAKING if mark.changed else Mark.UNTOUCHED
            elif mark is Mark.TAKING:
                self.mark(url, Mark.PARTIAL, "left out of the redo of the update")
        self.names.clear()
        self.groups.clear()

    def may_have_changed(self, url: str) -> bool:
        """Whether ``url``'s weights may differ from what it held before the transaction: its mark
        says so, or a call to it is still in flight (it never answered: a router that gave up on it)."""
        return self.marks.get(url, Mark.UNTOUCHED).changed or url in self.sending

    def changed(self) -> list[str]:
        """Engines whose weights may differ from what they held before the transaction."""
        return [url for url in self.marks if self.may_have_changed(url)]

    def unchanged(self) -> list[str]:
        """Engines whose weights are as they were before the transaction (the complement of ``changed``)."""
        return [url for url in self.marks if not self.may_have_changed(url)]

    def engines_marked(self, *marks: Mark) -> list[Worker]:
        """The transaction's engines whose mark is one of ``marks``, in the transaction's order."""
        return [w for w in self.engines if self.marks.get(w.url) in marks]

    def memory(self, url: str, released: frozenset[str]) -> None:
        """What memory ``url`` has released now (an empty set: all of it back)."""
        if released:
            self.released[url] = released
        else:
            self.released.pop(url, None)

    def outcome(self) -> dict[str, Any]:
        """What it did, once ended, for its driver (by engine URL): ``complete`` (hold its
        version, in rotation), ``refused`` (kept their weights, in rotation), ``failed`` (out of
        rotation until a whole update; ``steps`` says in which step each went wrong), its
        version, phases and id."""
        refused = {u: self.why[u] for u, m in self.marks.items() if m is Mark.REFUSED and u in self.why}
        whole = (Mark.TAKING, Mark.LOADED)
        complete = (
            []
            if self.failure
            else [w.url for w in self.engines if self.marks.get(w.url) in whole and w.url not in self.why]
        )
        failed = {u: why for u, why in self.why.items() if u not in refused}
        failed.update(
            {u: f"holds part of it ({self.failure})" for u in self.changed() if u not in failed and u not in complete}
        )
        return {
            "version": self.version, "complete": complete, "refused": refused, "failed": failed,
            "steps": {u: self.phase_of.get(u, "transfer") for u in failed}, "phases": dict(self.phases), "txn": self.id,
        }  # fmt: skip

    def closing(self, done: set[str]) -> Closing:
        """How it ends, ``done`` being the engines that hold its version: engines it may have
        changed and that are not done leave rotation labelled partial, the ones it never changed
        get their prior labels back."""
        broken = [w for w in self.engines if self.may_have_changed(w.url) and w.url not in done]
        restore = [w for w in self.engines if not self.may_have_changed(w.url) and w.url in self.prior]
        name = self.version or self.id
        reasons = {
            w.url: f"weight update {name} failed: {self.why[w.url]}"
            if w.url in self.why
            else f"holds part of weight update {name}, which did not finish ({self.failure or 'its end failed'})"
            for w in broken
        }
        labels: list[tuple[str, list[Worker]]] = [(PARTIAL_LABEL + self.id, broken)] if broken else []
        prior = sorted(restore, key=lambda w: str(self.prior[w.url]))
        for version, group in itertools.groupby(prior, key=lambda w: self.prior[w.url]):
            if version is not None:
                labels.append((version, list(group)))
        return Closing(reasons, restore, labels)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the time spent in the ``with`` block to ``phase`` (also when it raises)."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.monotonic() - started

    def record(self) -> dict[str, object]:
        """What a router that restarts must undo of it (pdctl.router.state_file): the engines it
        paused, their open update sessions and released memory."""
        return {
            "txn": self.id,
            "opener": self.opener.name,
            "engines": [w.url for w in self.engines],
            "sessions": sorted(self.sessions),
            "released": {url: sorted(tags) for url, tags in self.released.items()},
            "moved": self.moved.value,
        }
