"""The frameworks' tests share .venv-areal: AReaL 1.0.4 and skyrl-train 0.3.1 beside .venv's packages."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

AREAL_PYTHON = REPO / ".venv-areal" / "bin" / "python"


@pytest.fixture(scope="module")
def areal_python() -> Path:
    """.venv-areal's interpreter, made (or found current) by scripts/areal-venv.sh."""
    result = subprocess.run(["bash", str(REPO / "scripts" / "areal-venv.sh")], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"scripts/areal-venv.sh failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return AREAL_PYTHON
