"""What a day-2 step on a running cluster (``apply``, ``switch``) works with, held in one place."""

from __future__ import annotations

from dataclasses import dataclass

from pdctl.cluster.journal import Journal
from pdctl.cluster.nodes import Events, NodeSet
from pdctl.cluster.router_control import RouterControl
from pdctl.cluster.state import ClusterState, StateStore


@dataclass(frozen=True)
class StepContext:
    """A running cluster's state and store, its nodes, its router, the journal that records the step,
    where events go, and how long an engine may take to come back. The state it names is the one the
    step changes (and saves through ``store``)."""

    state: ClusterState
    store: StateStore
    nodes: NodeSet
    router: RouterControl
    journal: Journal
    events: Events
    ready_timeout: float
