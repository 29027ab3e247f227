"""The router's state file (pdctl.router.state_file): what a restarted router keeps, and what a
fresh run must not inherit."""

from __future__ import annotations

import os

from pdctl.roles import Role
from pdctl.router.config import WorkerSpec
from pdctl.router.fleet_weights import FleetWeights
from pdctl.router.state_file import RouterState


def test_a_restart_keeps_the_fleet_version_and_workers_and_another_run_starts_clean(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "router-state.json")
    monkeypatch.setenv("PDCTL_RUN_ID", "run-1")
    kept = RouterState(
        fleet=FleetWeights("B", "/ckpt/b"),
        workers=(
            WorkerSpec(url="http://h:1", role=Role.PREFILL, bootstrap_port=9),
            WorkerSpec(url="http://h:2", role=Role.DECODE),
        ),
    )
    kept.write(path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    again = RouterState.read(path)
    assert again.fleet == FleetWeights("B", "/ckpt/b") and again.workers == kept.workers
    monkeypatch.setenv("PDCTL_RUN_ID", "run-2")  # `pdctl down` then `up`: same run directory, new run
    fresh = RouterState.read(path)
    assert fresh.fleet is None and fresh.workers is None


def test_a_damaged_file_is_ignored(tmp_path) -> None:
    path = tmp_path / "router-state.json"
    for text in ("{", "[]", '{"run": null, "fleet": {"source": 1}}', '{"run": null, "workers": [{"url": 1}]}'):
        path.write_text(text)
        state = RouterState.read(str(path))
        assert state.fleet is None and state.workers is None, text
