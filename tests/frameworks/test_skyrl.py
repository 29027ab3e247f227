"""skyrl-train 0.3.1's own client code, unmodified (tests/frameworks/skyrl_driver.py, in .venv-areal:
scripts/areal-venv.sh), syncs weights into a PD fleet of prefills of TP 1 and 2 and a decode of TP 2
through pdctl's router, given as its one remote engine of tp 5. What it sends is SGLang before named
groups: an init of group "skyrl", then one ``{name, dtype, shape}`` update per tensor with no group
name and no pause, ``/flush_cache`` with no body, and a bodyless destroy; it checks no status, so
the test checks the fleet."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from pdctl.sim import weights_checksum
from pdctl.sim.model import resolve_model, save_checkpoint
from tests.conftest import REPO
from tests.helpers import RouterProcess, SimProcess, get, pd_router_args, post, sims
from tests.weights.framework import Load

SEED = 81


@pytest.fixture
def fleet(tmp_path):
    specs = [
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "prefill", "--tp-size", "2"),
        ("--disaggregation-mode", "decode", "--tp-size", "2", "--sim-decode-ms-per-step", "2"),
    ]
    with sims(tmp_path, *specs) as procs:
        router = RouterProcess(tmp_path, *pd_router_args(procs[:2], procs[2:], "--policy", "round_robin")).start(
            "/readiness"
        )
        try:
            yield procs, router
        finally:
            router.stop()


def test_skyrl_train_syncs_weights_through_the_router(areal_python, fleet, tmp_path):
    procs, router = fleet
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'frameworks'}"}
    with Load(router.url, max_new_tokens=16) as load:
        run = subprocess.run(
            [str(areal_python), str(REPO / "tests" / "frameworks" / "skyrl_driver.py"),
             router.url.removeprefix("http://"), "5", str(SEED), str(tmp_path)],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    result = json.loads((tmp_path / "result.json").read_text())
    # skyrl-train's own numbers: the fleet as one engine of tp 5 (world 1 + 5), its group "skyrl".
    assert result["group_name"] == "skyrl" and result["world_size"] == 6, result
    assert result["flush"] == [{"status": "success", "message": "Successfully flushed cache on all 3 HTTP workers"}]
    assert result["tensors"] == 23, result  # one {name, dtype, shape} update per tensor
    # Requests sent while it synced were held, never refused: none failed.
    assert not load.failures, load.failures[:3]
    # Every engine, prefill and decode of either TP, holds the trainer's float32 weights exactly.
    trainer = resolve_model(f"sim://tiny?seed={SEED}", "auto", None)
    with torch.no_grad():
        for p in trainer.parameters():
            p.copy_(p.float())
    expected = weights_checksum(trainer)
    for p in procs:
        assert post(p.url + "/weights_checker", {"action": "checksum"})[1]["checksums"] == expected, p.url
    push = get(router.url + "/pdctl/weights")[1]["last_push"]
    assert push["state"] == "complete" and push["group"]["name"] == "skyrl", push
    assert push["group"]["ranks"] == {procs[0].url: [1, 1], procs[1].url: [2, 3], procs[2].url: [4, 5]}
    assert load.versions[push["version"]] >= 1, load.versions  # served on the synced weights afterwards
    # Its rollouts (batched /generate with its sampling params) equal a bare sim holding those weights.
    assert result["stop_reasons"] == ["length", "length"], result
    save_checkpoint(trainer, tmp_path / "synced")
    reference = SimProcess(tmp_path, "--model-path", "sim://tiny", name="ref").start()
    try:
        assert post(reference.url + "/update_weights_from_disk", {"model_path": str(tmp_path / "synced")})[0] == 200
        for prompt, ids in result["rollouts"]:
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
            assert post(reference.url + "/generate", body)[1]["output_ids"] == ids
    finally:
        reference.stop()
    # skyrl-train reads no status: the router's audit says each call succeeded, the bodyless destroy
    # (no group named: the fleet's only one, "skyrl") included.
    audit = [
        line.split("sglang_control ", 1)[1] for line in router.log.read_text().splitlines() if "sglang_control" in line
    ]
    assert audit.count("method=POST path=/update_weights_from_distributed status=200") == 23, audit
    for call in ("/init_weights_update_group", "/flush_cache", "/destroy_weights_update_group"):
        assert f"method=POST path={call} status=200" in audit, audit
    assert len(audit) == 26, audit
