"""Executor: run the node agent on one node and get its JSON answer. Lifecycle code talks
only to this interface; it never imports paramiko or subprocess."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

from pdctl.errors import RemoteError
from pdctl.topology.model import Node

AGENT_MODULE = "pdctl.node.agent"


class Executor(ABC):
    """Runs the node agent on one node (module docstring). Subclasses supply ``_run``; an executor may
    hold a connection open between calls until ``close`` (or the end of a ``with`` block)."""

    def __init__(self, node: Node):
        self.node = node

    def agent(self, command: str, request: dict[str, Any] | None = None, *, timeout: float = 120) -> dict[str, Any]:
        """Run ``python -m pdctl.node.agent COMMAND`` on the node with ``request`` as JSON on stdin.

        Raises RemoteError naming the node on transport failures or an agent error.
        """
        argv = [self.node.python, "-m", AGENT_MODULE, command]
        code, out, err = self._run(argv, json.dumps(request or {}).encode(), timeout)
        try:
            answer = json.loads(out.decode().strip().splitlines()[-1]) if out.strip() else None
        except (ValueError, IndexError):
            answer = None
        if isinstance(answer, dict) and "error" in answer and code != 0:
            raise RemoteError(f"node {self.node.name}: agent {command}: {answer['error']}")
        if code != 0 or not isinstance(answer, dict):
            detail = (err.decode(errors="replace").strip() or out.decode(errors="replace").strip())[-800:]
            if "No module named pdctl" in detail or "No module named 'pdctl'" in detail:
                detail = f"pdctl is not importable by {self.node.python} (install pdctl on the node)"
            elif code == 127 or "No such file" in detail:
                detail = f"{self.node.python} not found on the node ({detail})"
            raise RemoteError(f"node {self.node.name}: agent {command} failed (exit {code}): {detail}")
        return answer

    @abstractmethod
    def _run(self, argv: list[str], stdin: bytes, timeout: float) -> tuple[int, bytes, bytes]:
        """Run argv on the node; return (exit code, stdout, stderr)."""

    def connect(self) -> None:  # noqa: B027 - local nodes need nothing
        """Open the connection now (so that errors show up in preflight)."""

    def close(self) -> None:  # noqa: B027
        """Release the connection."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
