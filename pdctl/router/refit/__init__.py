"""Weight updates as the router lives them: one owner (``WeightUpdates``, updates.py) of a
transaction's life, from its hold to its release or lapse, with the push record that ``pdctl
weights status`` reads; the gate requests wait at while one holds the router (gate.py); and how
a request interrupted by one goes on (resume.py: what can be continued, and the continuation's
body and spans).

Two kinds of caller drive it, through thin adapters: a ``pdctl.weights`` transaction over
``POST /pdctl/hold`` and ``/pdctl/release`` (pdctl.router.app), and an RL framework through
SGLang's own control routes (pdctl.router.facade).
"""

from pdctl.router.refit.updates import Conflict, Driver, PushRecord, PushState, WeightUpdates

__all__ = ["Conflict", "Driver", "PushRecord", "PushState", "WeightUpdates"]
