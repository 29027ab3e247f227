"""Weight updates as the router lives them: one owner (``WeightUpdates``) of a transaction's life,
from its hold to its release or lapse, with the push record that ``pdctl weights status`` reads.

Two kinds of caller drive it, through thin adapters: a ``pdctl.weights`` transaction over
``POST /pdctl/hold`` and ``/pdctl/release`` (pdctl.router.app), and an RL framework through
SGLang's own control routes (pdctl.router.facade).
"""

from pdctl.router.refit.updates import Conflict, Driver, PushRecord, PushState, WeightUpdates

__all__ = ["Conflict", "Driver", "PushRecord", "PushState", "WeightUpdates"]
