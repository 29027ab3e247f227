"""Deterministic per-node port cursors (slime's relay, prior-art.md 5.1). Pure.

Every node has one cursor starting at ``ports.base``; groups take ports in declaration
order and the cursor moves on, so the same YAML always gives the same ports. Fixed ports
(an explicit router port) are reserved first and skipped by the cursor. Nothing is probed
here: ``up`` checks on each node that every planned port is free before launching.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdctl.errors import Issue

MAX_PORT = 65535
EPHEMERAL_FLOOR = 32768  # Linux ip_local_port_range default start
# SGLang binds dist_init_port + 1 .. + 5 and more per DP rank (slime PR #30 reserves 30 + dp).
DIST_INIT_BASE_BLOCK = 30


class PortOverflowError(Exception):
    """A node's ports would run past 65535; ``node`` names it."""

    def __init__(self, node: str, wanted: int, at: int):
        super().__init__(f"node {node}: needs {wanted} more port(s) from {at}, past {MAX_PORT}")
        self.node = node


class PortCursors:
    """One cursor per node; ``take`` returns the first port of a free consecutive block.

    ``keep`` (``pdctl apply``: a running cluster's ports, by ``PROCESS:NAME`` key, as ``(node,
    port, count)``) makes a process that is still planned on the same node keep its ports, so
    that adding an engine does not move the others; every kept port is reserved, and new ports
    come from the cursor around them."""

    def __init__(self, nodes: list[str], base: int, keep: Mapping[str, tuple[str, int, int]] | None = None):
        self.base = base
        self.next = dict.fromkeys(nodes, base)
        self.reserved: dict[str, set[int]] = {n: set() for n in nodes}
        self.highest = dict.fromkeys(nodes, 0)
        self.keep = dict(keep or {})
        for node, port, count in self.keep.values():
            if node in self.reserved:
                self.reserved[node].update(range(port, port + count))

    def reserve(self, node: str, port: int) -> None:
        """Mark a fixed port (one the user chose) so the cursor skips it."""
        self.reserved[node].add(port)
        self.highest[node] = max(self.highest[node], port)

    def take(self, node: str, count: int = 1, key: str | None = None) -> int:
        """The first of ``count`` consecutive ports on ``node``: the ports kept for ``key`` when it
        keeps that many on that node, else the next block past the cursor that avoids reserved ports
        (the cursor moves past it). Raises ``PortOverflowError`` when no block fits below 65536."""
        kept = self.keep.get(key) if key is not None else None
        if kept is not None and kept[0] == node and kept[2] == count:
            return kept[1]
        start = self.next[node]
        while any(p in self.reserved[node] for p in range(start, start + count)):
            start += 1
        if start + count - 1 > MAX_PORT:
            raise PortOverflowError(node, count, start)
        self.next[node] = start + count
        self.highest[node] = max(self.highest[node], start + count - 1)
        return start

    def warnings(self) -> list[Issue]:
        """A warning per node whose ports reach the ephemeral range (racy with clients)."""
        out = []
        for node, top in self.highest.items():
            if top >= EPHEMERAL_FLOOR:
                out.append(
                    Issue(
                        "ports.base",
                        f"ports on node {node} reach {top}, inside Linux's ephemeral range (from "
                        f"{EPHEMERAL_FLOOR}); outgoing connections may take them first",
                        severity="warning",
                        hint=f"lower ports.base so every port stays below {EPHEMERAL_FLOOR}",
                    )
                )
        return out


def dist_init_block_size(dp: int) -> int:
    return DIST_INIT_BASE_BLOCK + dp
