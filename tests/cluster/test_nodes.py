"""NodeSet at a thousand nodes (in-process, executors that stand for nodes): calls run in
parallel, an unreachable node is asked once per command, and the connections kept open are
bounded."""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest

from pdctl.cluster import nodes as nodes_module
from pdctl.cluster.nodes import NodeSet
from pdctl.errors import NodeUnreachable, RemoteError
from pdctl.remote import Executor
from pdctl.topology.model import Node

COUNT = 1024


class _Node(Executor):
    """A node: ``down`` ones raise NodeUnreachable at their connect; each counts its connects."""

    opened: ClassVar[set[str]] = set()
    lock = threading.Lock()

    def __init__(self, node: Node, down: set[str], connects: dict[str, int], barrier: threading.Barrier | None):
        super().__init__(node)
        self.down, self.connects, self.barrier = down, connects, barrier

    def ask(self) -> str:
        with self.lock:
            self.connects[self.node.name] = self.connects.get(self.node.name, 0) + 1
            self.opened.add(self.node.name)
            open_now = len(self.opened)
        if self.barrier is not None:
            self.barrier.wait(timeout=120)  # every call of the first round is under way at once
        if self.node.name in self.down:
            raise NodeUnreachable(f"node {self.node.name}: unreachable: no answer within 10s")
        return f"{self.node.name} ({open_now})"

    def close(self) -> None:
        with self.lock:
            self.opened.discard(self.node.name)

    def _run(self, argv: list[str], stdin: bytes, timeout: float) -> tuple[int, bytes, bytes]:
        raise AssertionError("not used")


@pytest.mark.parametrize("parallel", [nodes_module.parallel_calls()])
def test_a_thousand_nodes_with_a_quarter_down(parallel: int) -> None:
    names = [f"n{i:04d}" for i in range(COUNT)]
    down = set(names[::4])
    connects: dict[str, int] = {}
    # passes only if `parallel` calls wait at once: the first round's connects
    barrier: list[threading.Barrier | None] = [threading.Barrier(parallel)]

    def factory(node: Node) -> Executor:
        return _Node(node, down, connects, barrier[0])

    with NodeSet([Node(name=n, host=f"10.0.{i // 256}.{i % 256}") for i, n in enumerate(names)], factory) as ns:
        first = ns.each(names, lambda ex: ex.ask())  # type: ignore[attr-defined]
        barrier[0] = None
        for ex in ns.executors.values():
            ex.barrier = None  # type: ignore[attr-defined]
        second = ns.each(names, lambda ex: ex.ask())  # type: ignore[attr-defined]
        assert len(ns.executors) <= nodes_module.MAX_OPEN
    for result in (first, second):
        assert {n for n, r in result.items() if isinstance(r, RemoteError)} == down
        assert all("unreachable" in str(result[n]) for n in down)
    assert all(connects[n] == 1 for n in down), "an unreachable node is asked once per command"
    assert all(connects[n] == 2 for n in names if n not in down)
    assert not _Node.opened, "every connection closed with the NodeSet"
