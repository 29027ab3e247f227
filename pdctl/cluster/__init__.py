"""Cluster lifecycle: up, down, status, logs, and the state file."""

from pdctl.cluster.down import down, stop_processes
from pdctl.cluster.inspect import ClusterStatus, ProcessStatus, logs, status
from pdctl.cluster.nodes import NodeSet
from pdctl.cluster.state import ClusterState, ProcessRecord, StateStore
from pdctl.cluster.up import up

__all__ = [
    "ClusterState",
    "ClusterStatus",
    "NodeSet",
    "ProcessRecord",
    "ProcessStatus",
    "StateStore",
    "down",
    "logs",
    "status",
    "stop_processes",
    "up",
]
