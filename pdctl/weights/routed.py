"""A push the router runs as its fleet transaction: the trainer's side of it. No torch here.

With a router, a push is one of the router's fleet transactions (pdctl.router.transaction), the
same as an RL framework's update through SGLang's routes and ``pdctl weights load``: the router
holds and pauses the fleet, forwards each bucket's update call to every engine of the group,
verifies against the trainer's checksums, stamps the version, continues and releases. This side
opens it (``/pdctl/push/open``), renews its lease between calls, sends the bucket calls to the
router with ``X-Pdctl-Txn``, and commits or aborts it. A trainer that dies stops renewing: the
router ends the push as failed (engines it changed out of rotation, the others serve on).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pdctl.errors import WeightSyncError
from pdctl.refit import (
    PUSH_ABORT_PATH,
    PUSH_COMMIT_PATH,
    PUSH_OPEN_PATH,
    PUSH_REDO_PATH,
    PUSH_RENEW_PATH,
    TXN_HEADER,
    RefitMode,
    VerifyMode,
)
from pdctl.weights.client import CallFailure
from pdctl.weights.fleet import Fleet
from pdctl.weights.phase import Phase
from pdctl.weights.report import PushReport

log = logging.getLogger("pdctl.weights")

COMMIT_SECS = 600.0
"""The least a commit's answer is awaited (it runs to its end at the router either way)."""
ROUTER_STEPS = ("pause", "begin", "end", "verify", "version", "continue")
"""The router's own phases that a push's report takes as they are (the router timed them)."""


class RouterPush:
    """One push run by the router (module docstring); ``open``, then the bucket calls, then
    ``commit`` or ``abort``; ``close`` always."""

    def __init__(self, fleet: Fleet, report: PushReport, refit: RefitMode):
        assert fleet.router_url is not None
        self.fleet = fleet
        self.report = report
        self.refit = refit
        self.router = fleet.router_url
        self.txn: str | None = None
        self.ended = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        parts = urlsplit(self.router)
        self._origin = f"{parts.scheme}://{parts.netloc}"

    def open(self) -> None:
        """Hold and pause the fleet (in ``drain`` mode once the requests in flight are done);
        WeightSyncError (phase ``hold``) when the router does not, having changed nothing."""
        fleet = self.fleet
        draining = ": draining the requests in flight" if self.refit is RefitMode.DRAIN else ""
        fleet.tell(f"holding the router at {self.router}{draining}")
        body = {
            "version": self.report.version,
            "refit": self.refit.value,
            "max_staleness": fleet.max_staleness,
            "lease_secs": fleet.lease_secs,
            "timeout_secs": fleet.hold_timeout_secs,
            "call_secs": fleet.timeout_secs,
            "pause_mode": fleet.pause_mode.value,
        }
        started = time.perf_counter()
        answer = fleet.client.post(self.router + PUSH_OPEN_PATH, body, timeout_secs=fleet.hold_timeout_secs + 10)
        if isinstance(answer, CallFailure) or not isinstance(answer, dict) or not answer.get("txn"):
            what = "drain" if self.refit is RefitMode.DRAIN else "hold"
            raise WeightSyncError(
                f"the router at {self.router} did not {what} for the push: {answer}", phase=Phase.HOLD
            )
        self.txn = str(answer["txn"])
        self.report.phases[Phase.HOLD.value] = time.perf_counter() - started
        fleet.client.extra[self._origin] = {TXN_HEADER: self.txn}
        fleet.holding = self.txn
        self._renewer = threading.Thread(target=self._renew, name="pdctl-weights-lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.fleet.lease_secs / 3):
            result = self.fleet.client.post(self.router + PUSH_RENEW_PATH, {"txn": self.txn}, timeout_secs=10)
            if isinstance(result, CallFailure) and result.status == 409:  # it ended: the next call says why
                if not self._stop.is_set():
                    log.error("weights: push %s is no longer open at the router: %s", self.txn, result)
                return
            if isinstance(result, CallFailure):
                log.warning("weights: could not renew the push's lease at the router: %s", result)

    def redo(self, urls: list[str]) -> None:
        """The update starts again on ``urls`` only (their group is built again next)."""
        result = self.fleet.client.post(self.router + PUSH_REDO_PATH, {"txn": self.txn, "engines": urls})
        if isinstance(result, CallFailure):
            raise WeightSyncError(f"the router did not redo the push: {result}", phase=Phase.TRANSFER)

    def commit(self, checksums: Mapping[str, str], verify: VerifyMode) -> None:
        """End, verify, version, continue and release; the outcome goes into the report."""
        body = {"txn": self.txn, "version": self.report.version, "checksums": dict(checksums) or None,
                "verify": verify.value}  # fmt: skip
        started = time.perf_counter()
        # The router verifies, versions, continues and reads every worker's health: give it time.
        limit = max(self.fleet.timeout_secs, COMMIT_SECS)
        outcome = self.fleet.client.post(self.router + PUSH_COMMIT_PATH, body, timeout_secs=limit)
        self.ended = True
        if isinstance(outcome, CallFailure) or not isinstance(outcome, dict):
            raise WeightSyncError(
                f"the router did not end the push: {outcome}; `pdctl weights status` says where the fleet is",
                phase=Phase.RELEASE,
            )
        self._take(outcome, time.perf_counter() - started)

    def abort(self, why: str) -> None:
        """The push stopped here (an error, a Ctrl-C): the router ends it as failed; best effort
        (a router that does not answer ends it when the lease runs out)."""
        if self.txn is None or self.ended:
            return
        self.ended = True
        outcome = self.fleet.client.post(self.router + PUSH_ABORT_PATH, {"txn": self.txn, "why": why}, timeout_secs=60)
        if isinstance(outcome, CallFailure) or not isinstance(outcome, dict):
            log.warning("weights: the router did not abort push %s: %s (its lease ends it)", self.txn, outcome)
            return
        self._take(outcome, 0.0)

    def close(self) -> None:
        """Stop renewing the lease and stop naming the push on calls to the router. Does not end the push
        at the router: ``commit`` or ``abort`` does."""
        self._stop.set()
        self.fleet.client.extra.pop(self._origin, None)
        self.fleet.holding = None

    def _take(self, outcome: Mapping[str, Any], secs: float) -> None:
        report = self.report
        self.fleet.take_outcome(report, outcome, retry=report.retried)
        router = {k: float(v) for k, v in (outcome.get("phases") or {}).items()}
        for step in ROUTER_STEPS:
            if step in router:
                report.phases[step] = report.phases.get(step, 0.0) + router[step]
        # The hold and release calls' own time, less the router's steps they include.
        hold = report.phases.get(Phase.HOLD.value, 0.0)
        report.phases[Phase.HOLD.value] = max(0.0, hold - router.get("pause", 0.0))
        inside = sum(router.get(step, 0.0) for step in ("end", "verify", "version", "continue"))
        report.phases[Phase.RELEASE.value] = report.phases.get(Phase.RELEASE.value, 0.0) + max(0.0, secs - inside)

    def blame(self, failure: CallFailure) -> dict[str, str]:
        """Engine id -> what went wrong there, from the router's failed answer (see ``Fleet.blame``)."""
        return self.fleet.blame(failure)
