"""Remote execution: one Executor per node (local subprocess or SSH), talking to the node agent."""

from pdctl.remote.base import Executor
from pdctl.remote.local import LocalExecutor
from pdctl.remote.ssh import SSHExecutor
from pdctl.topology.model import Node


def executor_for(node: Node) -> Executor:
    """LocalExecutor for localhost nodes, SSHExecutor otherwise."""
    return LocalExecutor(node) if node.is_local else SSHExecutor(node)


__all__ = [
    "Executor",
    "LocalExecutor",
    "SSHExecutor",
    "executor_for",
]
