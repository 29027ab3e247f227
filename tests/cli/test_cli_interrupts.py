"""Ctrl-C while the pdctl command is still loading its modules ends quietly (exit 130)."""

from __future__ import annotations

import subprocess
import sys

import pytest

INTERRUPTED_IMPORT = """
import sys

class Interrupting:  # Ctrl-C arriving while {module} is imported
    def find_spec(self, name, path=None, target=None):
        if name == "{module}":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, Interrupting())
from pdctl.cli import main
main({argv!r})
"""


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("pdctl.cli.app", ["--help"]),  # the root group
        ("pdctl.cli.bench_cmds", ["--help"]),  # a command's module, loaded while click parses (the listing)
        ("pdctl.cli.cluster_cmds", ["switch", "--help"]),  # the named command's module
    ],
)
def test_ctrl_c_while_loading_prints_no_traceback(module: str, argv: list[str]) -> None:
    code = INTERRUPTED_IMPORT.format(module=module, argv=argv)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 130 and res.stderr.strip() == "pdctl: interrupted", res.stderr
