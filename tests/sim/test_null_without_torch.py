"""The null engine (router benchmarks, a plain install's smoke tests) needs no torch."""

from __future__ import annotations

import subprocess
import sys

NO_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not installed here")
        return None

sys.meta_path.insert(0, NoTorch())
import pdctl.sim.null
print("imported", "torch" in sys.modules)
"""


def test_the_null_engine_imports_without_torch() -> None:
    res = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "imported False", res.stderr[-2000:]
