"""The draft-head example (pdctl.examples.colocate_draft) as a user runs it: ``pdctl up`` on
topologies/colocate-draft-sim.yaml (a sim engine of TP 2, a 2-rank torchrun trainer, gloo), the
loss falls over a short CPU run with a fixed seed, and ``down`` leaves no process behind."""

from __future__ import annotations

import json
import os

import psutil
import yaml

from tests.conftest import REPO
from tests.helpers import free_port_base, pdctl


def test_the_draft_head_learns_from_the_data_plane_and_down_leaves_nothing(tmp_path) -> None:
    topo = yaml.safe_load((REPO / "topologies" / "colocate-draft-sim.yaml").read_text())
    topo["ports"]["base"] = free_port_base()
    topo["nodes"][0]["workdir"] = str(tmp_path / "runs")
    topo["trainer"]["command"][topo["trainer"]["command"].index("60")] = "30"
    # (its engines start once this watch of the trainer ends: the 10 s default would be waited out in full)
    topo["trainer"]["startup_secs"] = 0.5
    path = tmp_path / "draft.yaml"
    path.write_text(yaml.safe_dump(topo))
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}
    up = pdctl("up", str(path), env=env)
    assert up.returncode == 0, up.stderr
    pids: list[int] = []
    try:
        st = json.loads(pdctl("status", "--json", env=env).stdout)
        pids = [p["pid"] for p in st["processes"]]
        trainer = next(p for p in st["processes"] if p["role"] == "trainer")
        try:
            psutil.Process(trainer["pid"]).wait(timeout=600)  # torchrun exits when both ranks have
        except psutil.NoSuchProcess:
            pass  # (it had already: 30 steps can end between status and this line)
        st = json.loads(pdctl("status", "--json", env=env).stdout)
        trainer = next(p for p in st["processes"] if p["role"] == "trainer")
        run = tmp_path / "runs" / "colocate-draft"
        assert trainer["exit_code"] == 0, (run / "logs" / "trainer.local.log").read_text()[-3000:]
        for rank in (0, 1):
            records = [json.loads(line) for line in (run / f"draft-rank{rank}.jsonl").read_text().splitlines()]
            assert [r["step"] for r in records] == list(range(30))
            assert {r["engine"] for r in records} == {f"regular-0/tp{rank}"}
            losses = [r["mean_loss"] for r in records]
            first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
            assert last < 0.6 * first, losses
    finally:
        down = pdctl("down", "colocate-draft", env=env)
    assert down.returncode == 0, down.stderr
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind: {alive}"
