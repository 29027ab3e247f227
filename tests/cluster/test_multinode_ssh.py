"""A decode of TP 4 over two 2-GPU test hosts, a prefill on a third: one engine to the
router, every rank in the weight push, one lifecycle unit in up/status/down."""

from __future__ import annotations

import os
import re
import signal
from dataclasses import replace

import pytest
import yaml

from pdctl.cluster import down, logs, status, up
from pdctl.errors import LifecycleError
from pdctl.plan import make_plan
from pdctl.topology import load_topology_text
from tests.helpers import SimProcess, control_auth, engine_auth, eventually, get, post

pytestmark = pytest.mark.netns

PUSH_WHEN_TOLD = (
    "import os, time\n"
    "from dataclasses import replace\n"
    "from pdctl.sim.model import PRESETS, TinyLM\n"
    "from pdctl.weights import WeightSync\n"
    "flag = os.environ['PUSH_FLAG']\n"
    "while not os.path.exists(flag):\n"
    "    time.sleep(0.2)\n"
    "model = TinyLM(replace(PRESETS['tiny'], seed=43))\n"
    "with WeightSync.from_env(verify='full') as sync:\n"
    "    report = sync.push(list(model.named_parameters()), version='mn-43')\n"
    "print('PUSHED', report.engines, flush=True)\n"
)
PROMPTS = ["the quick brown fox", "hello world", "a b c d e f"]


def topology(hosts, *, name: str, base: int, h2_env: dict | None = None, trainer: dict | None = None):
    data = {
        "name": name,
        "model": {"path": "sim://tiny"},
        "engine": "sim",
        "nodes": [hosts.node(0, gpus=2), hosts.node(1, gpus=2), hosts.node(2, gpus=2, env=h2_env or {})],
        "ports": {"base": base},
        "prefill": {"replicas": 1, "tp": 1, "nodes": ["h0"]},
        "decode": {"replicas": 1, "tp": 4, "nodes": ["h1", "h2"]},
        "router": {
            "host": "0.0.0.0",
            "allow_unauthenticated": True,
            "node": "h0",
            "health_check_interval_secs": 1,
            "health_failure_threshold": 2,
        },
    }
    if trainer:
        data["trainer"] = trainer
        data["weights"] = {"backend": "gloo", "bucket_mb": 1}
    return load_topology_text(yaml.safe_dump(data))[0]


