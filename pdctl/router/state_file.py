"""What a router keeps across its own restarts (its node's supervisor restarts it with the command
line it was first given): the fleet's weight version, and its workers as ``pdctl apply`` or the
worker API last left them (the command line's list is then out of date).

Workers' keys are not written: a worker that used the router's engine key is marked so
(``"engine_key": true``) and gets it back from the command line; one given another key through
``POST /workers`` comes back without it (register it again).

One JSON file (0600, replaced atomically), tagged with the run it belongs to (``PDCTL_RUN_ID``,
which ``pdctl up`` gives every process): a file that another run of the cluster left in the same
run directory is ignored, so a fresh ``up`` starts from its own command line.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdctl.roles import engine_role
from pdctl.router.config import WorkerSpec
from pdctl.router.fleet_weights import FleetWeights

log = logging.getLogger("pdctl.router")
RUN_ID_ENV = "PDCTL_RUN_ID"  # pdctl.node.agent's, which the router must not import


@dataclass
class RouterState:
    """What the router keeps across its restarts (module docstring): the fleet's version, its workers and its open
    transaction, tagged with the run."""

    fleet: FleetWeights | None = None
    workers: tuple[WorkerSpec, ...] | None = None
    """None: the command line's workers."""
    transaction: dict[str, Any] | None = None
    """The router's own fleet transaction while one is open (``FleetTxn.record``)."""
    run: str | None = field(default_factory=lambda: os.environ.get(RUN_ID_ENV))

    @classmethod
    def read(cls, path: str | None, engine_key: str | None = None) -> RouterState:
        """The state kept in ``path`` for this run; an empty state when there is no path or file, the file is another
        run's, or it cannot be read or parsed (logged). Workers marked as using the engine key get ``engine_key``."""
        state = cls()
        if not path:
            return state
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            return state
        except (OSError, ValueError) as exc:
            log.warning("ignoring the router's state in %s: %s", path, exc)
            return state
        if not isinstance(raw, dict) or raw.get("run") != state.run:
            return state  # another run's
        try:
            fleet = raw.get("fleet")
            if isinstance(fleet, dict):
                source = fleet.get("source")
                state.fleet = FleetWeights(str(fleet["version"]), None if source is None else str(source))
            transaction = raw.get("transaction")
            if isinstance(transaction, dict):
                state.transaction = transaction
            workers = raw.get("workers")
            if isinstance(workers, list):
                state.workers = tuple(
                    WorkerSpec(
                        url=str(w["url"]),
                        role=engine_role(w["role"]),
                        bootstrap_port=w.get("bootstrap_port"),
                        api_key=engine_key if w.get("engine_key") else None,
                    )
                    for w in workers
                )
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring the router's state in %s: %s", path, exc)
            return cls()
        return state

    def write(self, path: str | None, engine_key: str | None = None) -> None:
        """Replace ``path`` atomically with this state (0600, no keys written); nothing without a path. A failure is
        logged, not raised."""
        if not path:
            return
        body: dict[str, Any] = {"run": self.run}
        if self.fleet is not None:
            body["fleet"] = {"version": self.fleet.version, "source": self.fleet.source}
        if self.transaction is not None:
            body["transaction"] = self.transaction
        if self.workers is not None:
            body["workers"] = [
                {
                    "url": w.url,
                    "role": w.role.value,
                    "bootstrap_port": w.bootstrap_port,
                    "engine_key": bool(engine_key) and w.api_key == engine_key,
                }
                for w in self.workers
            ]
        tmp = f"{path}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump(body, out)
            os.replace(tmp, path)
        except OSError as exc:  # the router goes on; only a restart would forget
            log.warning("could not keep the router's state in %s: %s", path, exc)
