"""The fleet's current weight version, as the router last released it, and where it came from.

The router is the one place that sees every weight update end (``/pdctl/release``), so it keeps
the rule for engines that come back (a restart by their node's supervisor, pdctl.supervise): an
engine enters rotation only when it holds this version. When the version was loaded from disk
(``source``: the checkpoint path, read on each engine's node) the router loads it into the engine
itself; when a trainer pushed it, the engine waits out of rotation for the next push.

Kept in a file (0600, replaced atomically) when the router is given one, so that a restarted
router keeps the rule too.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("pdctl.router")
STALE = "stale weights"
"""How a quarantine reason of this rule begins (other reasons, a push's failures, are not ours)."""


@dataclass(frozen=True)
class FleetWeights:
    version: str
    source: str | None = None
    """The checkpoint path of a load from disk; None for a trainer's push."""

    def stale_reason(self, held: str | None) -> str:
        then = f"loading {self.source}" if self.source else "until the next weight push reaches it"
        return f"{STALE}: it holds {held!r}, the fleet is at {self.version!r}; {then}"

    @classmethod
    def read(cls, path: str | None) -> FleetWeights | None:
        if not path:
            return None
        try:
            raw = json.loads(Path(path).read_text())
            return cls(str(raw["version"]), None if raw.get("source") is None else str(raw["source"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the fleet's weight version in %s: %s", path, exc)
            return None

    def write(self, path: str | None) -> None:
        if not path:
            return
        tmp = f"{path}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump({"version": self.version, "source": self.source}, out)
            os.replace(tmp, path)
        except OSError as exc:  # the rule still holds in memory
            log.warning("could not keep the fleet's weight version in %s: %s", path, exc)
