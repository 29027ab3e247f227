"""Shared fixtures and helpers. Tests need no GPU; see tests/README in the main README."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOPOLOGIES = sorted((REPO / "topologies").glob("*.yaml"))

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # A suite started as a background job (`scripts/test.sh &`) inherits SIGINT ignored, and so
    # would every pdctl process it starts (Python leaves an ignored SIGINT ignored): the tests that
    # Ctrl-C a command, or stop `pdctl planner`, would find it deaf. A handler, unlike SIG_IGN, is
    # reset to the default in the processes the tests start.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def yaml_text(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


@pytest.fixture
def write_yaml(tmp_path: Path):
    def write(text: str, name: str = "topo.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml_text(text))
        return path

    return write
