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


def test_silent_and_refusing_nodes_are_asked_in_parallel_and_once_per_command(tmp_path) -> None:
    """64 nodes whose port takes connections and never speaks SSH, 64 whose port refuses: every
    silent one is waited on at once (one connect bound for all, not one per 32 nodes), each is
    connected to once in a command that asks all of them twice, and each answer says
    unreachable, naming the node."""
    import socket
    import threading

    from pdctl.cluster.nodes import NodeSet

    silent = socket.socket()
    silent.bind(("127.0.0.2", 0))  # not a local host to pdctl: reached over SSH
    silent.listen(256)
    accepted: list[socket.socket] = []
    most_open = [0]
    stop = threading.Event()

    def still_open(conn: socket.socket) -> bool:
        try:
            return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""  # pdctl's banner, or b"": closed
        except BlockingIOError:
            return True
        except OSError:
            return False

    def accept() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(silent.accept()[0])  # held open, never answered
            except TimeoutError:
                continue
            most_open[0] = max(most_open[0], sum(map(still_open, accepted)))

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    ssh = {"known_hosts": str(tmp_path / "none")}
    port = silent.getsockname()[1]
    nodes = [Node.from_dict({"name": f"s{i}", "host": "127.0.0.2", "ssh": {**ssh, "port": port}}) for i in range(64)]
    refused = free_port()
    nodes += [
        Node.from_dict({"name": f"r{i}", "host": "127.0.0.3", "ssh": {**ssh, "port": refused}}) for i in range(64)
    ]
    names = [n.name for n in nodes]
    try:
        with NodeSet(nodes) as ns:
            first = ns.each(names, lambda ex: ex.agent("status", {}))
            second = ns.each(names, lambda ex: ex.agent("status", {}))
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        silent.close()
    assert most_open[0] == 64, f"at most {most_open[0]} silent nodes were waited on at once"
    assert len(accepted) == 64, "a silent node was connected to again in the same command"
    for answers in (first, second):
        for name, answer in answers.items():
            assert isinstance(answer, RemoteError) and "unreachable" in str(answer) and f"node {name} " in str(answer)
