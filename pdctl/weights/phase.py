"""The steps of a weight transaction and what failing in one of them means. No torch here.

A push runs ``probe hold pause begin transfer end version verify continue release`` (a load from
disk: ``probe hold pause transfer version continue release``, its transfer being the load); a
trainer's ``connect`` builds the group. Every failure is recorded as a ``Failure`` (which engine,
in which phase, why), never as a string to be parsed back.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdctl.choices import Choice


class Phase(Choice):
    """The steps of a weight transaction, as failures and a report's timings name them."""

    CONNECT = "connect"
    PROBE = "probe"
    HOLD = "hold"
    PAUSE = "pause"
    BEGIN = "begin"
    TRANSFER = "transfer"
    END = "end"
    VERSION = "version"
    VERIFY = "verify"
    CONTINUE = "continue"
    RELEASE = "release"


@dataclass(frozen=True)
class Failure:
    """``engine`` did not get the version (or, in ``PushReport.refused``, refused it) in ``phase``.
    ``retry``: it failed while the push was redone on the engines that survived a first failure."""

    engine: str
    phase: Phase
    reason: str
    retry: bool = False

    def __str__(self) -> str:
        return f"{'retry ' if self.retry else ''}{self.phase.value}: {self.reason}"


class EngineFault(Exception):
    """Inside a transaction: these engines failed in this phase (id -> reason)."""

    def __init__(self, phase: Phase, culprits: dict[str, str]):
        super().__init__(f"{phase.value}: {culprits}")
        self.phase = phase
        self.culprits = culprits

    def failures(self, *, retry: bool = False) -> dict[str, Failure]:
        """One Failure per culprit, in this phase; ``retry`` marks them as failures of a redone push."""
        return {engine: Failure(engine, self.phase, reason, retry) for engine, reason in self.culprits.items()}
