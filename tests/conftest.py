"""Shared fixtures and helpers. Tests need no GPU; see tests/README in the main README."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOPOLOGIES = sorted((REPO / "topologies").glob("*.yaml"))


def yaml_text(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


@pytest.fixture
def write_yaml(tmp_path: Path):
    def write(text: str, name: str = "topo.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml_text(text))
        return path

    return write
