"""Who holds the fleet now, for every surface that says it and every call that must not act
under another driver's transaction."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pdctl.router.transaction.state import FleetTxn, Opener
from pdctl.router.updates import WeightUpdates


class FleetHolder:
    """The hold (``WeightUpdates``) and the router's open transaction (``current``), read together."""

    def __init__(self, updates: WeightUpdates, current: Callable[[], FleetTxn | None]):
        self.updates = updates
        self._current = current

    def state(self) -> dict[str, Any] | None:
        """What holds the router now, if anything (``WeightUpdates.hold_state`` with ``by``, in
        words: whose transaction, and what opened it), for every health surface to say."""
        state = self.updates.hold_state()
        if state is None:
            return None
        txn = self._current()
        if state["ending"]:
            state["by"] = f"the end of weight update {state['txn']} (every worker's health read again)"
        elif txn is not None and txn.id == state["txn"]:
            state["by"] = f"{'memory released by a framework' if txn.released else txn.opener} ({txn.id})"
        elif state["txn"] is not None:
            state["by"] = f"weight push {state['txn']}"
        else:
            state["by"] = "a hold with no transaction"
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state["since"]))
        state["reason"] = f"held by {state['by']} since {since} ({state['secs']:.0f} s)"
        return state

    def foreign(self, caller: str | None = None) -> str | None:
        """Why a call that acts on the fleet is refused: another transaction holds the router and
        its engines (a bare ``/pdctl/hold``, or a push whose driver is not ``caller``, the
        transaction its call names in ``TXN_HEADER``)."""
        holder = self.updates.holder
        txn = self._current()
        if holder is not None and (txn is None or txn.id != holder):
            return f"weight push {holder} holds the router"
        return _not_the_push(txn, caller)

    def pushing(self, caller: str | None) -> str | None:
        """Why a call that changes the fleet's weight groups is refused: another driver's push is
        open (a bare hold, or a framework's pause, leaves groups to whoever calls)."""
        txn = self._current()
        return _not_the_push(txn, caller)


def _not_the_push(txn: FleetTxn | None, caller: str | None) -> str | None:
    """Why ``caller`` may not act: a push it is not the driver of is open, or it names a push
    that is not open (it ended, or lapsed: the trainer's late call must not start a new update)."""
    if txn is not None and txn.opener is Opener.PUSH and caller != txn.id:
        return f"weight push {txn.id} holds the router"
    if caller is not None and (txn is None or txn.id != caller):
        return f"weight push {caller} is not open (it ended)"
    return None
