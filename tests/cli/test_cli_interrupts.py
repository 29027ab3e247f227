"""Ctrl-C while the pdctl command is still loading its modules ends quietly (exit 130)."""

from __future__ import annotations

import subprocess
import sys

INTERRUPTED_IMPORT = """
import sys

class Interrupting:  # Ctrl-C arriving while the commands are imported
    def find_spec(self, name, path=None, target=None):
        if name == "pdctl.cli.app":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, Interrupting())
from pdctl.cli import main
main(["--help"])
"""


def test_ctrl_c_while_loading_prints_no_traceback() -> None:
    res = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT], capture_output=True, text=True, timeout=60)
    assert res.returncode == 130 and res.stderr.strip() == "pdctl: interrupted", res.stderr
