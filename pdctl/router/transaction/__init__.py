"""The fleet transaction the router runs for every driver that updates weights through it (a
trainer's push, RL frameworks through SGLang's control routes, ``pdctl weights load``): its
explicit states (state.py), the weight groups the fleet joined (groups.py), the one
implementation of hold, pause, move, verify, version, continue and release (runner.py), its one
verification rule (verify.py), what it opens on the engines (on_engines.py: memory released,
update sessions), who holds the fleet (holder.py), what a killed router left (recovery.py), and
the routes of pdctl's own drivers (routes.py)."""

from pdctl.router.transaction.runner import FleetTransactions, UpdateFailed, new_version
from pdctl.router.transaction.state import FleetTxn, Mark, Moved, Opener, TxnState

__all__ = ["FleetTransactions", "FleetTxn", "Mark", "Moved", "Opener", "TxnState", "UpdateFailed", "new_version"]
