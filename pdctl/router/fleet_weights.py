"""The fleet's current weight version, as the router last released it, and where it came from.

The router is the one place that sees every weight update end (``/pdctl/release``), so it keeps
the rule for engines that come back (a restart by their node's supervisor, pdctl.supervise): an
engine enters rotation only when it holds this version. When the version was loaded from disk
(``source``: the checkpoint path, read on each engine's node) the router loads it into the engine
itself; when a trainer pushed it, the engine waits out of rotation for the next push.

Kept in the router's state file (pdctl.router.state_file), so that a restarted router keeps the
rule too.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdctl.peer_weights import PENDING

STALE = "stale weights"
"""How a quarantine reason of this rule begins (other reasons, a push's failures, are not ours)."""


@dataclass(frozen=True)
class FleetWeights:
    version: str
    source: str | None = None
    """The checkpoint path of a load from disk; None for a trainer's push."""

    def stale_reason(self, held: str | None, *, updating: bool = False) -> str:
        if updating:
            then = "until the weight update under way ends"
        elif held == PENDING:
            then = "its supervisor is loading the fleet's weights into it from a peer engine"
        else:
            then = f"loading {self.source}" if self.source else "until the next weight push reaches it"
        return f"{STALE}: it holds {held!r}, the fleet is at {self.version!r}; {then}"
