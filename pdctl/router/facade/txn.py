"""A weight update as an RL framework drives it through SGLang's control routes: what it has done
so far, for the facade to finish as the fleet transaction a ``pdctl.weights`` push is.

A framework's transaction opens with its ``/pause_generation`` (``paused``), or with an update
sent with no pause first (an *implicit* transaction: the router holds and pauses the fleet itself,
as a push does); it ends with ``/continue_generation``, an implicit one also with the framework's
next call of another kind (``/flush_cache``, ``/get_weight_version``, ...), and either ends when
nothing comes for ``--max-hold-secs``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdctl.choices import Choice
from pdctl.router.facade.groups import FleetGroup, Member
from pdctl.router.workers import Worker
from pdctl.sglang import PauseMode


class Moved(Choice):
    """What moved the weights in a transaction (at most one kind per transaction)."""

    NOTHING = "nothing"
    DISTRIBUTED = "distributed"
    DISK = "disk"


@dataclass
class FrameworkTxn:
    txn: str
    paused: PauseMode | None
    """The framework's pause mode; None for an implicit transaction (opened by an update)."""
    engines: tuple[Worker, ...]
    """Every engine the transaction paused (continued at its end)."""
    moved: Moved = Moved.NOTHING
    groups: dict[str, FleetGroup] = field(default_factory=dict)
    """The groups whose updates it forwarded (a framework with one group per pipeline stage uses several)."""
    begun: dict[str, Member] = field(default_factory=dict)
    """Engines in an SGLang weight-update session (0.5.21+), by URL: ended before the version is set."""
    took: dict[str, int] = field(default_factory=dict)
    """URL -> update calls each engine answered with success (weights moved on it)."""
    names: list[str] = field(default_factory=list)
    """Tensors updated from distributed, in order (verified at the end)."""
    failed: dict[str, str] = field(default_factory=dict)
    """URL -> why: engines that did not take every update (out of rotation at the end)."""
    refused: dict[str, str] = field(default_factory=dict)
    """URL -> why: engines that refused a load from disk (they keep their weights and stay in rotation)."""
    loaded: tuple[str, ...] = ()
    """URLs of the engines that loaded from disk."""
    version: str | None = None
    source: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    calls: int = 0
    broke: str | None = None
    """Why the framework's update could not be whole anywhere (a call failed, so it stops): every
    engine that took part of it is out of rotation at the end."""
    started: float = field(default_factory=time.monotonic)

    @property
    def implicit(self) -> bool:
        return self.paused is None

    def members(self) -> dict[str, Member]:
        """Every engine of the groups it updated, by URL."""
        return {m.url: m for g in self.groups.values() for m in g.members}

    def timed(self, phase: str, secs: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + secs
