"""The router answers SGLang's control routes for the whole PD fleet (pdctl.router.facade), driven
as RL frameworks drive engines (tests/weights/framework.py: their HTTP sequences, a trainer rank 0
on gloo), against prefills of TP 1 and 2 and a decode of TP 2 (world 1 + 5)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

from pdctl.sim import weights_checksum
from pdctl.sim.model import PRESETS, TinyLM, save_checkpoint
from pdctl.weights import WeightSync, WeightSyncError
from tests.helpers import RouterProcess, SimProcess, eventually, free_port, get, http, pd_router_args, post, sims
from tests.weights.conftest import targets
from tests.weights.framework import Load, Trainer

GREEDY = {"sampling_params": {"max_new_tokens": 16, "temperature": 0}}
WORLD = 6  # trainer rank 0 + prefill tp 1 + prefill tp 2 + decode tp 2


def model(seed: int) -> TinyLM:
    return TinyLM(replace(PRESETS["tiny"], seed=seed))


def checksums(proc) -> dict:
    return post(proc.url + "/weights_checker", {"action": "checksum"})[1]["checksums"]


def workers(router) -> dict[str, dict]:
    return {w["url"]: w for w in get(router.url + "/workers")[1]["workers"]}


def last_push(router) -> dict:
    return get(router.url + "/pdctl/weights")[1]["last_push"]


def same_as_bare_sim(router, tmp_path: Path, seed: int) -> None:
    """Greedy answers through the router equal a bare sim started from the same weights."""
    reference = SimProcess(tmp_path, "--model-path", f"sim://tiny?seed={seed}", name="ref").start()
    try:
        for prompt in ("Hello", "after the update", "x"):
            status, via_router = post(router.url + "/generate", {"text": prompt, **GREEDY})
            assert status == 200, via_router
            _, direct = post(reference.url + "/generate", {"text": prompt, **GREEDY})
            assert via_router["output_ids"] == direct["output_ids"]
    finally:
        reference.stop()


def test_areal_sequence_through_the_router_under_load(fleet, tmp_path):
    """AReaL 1.0.4's calls, pointed at the router as its one server of tp 5: init (rank_offset 1,
    world 6, master_port a string), pause {}, per bucket an update with abort_all_requests, the
    broadcast, continue {}. Every engine holds the trainer's weights bit for bit, on one version,
    and no client request failed (those the abort pause stopped end with finish_reason abort and
    their tokens, which AReaL resubmits)."""
    procs, router = fleet
    trainer_model = model(seed=61)
    trainer = Trainer(router.url, WORLD)
    try:
        assert trainer.init() == (200, {"success": True, "message": "Succeeded to initialize custom process group."})
        with Load(router.url, max_new_tokens=200) as load:
            time.sleep(0.5)  # requests in flight when the pause comes
            assert post(router.url + "/pause_generation", {}) == (
                200,
                {"message": "Generation paused successfully.", "status": "ok"},
            )
            answers = trainer.push(trainer_model.named_parameters())
            assert all(
                a == (200, {"success": True, "message": "Succeeded to update parameter online."}) for a in answers
            )
            assert post(router.url + "/continue_generation", {}) == (
                200,
                {"message": "Generation continued successfully.", "status": "ok"},
            )
            time.sleep(0.5)
        assert not load.failures, load.failures[:3]
        assert load.finishes["abort"] >= 1, load.finishes  # AReaL's abort-and-resubmit path
        expected = weights_checksum(trainer_model)
        push = last_push(router)
        version = push["version"]
        assert push["state"] == "complete" and push["driver"] == "framework" and not push["failed"]
        # Mixed TP: each engine at 1 + the ranks of the engines before it, in the plan's order.
        assert push["group"]["ranks"] == {procs[0].url: [1, 1], procs[1].url: [2, 3], procs[2].url: [4, 5]}
        for p in procs:
            assert checksums(p) == expected, p.url
            assert get(p.url + "/model_info")[1]["weight_version"] == version
        assert get(router.url + "/get_weight_version") == (200, {"weight_version": version})
        assert load.versions[version] >= 1, load.versions  # served on the new version after continue
        same_as_bare_sim(router, tmp_path, seed=61)
    finally:
        trainer.close()
    assert post(router.url + "/destroy_weights_update_group", {"group_name": trainer.group_name})[0] == 200


def test_wrong_world_size_missing_group_and_destroy(fleet):
    _procs, router = fleet
    body = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 4,  # AReaL's 1 + 1*3 for a uniform tp 3: wrong for this fleet
        "group_name": "g",
        "backend": "gloo",
    }
    status, out = post(router.url + "/init_weights_update_group", body)
    assert status == 400 and out["success"] is False
    assert "need world_size 6" in out["message"] and "sglang:d1t5" in out["message"], out
    status, out = post(
        router.url + "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}
    )
    assert status == 400 and "Group weight_update_group not in" in out["message"], out
    assert post(router.url + "/destroy_weights_update_group") == (
        400,
        {"success": False, "message": "The group to be destroyed does not exist."},
    )
    status, out = post(router.url + "/pause_generation", {"mode": "sideways"})
    assert status == 400 and "mode must be one of" in out["error"]["message"]
    # Nothing was held: requests flow.
    assert post(router.url + "/generate", {"text": "ok", **GREEDY})[0] == 200


def test_skyrl_updates_with_no_pause_are_one_transaction(fleet, tmp_path):
    """skyrl-train: init, then one-parameter updates with no pause, then /flush_cache. The router
    holds and pauses the fleet itself at the first update; requests sent meanwhile are held, not
    refused; the flush ends the transaction."""
    procs, router = fleet
    trainer_model = model(seed=62)
    trainer = Trainer(router.url, WORLD, group_name="skyrl")  # skyrl-train's; its updates name no group
    try:
        assert trainer.init()[0] == 200
        with Load(router.url, max_new_tokens=8) as load:
            time.sleep(0.3)
            answers = trainer.push(trainer_model.named_parameters(), per_bucket=1, single=True)
            assert all(status == 200 for status, _ in answers), answers
            assert last_push(router)["state"] == "pushing"
            status, out = post(router.url + "/flush_cache")
            assert status == 200 and out["status"] == "success", out
            time.sleep(0.3)
        assert not load.failures, load.failures[:3]
        assert load.finishes["abort"] == 0, load.finishes  # drained, not aborted
        push = last_push(router)
        assert push["state"] == "complete", push
        expected = weights_checksum(trainer_model)
        assert all(checksums(p) == expected for p in procs)
        assert load.versions[push["version"]] >= 1
    finally:
        trainer.close()
        # skyrl-train's destroy has no body at all: the fleet's only group
        assert http("POST", router.url + "/destroy_weights_update_group")[0] == 200


def test_disk_update_between_pause_and_continue(fleet, tmp_path):
    procs, router = fleet
    saved = model(seed=63)
    path = tmp_path / "ckpt"
    save_checkpoint(saved, path)
    assert post(router.url + "/pause_generation", {})[0] == 200
    status, out = post(
        router.url + "/update_weights_from_disk",
        {"model_path": str(path), "abort_all_requests": True, "weight_version": "disk-63"},
    )
    assert (status, out) == (
        200,
        {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0},
    )
    assert post(router.url + "/continue_generation", {})[0] == 200
    push = last_push(router)
    assert push["state"] == "complete" and push["source"] == str(path) and push["version"] == "disk-63"
    expected = weights_checksum(saved)
    assert all(checksums(p) == expected for p in procs)
    assert get(router.url + "/get_weight_version") == (200, {"weight_version": "disk-63"})
    same_as_bare_sim(router, tmp_path, seed=63)
    # A path no engine can read: each refuses, keeps its weights and version, and stays in rotation.
    status, out = post(router.url + "/update_weights_from_disk", {"model_path": str(tmp_path / "nowhere")})
    assert status == 400 and out["success"] is False and "3 engine(s)" in out["message"], out
    assert all(checksums(p) == expected for p in procs)
    assert not any(w["quarantined"] for w in workers(router).values())
    assert get(router.url + "/get_weight_version") == (200, {"weight_version": "disk-63"})


def test_a_second_update_while_one_runs_is_refused_and_nothing_stays_held(fleet, tmp_path):
    procs, router = fleet
    # A pdctl.weights push holds the router: a framework's pause is refused, touching nothing.
    assert post(router.url + "/pdctl/hold", {"txn": "a-push", "engines": [], "lease_secs": 60})[0] == 200
    try:
        status, out = post(router.url + "/pause_generation", {})
        assert status == 409 and "a-push holds the router" in out["error"]["message"], out
        # Nor may a framework continue the engines that push paused.
        status, out = post(router.url + "/continue_generation", {})
        assert status == 409 and "a-push holds the router" in out["error"]["message"], out
    finally:
        assert post(router.url + "/pdctl/release", {"txn": "a-push"})[0] == 200
    # A framework's distributed update runs: a load from disk in the same transaction is refused.
    trainer = Trainer(router.url, WORLD, group_name="g2")
    try:
        assert trainer.init()[0] == 200
        assert post(router.url + "/pause_generation", {})[0] == 200
        params = list(model(seed=64).named_parameters())
        assert trainer.push(params[:3])[0][0] == 200
        save_checkpoint(model(seed=65), tmp_path / "other")
        status, out = post(router.url + "/update_weights_from_disk", {"model_path": str(tmp_path / "other")})
        assert status == 409 and "already moved distributed" in out["message"], out
        # And a pdctl.weights trainer neither holds the router meanwhile nor touches the engines'
        # update sessions (it would close the framework's, and its next bucket would hang).
        sync = WeightSync(
            targets(procs), master_address="127.0.0.1", master_port=free_port(), router_url=router.url, timeout_secs=30
        )
        try:
            with pytest.raises(WeightSyncError, match="holds the router"):
                sync.push(params, version="refused")
        finally:
            sync.close()
        assert trainer.push(params[3:])[0][0] == 200
        assert post(router.url + "/continue_generation", {})[0] == 200
    finally:
        trainer.close()
        post(router.url + "/destroy_weights_update_group", {"group_name": "g2"})
    expected = weights_checksum(model(seed=64))
    assert all(checksums(p) == expected for p in procs)
    assert post(router.url + "/generate", {"text": "ok", **GREEDY})[0] == 200


@pytest.fixture
def small_fleet(tmp_path):
    """Its own fleet (a test here kills an engine or lets a pause lapse): prefill tp 1, decode tp 1."""
    with sims(tmp_path, ("--disaggregation-mode", "prefill"), ("--disaggregation-mode", "decode")) as procs:
        router = RouterProcess(
            tmp_path,
            *pd_router_args(procs[:1], procs[1:], "--framework-lease-secs", "3", "--health-check-interval-secs", "1"),
        ).start("/readiness")
        try:
            yield procs, router
        finally:
            router.stop()


def test_a_pause_with_no_continue_ends_by_itself(small_fleet):
    """--framework-lease-secs after its last call a framework's pause ends: held requests go on, the
    engines are continued, and nothing leaves rotation (no weights moved)."""
    _procs, router = small_fleet
    assert post(router.url + "/pause_generation", {"mode": "retract"})[0] == 200
    started = time.monotonic()
    status, out = post(router.url + "/generate", {"text": "held", **GREEDY}, timeout=60)
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length", out
    assert time.monotonic() - started >= 2  # it was held until the pause lapsed, not refused
    assert not any(w["quarantined"] for w in workers(router).values())
    log = router.log.read_text()
    assert "a pause with no continue" in log


def test_an_engine_killed_during_an_update(small_fleet, tmp_path):
    """The decode dies between two buckets: the next update is refused at once naming it (nothing
    is sent to the others), the prefill that took the first bucket holds a mix and leaves
    rotation, named; nothing stays held; once the decode is back, a new group and a whole update
    bring both back."""
    procs, router = small_fleet
    prefill, decode = procs
    params = list(model(seed=66).named_parameters())
    trainer = Trainer(router.url, 3, group_name="k")
    try:
        assert trainer.init()[0] == 200
        assert post(router.url + "/pause_generation", {})[0] == 200
        assert trainer.bucket(params[:2])[0] == 200
        os.killpg(decode.proc.pid, signal.SIGKILL)
        decode.proc.wait()
        answer = trainer.pool.submit(
            post,
            router.url + "/update_weights_from_distributed",
            {
                "names": [n for n, _ in params[2:4]],
                "dtypes": [str(t.dtype).split(".")[1] for _, t in params[2:4]],
                "shapes": [list(t.shape) for _, t in params[2:4]],
                "group_name": "k",
            },
        ).result()
        status, out = answer
        assert status == 400 and decode.url in out["message"] and "nothing was sent" in out["message"], out
        assert post(router.url + "/continue_generation", {})[0] == 200
        state = workers(router)
        assert "did not finish" in (state[prefill.url]["quarantined"] or ""), state
        status, out = post(
            router.url + "/update_weights_from_distributed",
            {"names": [], "dtypes": [], "shapes": [], "group_name": "k"},
        )
        assert status == 400 and "broken" in out["message"], out
    finally:
        trainer.close()
    # The decode comes back (its supervisor's job in a cluster); the framework rebuilds its group.
    restarted = SimProcess(tmp_path, *decode.args, port=decode.port, name="restarted").start()
    procs[1] = restarted
    assert post(router.url + "/destroy_weights_update_group", {"group_name": "k"})[0] == 200
    trainer = Trainer(router.url, 3, group_name="k")
    try:
        assert trainer.init()[0] == 200
        assert post(router.url + "/pause_generation", {})[0] == 200
        assert all(a[0] == 200 for a in trainer.push(params))
        assert post(router.url + "/continue_generation", {})[0] == 200
    finally:
        trainer.close()
    expected = weights_checksum(model(seed=66))
    assert checksums(prefill) == expected and checksums(restarted) == expected
    eventually(
        lambda: not any(w["quarantined"] or not w["is_healthy"] for w in workers(router).values()),
        30,
        interval=0.2,
        what=lambda: f"every worker healthy and in rotation: {workers(router)}",
    )
    assert post(router.url + "/generate", {"text": "whole again", **GREEDY})[0] == 200
