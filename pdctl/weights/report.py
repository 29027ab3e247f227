"""What a push did: bytes, buckets, collective calls, seconds per phase, and who got it."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from pdctl.weights.phase import Failure, Phase

log = logging.getLogger("pdctl.weights")


@dataclass
class PushReport:
    """Filled in by ``WeightSync.push``.

    ``engines``: ids that hold ``version`` completely (checked by ``verify`` unless it is off);
    ``failed``: id -> Failure for engines left without it (out of the router's rotation);
    ``skipped``: ids that did not answer before the push began (also out of rotation);
    ``refused``: id -> Failure for engines that refused a load from disk and kept their previous
    weights and version (SGLang rolls back; they stay in rotation, on the old version);
    ``phases``: seconds per phase name (a retry on the surviving engines adds to the same phases);
    ``pushed``: False on trainer ranks other than 0, which send nothing.
    """

    version: str
    pushed: bool = True
    engines: list[str] = field(default_factory=list)
    failed: dict[str, Failure] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    refused: dict[str, Failure] = field(default_factory=dict)
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    collectives: int = 0
    http_calls: int = 0
    load_format: str = "names"
    verify: str = "off"
    refit: str = "drain"
    """How requests in flight were treated (pdctl.refit): waited for, or interrupted and continued."""
    retried: bool = False
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        """Seconds over every phase."""
        return sum(self.phases.values())

    @property
    def overhead_seconds(self) -> float:
        """Everything but the transfer itself."""
        return self.seconds - self.phases.get(Phase.TRANSFER.value, 0.0)

    @property
    def transfer_gbps(self) -> float:
        """Bytes moved per second of the transfer phase, in GB/s (10^9)."""
        secs = self.phases.get(Phase.TRANSFER.value, 0.0)
        return self.bytes / secs / 1e9 if secs else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: failures as strings, plus ``seconds``, ``overhead_seconds`` and ``transfer_gbps``."""
        return {
            **asdict(self),
            "failed": {engine: str(f) for engine, f in self.failed.items()},
            "refused": {engine: str(f) for engine, f in self.refused.items()},
            "seconds": self.seconds,
            "overhead_seconds": self.overhead_seconds,
            "transfer_gbps": self.transfer_gbps,
        }

    @contextlib.contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        """Time a phase (added to any earlier time of the same phase) and log it."""
        started = time.perf_counter()
        try:
            yield
        finally:
            secs = time.perf_counter() - started
            self.phases[phase.value] = self.phases.get(phase.value, 0.0) + secs
            log.info("weights %s: %s %.3fs", self.version, phase.value, secs)
