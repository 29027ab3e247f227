"""Nodes on this machine (host localhost/127.0.0.1): the agent runs as a subprocess."""

from __future__ import annotations

import subprocess

from pdctl.errors import RemoteError
from pdctl.remote.base import Executor


class LocalExecutor(Executor):
    """The executor of a node on this machine: each agent call is a subprocess here, with nothing to
    connect or close."""

    def _run(self, argv: list[str], stdin: bytes, timeout: float) -> tuple[int, bytes, bytes]:
        try:
            res = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout, check=False)
        except FileNotFoundError as exc:
            raise RemoteError(f"node {self.node.name}: {argv[0]} not found") from exc
        except subprocess.TimeoutExpired as exc:
            raise RemoteError(f"node {self.node.name}: {' '.join(argv[2:])} timed out after {timeout:g}s") from exc
        return res.returncode, res.stdout, res.stderr
