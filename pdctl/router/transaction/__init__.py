"""The fleet transaction the router runs for drivers that update weights through it (RL
frameworks through SGLang's control routes, ``pdctl weights load``): its explicit states
(state.py), the weight groups the fleet joined (groups.py) and the one implementation of hold,
pause, move, verify, version, continue and release (runner.py)."""

from pdctl.router.transaction.runner import FleetTransactions, UpdateFailed, new_version
from pdctl.router.transaction.state import FleetTxn, Mark, Moved, Opener, TxnState

__all__ = ["FleetTransactions", "FleetTxn", "Mark", "Moved", "Opener", "TxnState", "UpdateFailed", "new_version"]
