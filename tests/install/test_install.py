"""`pip install pdctl` is the control plane: it resolves no torch (and so no CUDA wheels)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_control_plane_install_resolves_no_torch(tmp_path) -> None:
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--disable-pip-version-check", "--report", str(report), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"pdctl", "click", "paramiko", "aiohttp"} <= names, names
    heavy = {n for n in names if n in ("torch", "numpy", "safetensors") or n.startswith(("nvidia-", "triton"))}
    assert not heavy, heavy
