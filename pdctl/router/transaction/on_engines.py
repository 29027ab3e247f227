"""What a fleet transaction opens on its engines and must close before it ends (its record in the
router's state file lists both, for a router that restarts: pdctl.router.transaction.recovery):

- memory released (SGLang's ``/release_memory_occupation``), given back at the end: an engine
  cannot serve without it, and SGLang ends an engine's process on a second release or on a resume
  of a tag it did not release, so both are refused here before anything is sent;
- SGLang 0.5.21+'s weight-update sessions, which frameworks written for older SGLang never open.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from pdctl.router.fanout import WorkerAnswer
from pdctl.router.transaction.groups import FleetGroup, label
from pdctl.router.transaction.state import FleetTxn
from pdctl.router.updates import WeightUpdates
from pdctl.router.workers import Worker
from pdctl.sglang import Endpoint, supports_weight_update_session
from pdctl.sglang import control as sg

log = logging.getLogger("pdctl.router.transaction")

CallAll = Callable[[Iterable[Worker], Endpoint, Any], Awaitable[list[WorkerAnswer]]]


class OnEngines:
    """Memory and update sessions of a transaction on its engines; ``keep`` writes the
    transaction's record (what a restarted router must close) after each change; ``updates``
    keeps the push record, which names the group the first session was opened for."""

    def __init__(self, call_all: CallAll, keep: Callable[[], None], updates: WeightUpdates):
        self._call_all = call_all
        self._keep = keep
        self.updates = updates

    async def release_memory(self, txn: FleetTxn, tags: list[str] | None) -> list[WorkerAnswer]:
        """``/release_memory_occupation`` on every engine of ``txn`` (paused: SGLang releases only
        an idle engine). Raises ValueError, sending nothing, for a tag an engine has released
        already (SGLang's memory saver ends the engine's process on a second release)."""
        wanted = frozenset(tags or sg.MEMORY_TAGS)
        twice = {
            label(w): sorted(txn.released[w.url] & wanted)
            for w in txn.engines
            if txn.released.get(w.url, frozenset()) & wanted
        }
        if twice:
            raise ValueError(f"already released: {twice}; resume_memory_occupation first")
        answers = await self._call_all(txn.engines, Endpoint.RELEASE_MEMORY_OCCUPATION, {"tags": tags})
        for a in answers:
            if a.status == 200:
                txn.memory(a.worker.url, txn.released.get(a.worker.url, frozenset()) | wanted)
        self._keep()
        return answers

    async def resume_memory(self, txn: FleetTxn, tags: list[str] | None) -> list[WorkerAnswer]:
        """``/resume_memory_occupation`` on the engines that released ``tags``. Raises ValueError,
        sending nothing, when none did (SGLang's scheduler ends the engine on a resume of a tag
        it did not release)."""
        wanted = frozenset(tags) if tags else None
        due = [w for w in txn.engines if txn.released.get(w.url) and (wanted is None or wanted <= txn.released[w.url])]
        if not due:
            held = {label(w): sorted(txn.released[w.url]) for w in txn.engines if w.url in txn.released}
            asked = sorted(wanted) if wanted else "no tag"
            raise ValueError(f"nothing to resume: {asked} is not released (released: {held or 'none'})")
        answers = await self._call_all(due, Endpoint.RESUME_MEMORY_OCCUPATION, {"tags": tags})
        for a in answers:
            if a.status == 200:
                txn.memory(a.worker.url, frozenset() if wanted is None else txn.released[a.worker.url] - wanted)
        self._keep()
        return answers

    async def give_back_memory(self, txn: FleetTxn) -> None:
        """Give back whatever memory ``txn`` still holds released (an engine cannot serve without it)."""
        for url, tags in list(txn.released.items()):
            worker = next((w for w in txn.engines if w.url == url), None)
            if worker is None:
                continue
            (a,) = await self._call_all([worker], Endpoint.RESUME_MEMORY_OCCUPATION, {"tags": sorted(tags)})
            if a.status == 200:
                txn.memory(url, frozenset())
            else:
                log.warning("transaction %s: resume_memory_occupation %s %s", txn.id, label(worker), a.why())

    async def begin_sessions(self, txn: FleetTxn, group: FleetGroup) -> None:
        """SGLang 0.5.21+ takes distributed updates only inside a weight-update session, which
        frameworks written for older SGLang never open: opened here for them."""
        last = self.updates.last
        if last is not None and last.txn == txn.id and last.group is None:
            self.updates.describe_group(txn.id, group.to_json())
        due = [
            m for m in group.members if m.url not in txn.sessions and supports_weight_update_session(m.sglang_version)
        ]
        if not due:
            return
        with txn.timed("begin"):
            answers = await self._call_all((m.worker for m in due), Endpoint.BEGIN_WEIGHT_UPDATE, {"selector": "all"})
        for m, a in zip(due, answers, strict=True):
            if a.ok:
                txn.sessions[m.url] = m
            else:  # its next update is refused before its receive (no session): the failure says so
                log.warning("transaction %s: begin_weight_update %s %s", txn.id, label(m.worker), a.why())
        self._keep()

    async def end_sessions(self, txn: FleetTxn) -> list[WorkerAnswer]:
        """Every session ``txn`` opened ends (their answers, for the caller to judge)."""
        if not txn.sessions:
            return []
        answers = await self._call_all((m.worker for m in txn.sessions.values()), Endpoint.END_WEIGHT_UPDATE, {})
        txn.sessions.clear()
        return answers
