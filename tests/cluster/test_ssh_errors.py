"""SSH connection errors a person can act on: an unreachable host says so even with no
known_hosts file, and no "[Errno None]" reaches the message."""

from __future__ import annotations

import pytest

from pdctl.errors import RemoteError
from pdctl.remote.ssh import SSHExecutor
from pdctl.topology.model import Node
from tests.helpers import free_port


def test_an_unreachable_host_without_known_hosts_says_it_is_unreachable(tmp_path) -> None:
    port = free_port()  # nothing listens there
    node = Node.from_dict(
        {"name": "far", "host": "127.0.0.1", "ssh": {"port": port, "known_hosts": str(tmp_path / "none")}}
    )
    with pytest.raises(RemoteError) as info:
        SSHExecutor(node).connect()
    message = str(info.value)
    assert "unreachable" in message and "Connection refused" in message, message
    assert "Errno None" not in message and "known_hosts" not in message, message
