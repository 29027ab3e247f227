"""Remote execution: one Executor per node (local subprocess or SSH), talking to the node agent.

The SSH executor (and paramiko, a third of a second to import) loads only for a node that is
not local, so commands on a localhost cluster start without it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdctl.lazy import lazy_exports
from pdctl.remote.base import Executor
from pdctl.remote.local import LocalExecutor
from pdctl.topology.model import Node

if TYPE_CHECKING:
    from pdctl.remote.ssh import SSHExecutor


def executor_for(node: Node) -> Executor:
    """LocalExecutor for localhost nodes, SSHExecutor otherwise."""
    if node.is_local:
        return LocalExecutor(node)
    from pdctl.remote.ssh import SSHExecutor

    return SSHExecutor(node)


__getattr__ = lazy_exports(__name__, {"SSHExecutor": "pdctl.remote.ssh"})


__all__ = [
    "Executor",
    "LocalExecutor",
    "SSHExecutor",
    "executor_for",
]
