"""The fleet's current weight version, as the router last released it, and where it came from.

The router is the one place that sees every weight update end (``/pdctl/release``), so it keeps
the rule for engines that come back (a restart by their node's supervisor, pdctl.node.supervise): an
engine enters rotation only when it holds this version. When the version was loaded from disk
(``source``: the checkpoint path, read on each engine's node) the router loads it into the engine
itself; when a trainer pushed it, the engine waits out of rotation for the next push.

Kept in the router's state file (pdctl.router.state_file), so that a restarted router keeps the
rule too.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdctl.node.peer_weights import PENDING
from pdctl.refit import PARTIAL_LABEL, UPDATING_LABEL

STALE = "stale weights"
"""How a quarantine reason of this rule begins (other reasons, a push's failures, are not ours)."""


@dataclass(frozen=True)
class FleetWeights:
    """The fleet's weight version, and the checkpoint it was loaded from (None: pushed). Frozen; kept in the router's
    state file."""

    version: str
    source: str | None = None
    """The checkpoint path of a load from disk; None for a trainer's push."""

    def stale_reason(self, held: str | None, *, updating: bool = False) -> str:
        """The quarantine reason (beginning with ``STALE``) of an engine that holds ``held`` rather than the fleet's
        version, saying what brings it back: the update under way (``updating``), its supervisor's load, a load from
        disk or the next push."""
        if updating:
            then = "until the weight update under way ends"
        elif held == PENDING:
            then = "its supervisor is loading the fleet's weights into it from a peer engine"
        else:
            then = f"loading {self.source}" if self.source else "until the next weight push reaches it"
        return f"{STALE}: it holds {_named(held)}, the fleet is at {self.version!r}; {then}"

    @staticmethod
    def flux_reason(held: str | None) -> str:
        """Why an engine whose label says its weights move or are half done is out, when the fleet
        has no version yet (no update completed since the router's state began)."""
        return f"{STALE}: it holds {_named(held)}; until a whole weight update reaches it"


def _named(held: str | None) -> str:
    if isinstance(held, str) and held.startswith(UPDATING_LABEL):
        return f"part of weight update {held.removeprefix(UPDATING_LABEL)}, which did not finish ({held!r})"
    if isinstance(held, str) and held.startswith(PARTIAL_LABEL):
        return f"part of weight update {held.removeprefix(PARTIAL_LABEL)}, which failed ({held!r})"
    return repr(held)
