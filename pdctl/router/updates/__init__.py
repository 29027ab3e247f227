"""Weight updates as the router lives them: one owner (``WeightUpdates``, owner.py) of a
transaction's life, from its hold to its release or lapse, with the push record that ``pdctl
weights status`` reads; and the operator's bare hold (holds.py: ``POST /pdctl/hold`` and
``/pdctl/release``).

The request path's part lies beside the request path, below this: the gate requests wait at while
an update holds the router (pdctl.router.gate), and how a request an update interrupted goes on
(pdctl.router.resume: what can be continued; pdctl.router.continuation: the continuation itself).
Every driver of an update (a ``pdctl.weights`` push, ``pdctl weights load``, an RL framework
through SGLang's own control routes) runs through pdctl.router.transaction, over this owner.
"""

from pdctl.router.updates.owner import Conflict, Driver, PushRecord, PushState, WeightUpdates

__all__ = ["Conflict", "Driver", "PushRecord", "PushState", "WeightUpdates"]
