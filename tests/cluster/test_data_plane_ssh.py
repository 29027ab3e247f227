"""The colocated data plane on an SSH test host, started by ``up`` from a topology: a TP 1 and a TP 2
sim engine and a 3-rank torchrun trainer (tests/colocate/receiver.py) share the host's 3 GPUs.
Each trainer rank receives, bit for bit, the hidden states its engine returns over HTTP for its
shard; then an engine killed mid-step makes its trainer ranks' recv fail naming it, and ``down``
leaves nothing behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

from pdctl.cluster import down, logs, status, up
from pdctl.plan import make_plan
from pdctl.sim.model import encode
from pdctl.topology import load_topology_text
from tests.helpers import engine_auth, eventually, post

pytestmark = pytest.mark.netns

RECEIVER = Path(__file__).resolve().parents[1] / "colocate" / "receiver.py"
BATCH = 2


def topology(hosts, out: Path):
    data = {
        "name": "dpssh",
        "model": {"path": "sim://tiny"},
        "engine": "sim",
        "nodes": [hosts.node(0, gpus=3)],
        "ports": {"base": 26000},
        "regular": [
            {"name": "a", "tp": 1, "args": {"enable-return-hidden-states": True}},
            {"name": "b", "tp": 2, "args": {"enable-return-hidden-states": True}},
        ],
        "router": {"host": "0.0.0.0", "allow_unauthenticated": True},
        "trainer": {
            "command": ["python", str(RECEIVER), "3", str(out / "rank{rank}.pt")],
            "nproc_per_node": 3,
            "env": {"PYTHONPATH": str(RECEIVER.parents[2])},
            "startup_secs": 0.5,  # (colocated: up starts the trainer first and watches it this long)
        },
        "placement": {
            "mode": "colocate",
            "train_frac": 0.4,
            "infer_frac": 0.4,
            "mps": False,
            "data_plane": {"batch_size": BATCH, "timeout_secs": 300},
        },
    }
    return load_topology_text(yaml.safe_dump(data))[0]


def generate(url: str, text: str) -> list[list[float]]:
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "return_hidden_states": True}
    code, out = post(url + "/generate", body, headers=engine_auth("dpssh"), timeout=120)
    assert code == 200, out
    return out["meta_info"]["hidden_states"][0]  # the prompt's rows


def test_data_plane_over_ssh_bit_for_bit_then_an_engine_dies_mid_step(clean_hosts, pdctl_home, tmp_path) -> None:
    top = topology(clean_hosts, tmp_path)
    plan = make_plan(top)
    assert plan.data_plane is not None and plan.data_plane.world_size == 6
    assert [(e.id, e.first_rank) for e in plan.data_plane.engines] == [("a-0", 3), ("b-0", 4)]
    try:
        state = up(top, plan, ready_timeout_secs=120)
        urls = {e: state.processes[e].url for e in ("a-0", "b-0")}
        prompts = {e: [f"{e} step {k} seq {i}" for k in range(2) for i in range(BATCH)] for e in urls}
        http = {e: [generate(urls[e], p) for p in prompts[e]] for e in urls}  # steps 0 and 1 of each engine
        # Step 2: engine a completes it; engine b gets half of it, then dies.
        for text in ("a step 2 seq 0", "a step 2 seq 1", "b step 2 seq 0"):
            generate(urls[text[0] + "-0"], text)
        engine_b = next(p for p in status("dpssh").processes if p.id == "b-0")
        os.kill(engine_b.pid, signal.SIGKILL)  # the engine itself (shared pid namespace), not its supervisor
        trainer = _wait_trainer_exit()
        assert trainer.exit_code == 0, "".join(logs("dpssh", "trainer.h0"))[-3000:]

        # rank 0 <- a-0 (TP 1: the whole batch); ranks 1, 2 <- b-0's TP ranks 0, 1 (one sequence each)
        pairs = {0: ("a-0", 0, BATCH), 1: ("b-0", 0, 1), 2: ("b-0", 1, 1)}
        for rank, (engine, tp_rank, share) in pairs.items():
            got = torch.load(tmp_path / f"rank{rank}.pt")
            for k in range(2):
                step = got[k]
                assert (step["step"], step["engine"], step["tp_rank"]) == (k, engine, tp_rank), step
                shard = range(k * BATCH + tp_rank * share, k * BATCH + (tp_rank + 1) * share)
                ids = [encode(prompts[engine][i]) for i in shard]
                assert step["input_ids"].tolist() == [t for seq in ids for t in seq]
                want = torch.cat([torch.tensor(http[engine][i], dtype=torch.float64) for i in shard])
                assert torch.equal(step["hidden"], want)
            if engine == "a-0":
                assert got[2]["step"] == 2 and "error" not in got[2]
            else:
                error = got[2]
                assert (error["engine"], error["rank"], error["step"]) == ("b-0", 4 + tp_rank, 2), error
                assert "closed the connection" in error["error"]
    finally:
        down("dpssh")  # clean_hosts asserts that nothing of it is left on the host


def _wait_trainer_exit():
    def exited():
        trainer = next(p for p in status("dpssh").processes if p.role == "trainer")
        return trainer if trainer.exit_code is not None else None

    return eventually(exited, 180, interval=0.5, what="the trainer's exit")
