"""AReaL 1.0.4's own client code, unmodified (tests/frameworks/areal_driver.py, in .venv-areal:
scripts/areal-venv.sh), drives a PD fleet of prefills of TP 1 and 2 and a decode of TP 2 through
pdctl's router, given as its one server (``AREAL_LLM_SERVER_ADDRS``'s role: ``addr``) with
allocation ``sglang:d1t5``. AReaL picks gloo on a machine without CUDA."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from pdctl.sim import weights_checksum
from pdctl.sim.model import resolve_model
from tests.conftest import REPO
from tests.helpers import RouterProcess, SimProcess, eventually, get, pd_router_args, post, sims


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
    env = {**os.environ, "AREAL_CACHE_DIR": str(tmp_path / "areal-cache"), "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [str(areal_python), str(REPO / "tests" / "frameworks" / "areal_driver.py"), addr, "sglang:d1t5", str(tmp_path)],
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


def test_areal_through_a_decode_killed_between_its_buckets(areal_python, tmp_path):
    """AReaL's own update, a decode killed after its first bucket: AReaL raises with the router's
    reason in the message it prints (its ClientResponseError shows the reason phrase only), nothing
    stays held (AReaL sends no continue), every engine the update changed is out of rotation, and
    AReaL's retry (its group joined again under the same name, every bucket) brings every engine,
    the restarted decode included, to the trainer's weights with no pdctl restart."""
    specs = [
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "decode", "--tp-size", "2"),
        ("--disaggregation-mode", "decode"),
    ]
    with sims(tmp_path, *specs) as procs:
        router = RouterProcess(tmp_path, *pd_router_args(procs[:1], procs[1:], "--health-check-interval-secs", "1"))
        router.start("/readiness")
        try:
            env = {**os.environ, "AREAL_CACHE_DIR": str(tmp_path / "areal-cache"), "PYTHONPATH": str(REPO)}
            driver = subprocess.Popen(
                [str(areal_python), str(REPO / "tests" / "frameworks" / "areal_kill_driver.py"),
                 router.url.removeprefix("http://"), "sglang:d1t4", str(tmp_path)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            )  # fmt: skip
            try:
                eventually(lambda: (tmp_path / "bucket-1").exists() or driver.poll() is not None, 180)
                assert driver.poll() is None, driver.communicate()[0][-3000:]
                victim = procs[2]
                os.killpg(victim.proc.pid, signal.SIGKILL)
                victim.proc.wait()
                (tmp_path / "killed").write_text("yes")
                eventually(lambda: get(router.url + "/pdctl/weights")[1]["last_push"]["state"] == "failed", 120)
                state = {w["url"]: w for w in get(router.url + "/workers")[1]["workers"]}
                for p in procs[:2]:
                    assert "holds part of weight update" in (state[p.url]["quarantined"] or ""), state
                status, ready = get(router.url + "/readiness")
                assert status == 503 and "held by" not in ready.get("reason", ""), ready  # nothing held
                restarted = SimProcess(tmp_path, *victim.args, port=victim.port, name="restarted").start()
                procs[2] = restarted
                (tmp_path / "back").write_text("yes")
                out, _ = driver.communicate(timeout=300)
                assert driver.returncode == 0, out[-4000:]
            finally:
                if driver.poll() is None:
                    driver.kill()
            result = json.loads((tmp_path / "result.json").read_text())
            assert result["raised"], result  # its trainer's step fails (the broadcast's peer is gone)
            # AReaL prints the reason phrase of the router's refusal: the router's own words, naming the decode.
            printed = next(line for line in out.splitlines() if "ClientResponseError: 400" in line)
            assert victim.url in printed and "may hold part of it" in printed, printed
            assert result["retried"] and result["buckets"] > 2
            expected = weights_checksum(resolve_model("sim://tiny?seed=73", "auto", None))
            for p in procs:
                assert post(p.url + "/weights_checker", {"action": "checksum"})[1]["checksums"] == expected, p.url
            eventually(lambda: get(router.url + "/readiness")[0] == 200, 30, what="the fleet in rotation again")
            assert post(router.url + "/generate", {"text": "whole", "sampling_params": {"max_new_tokens": 4}})[0] == 200
        finally:
            router.stop()