def greedy(url: str, prompt: str) -> list[int]:
    code, out = post(url + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert code == 200, out
    return out["output_ids"]


def decode_worker(router_url: str) -> dict | None:
    code, out = get(router_url + "/workers", headers=control_auth("mn"))
    assert code == 200, out
    return next((w for w in out["workers"] if w["worker_type"] == "decode"), None)


def test_tp4_decode_over_two_hosts(clean_hosts, pdctl_home, tmp_path) -> None:
    from pdctl.sim import weights_checksum
    from pdctl.sim.model import PRESETS, TinyLM

    flag = tmp_path / "push-now"
    trainer = {"command": ["python", "-c", PUSH_WHEN_TOLD], "nproc_per_node": 1, "nodes": ["h0"],
               "env": {"PUSH_FLAG": str(flag)}, "startup_secs": 0.5}  # fmt: skip
    top = topology(clean_hosts, name="mn", base=25000, trainer=trainer)
    plan = make_plan(top)
    assert [p.id for p in plan.processes if p.role.is_engine] == ["prefill-0", "decode-0.h1", "decode-0.h2"]
    single = SimProcess(tmp_path, name="single").start()
    try:
        state = up(top, plan, ready_timeout_secs=120)
        # one engine to its clients: greedy output through the router equals a one-process sim's
        for prompt in PROMPTS:
            assert greedy(state.router_url, prompt) == greedy(single.url, prompt)
        st = status("mn")
        assert st.ok and [(e.id, e.up) for e in st.engines] == [("prefill-0", True), ("decode-0", True)]
        assert next(e for e in st.engines if e.id == "decode-0").processes == ["decode-0.h1", "decode-0.h2"]

        # the push reaches all 4 decode ranks, 2 on each host
        flag.touch()

        def exited():
            trainer = next(p for p in status("mn").processes if p.role == "trainer")
            return trainer if trainer.exit_code is not None else None

        trainer_st = eventually(
            exited, 90, interval=0.5, what=lambda: f"the trainer's exit:\n{''.join(logs('mn', 'trainer.h0'))[-2000:]}"
        )
        text = "".join(logs("mn", "trainer.h0"))
        assert trainer_st.exit_code == 0, text[-2000:]
        assert "PUSHED ['prefill-0', 'decode-0']" in text
        expected = weights_checksum(TinyLM(replace(PRESETS["tiny"], seed=43)))
        decode_url = state.processes["decode-0.h1"].url
        code, out = post(decode_url + "/weights_checker", {"action": "checksum"}, headers=engine_auth("mn"))
        assert code == 200 and out["checksums"] == expected and out["weight_version"] == "mn-43"
        # world 6: trainer 0, prefill 1, decode 2..5 (node 0 holds 2..3, node 1 holds 4..5)
        crc0 = re.findall(r"digest (\w+), on ranks 2\.\.5", "".join(logs("mn", "decode-0.h1", lines=500)))
        crc1 = re.findall(r"digest (\w+), on ranks 4\.\.5", "".join(logs("mn", "decode-0.h2", lines=500)))
        assert crc0 and crc0 == crc1

        # node rank 1 dies: node 0 fails, the router takes the decode out; then the nodes' supervisors
        # bring both ranks back (node 0 exits when its peer goes away, the peer rejoins the new node 0);
        # the engine is up once both processes run and node 0 is healthy
        peer = next(p for p in status("mn").processes if p.id == "decode-0.h2")
        os.kill(peer.pid, signal.SIGKILL)  # the rank itself (shared pid namespace), not its supervisor

        def out_of_rotation() -> bool:
            worker = decode_worker(state.router_url)
            return worker is None or not worker["is_healthy"]

        eventually(out_of_rotation, 60, interval=0.2, what="the decode out of rotation")
        assert "TP peer node rank 1 went away" in "".join(logs("mn", "decode-0.h1", lines=200))

        def all_up():  # (the trainer has exited: the cluster's status is not ok)
            st = status("mn")
            return st if all(e.up for e in st.engines) else None

        st = eventually(all_up, 120, interval=0.5, what="every engine up again")
        back = {p.id: p for p in st.processes}
        assert back["decode-0.h2"].pid != peer.pid and back["decode-0.h2"].restarts >= 1
        assert back["decode-0.h1"].restarts >= 1, "node 0 went down with its peer and came back"
        # healthy again, but on its initial weights while the fleet is at the push's version: the
        # router keeps it out until a push reaches it (this trainer has exited: none will)

        def kept_out() -> dict | None:
            worker = decode_worker(state.router_url)
            return worker if worker and worker["is_healthy"] and worker["quarantined"] else None

        worker = eventually(kept_out, 60, interval=0.2, what="the decode back, healthy, quarantined")
        assert "next weight push" in worker["quarantined"] and worker["weight_version"] == "default", worker
    finally:
        single.stop()
        down("mn")  # clean_hosts asserts that nothing of it is left on any host


def test_node_rank_1_failing_to_start_fails_up_with_its_log(clean_hosts, pdctl_home, tmp_path) -> None:
    broken = tmp_path / "broken" / "pdctl"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('pdctl is broken on this node (test)')\n")
    top = topology(clean_hosts, name="mnf", base=25100, h2_env={"PYTHONPATH": str(broken.parent)})
    with pytest.raises(LifecycleError) as info:
        up(top, make_plan(top), ready_timeout_secs=120)
    message = str(info.value)
    assert "decode-0.h2 did not become ready: process exited" in message
    assert "pdctl is broken on this node (test)" in message  # its log lines are shown
    assert "already down" in down("mnf")
