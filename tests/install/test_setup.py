"""The README's set-up is idempotent and quiet: run again (the test command already ran it), it
installs nothing and prints one line."""

from __future__ import annotations

import subprocess

from tests.conftest import REPO


def test_setup_again_installs_nothing_and_says_one_line() -> None:
    out = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert lines == ["setup: .venv ready"], lines
