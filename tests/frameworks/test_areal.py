"""AReaL 1.0.4's own client code, unmodified (tests/frameworks/areal_driver.py, in .venv-areal:
scripts/areal-venv.sh), drives a PD fleet of prefills of TP 1 and 2 and a decode of TP 2 through
pdctl's router, given as its one server (``AREAL_LLM_SERVER_ADDRS``'s role: ``addr``) with
allocation ``sglang:d1t5``. AReaL picks gloo on a machine without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from pdctl.sim import weights_checksum
from pdctl.sim.model import resolve_model
from tests.helpers import RouterProcess, SimProcess, get, pd_router_args, post, sims

ROOT = Path(__file__).resolve().parents[2]
AREAL_PYTHON = ROOT / ".venv-areal" / "bin" / "python"


@pytest.fixture(scope="module")
def areal_python() -> Path:
    """.venv-areal's interpreter, made (or found current) by scripts/areal-venv.sh."""
    result = subprocess.run(["bash", str(ROOT / "scripts" / "areal-venv.sh")], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"scripts/areal-venv.sh failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return AREAL_PYTHON


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("areal-fleet")
    specs = [
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "prefill", "--tp-size", "2"),
        # 3 ms a step: a 160-token rollout stays in flight for half a second (the pauses abort some)
        ("--disaggregation-mode", "decode", "--tp-size", "2", "--sim-decode-ms-per-step", "3"),
    ]
    with sims(tmp, *specs) as procs:
        router = RouterProcess(tmp, *pd_router_args(procs[:2], procs[2:], "--policy", "round_robin")).start(
            "/readiness"
        )
        try:
            yield procs, router
        finally:
            router.stop()


def test_areal_drives_the_fleet_through_the_router(areal_python, fleet, tmp_path):
    procs, router = fleet
    addr = router.url.removeprefix("http://")
    env = {**os.environ, "AREAL_CACHE_DIR": str(tmp_path / "areal-cache"), "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [str(areal_python), str(ROOT / "tests" / "frameworks" / "areal_driver.py"), addr, "sglang:d1t5", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["backend"] == "gloo"
    # Every rollout finished (AReaL raises on a failed request), with a logprob per token...
    assert result["error_count"] == 0, result["errors"]
    assert result["rollouts"] >= 12 and result["logprobs_ok"], result
    assert result["stop_reasons"] == ["length"], result
    # ...and some were stopped by a pause, answered with finish_reason abort and their tokens so far,
    # and resubmitted by AReaL as prompt + those tokens: their tokens span two of AReaL's versions.
    assert result["resubmitted"] >= 1, result
    assert result["buckets"] > 1
    # Every engine, prefill and decode of either TP, holds the trainer's weights bit for bit.
    trainer = resolve_model("sim://tiny?seed=72", "auto", None)
    expected = weights_checksum(trainer)
    for p in procs:
        assert post(p.url + "/weights_checker", {"action": "checksum"})[1]["checksums"] == expected, p.url
    push = get(router.url + "/pdctl/weights")[1]["last_push"]
    assert push["state"] == "complete" and push["driver"] == "framework", push
    assert push["group"]["ranks"] == {procs[0].url: [1, 1], procs[1].url: [2, 3], procs[2].url: [4, 5]}
    # Rollouts after the update equal a bare sim holding the new weights (greedy), token for token.
    reference = SimProcess(tmp_path, "--model-path", "sim://tiny?seed=72", name="ref").start()
    try:
        assert result["after_push"], result
        for prompt, tokens in result["after_push"]:
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 160, "temperature": 0}}
            assert post(reference.url + "/generate", body)[1]["output_ids"] == tokens
    finally:
        reference.stop()
    log = router.log.read_text()
    assert "path=/update_weights_from_disk status=200" in log and "path=/continue_generation status=200" in log
