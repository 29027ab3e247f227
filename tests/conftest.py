"""Shared fixtures and helpers. Tests need no GPU; see tests/README in the main README."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOPOLOGIES = sorted((REPO / "topologies").glob("*.yaml"))

for _sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
    if signal.getsignal(_sig) is signal.SIG_IGN:
        # A suite started as a background job (`scripts/test.sh &`) inherits SIGINT ignored, one
        # under nohup SIGHUP, and so would every pdctl process it starts (pdctl, as Python, leaves
        # an ignored stop signal ignored): the tests that Ctrl-C, hang up or kill a command would
        # find it deaf. A handler, unlike SIG_IGN, is reset to the default in the processes the
        # tests start.
        signal.signal(_sig, signal.default_int_handler)


def yaml_text(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


@pytest.fixture
def write_yaml(tmp_path: Path):
    def write(text: str, name: str = "topo.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml_text(text))
        return path

    return write
