"""pdctl.weights against real sims: exact weights after a push, greedy output equal to a sim
started from the same weights, and the router's view of versions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdctl.sim import weights_checksum
from pdctl.weights import WeightSync, WeightSyncError
from tests.helpers import SimProcess, free_port, get, post
from tests.weights.conftest import model, sync_for, targets

GREEDY = {"sampling_params": {"max_new_tokens": 24, "temperature": 0}}


@pytest.mark.parametrize("load_format", ["flattened_bucket", "names"])
def test_push_makes_every_engine_equal_to_the_trainer(fleet, tmp_path, load_format):
    procs, router = fleet
    trainer = model(seed=7)
    expected = weights_checksum(trainer)
    with sync_for(procs, router, load_format=load_format, bucket_mb=0.05, verify="full") as sync:
        report = sync.push(list(trainer.named_parameters()), version=f"seed7-{load_format}")
    assert report.engines == ["e0", "e1", "e2"] and not report.failed
    assert report.buckets > 1 and report.load_format == load_format
    assert report.bytes == sum(p.numel() * p.element_size() for p in trainer.parameters())
    assert set(report.phases) >= {
        "hold",
        "pause",
        "begin",
        "transfer",
        "end",
        "version",
        "verify",
        "continue",
        "release",
    }
    for p in procs:
        status, out = post(p.url + "/weights_checker", {"action": "checksum"})
        assert status == 200 and out["checksums"] == expected, p.url
        assert get(p.url + "/model_info")[1]["weight_version"] == f"seed7-{load_format}"
    # Greedy output through the router equals a sim started from the same weights.
    reference = SimProcess(tmp_path, "--model-path", "sim://tiny?seed=7", name="ref").start()
    try:
        for prompt in ("Hello", "The weights moved", "x"):
            status, via_router = post(router.url + "/generate", {"text": prompt, **GREEDY})
            assert status == 200, via_router
            _, direct = post(reference.url + "/generate", {"text": prompt, **GREEDY})
            assert via_router["output_ids"] == direct["output_ids"]
            assert via_router["meta_info"]["weight_version"] == f"seed7-{load_format}"
    finally:
        reference.stop()
    workers = get(router.url + "/workers")[1]["workers"]
    assert {w["weight_version"] for w in workers} == {f"seed7-{load_format}"}
    assert not any(w["quarantined"] for w in workers)


def test_a_wrong_tensor_is_refused_and_named(fleet):
    procs, router = fleet
    with sync_for(procs, router) as sync, pytest.raises(WeightSyncError) as err:
        import torch

        sync.push([("model.no_such.weight", torch.zeros(4))], version="bad")
    assert err.value.phase == "transfer" and err.value.engine in {"e0", "e1", "e2"}
    # Every engine refused the same unknown name before it touched its model: none holds "bad",
    # each keeps its weights and serves on (the fleet transaction's one rule, as for a framework).
    report = err.value.report
    assert set(report.refused) == {"e0", "e1", "e2"} and not report.failed and not report.engines
    assert "kept their previous weights and serve on" in str(err.value)
    workers = get(router.url + "/workers")[1]["workers"]
    assert not any(w["quarantined"] for w in workers)
    assert all(w["weight_version"] != "bad" for w in workers)
    status, _ = post(router.url + "/generate", {"text": "still up", **GREEDY})
    assert status == 200
    # A good push reaches them all.
    trainer = model(seed=3)
    with sync_for(procs, router) as sync:
        report = sync.push(dict(trainer.named_parameters()), version="good")
    assert report.engines == ["e0", "e1", "e2"]
    workers = get(router.url + "/workers")[1]["workers"]
    assert not any(w["quarantined"] for w in workers)
    status, _ = post(router.url + "/generate", {"text": "ok", **GREEDY})
    assert status == 200


def test_a_push_that_cannot_hold_the_router_touches_nothing(fleet):
    procs, router = fleet
    # Another weight push holds the router: this one is refused at hold and changes nothing.
    status, _ = post(router.url + "/pdctl/hold", {"txn": "someone-else", "engines": [], "lease_secs": 60})
    assert status == 200
    try:
        with sync_for(procs, router) as sync, pytest.raises(WeightSyncError) as err:
            sync.push(list(model(seed=5).named_parameters()), version="refused")
        assert err.value.phase == "hold" and "holds the router" in str(err.value)
        # The other push still holds the router: neither the refused push nor a stray release lifted it.
        assert post(router.url + "/pdctl/release", {"txn": "a-third"})[0] == 409
        assert post(router.url + "/pdctl/hold", {"txn": "a-third", "engines": []})[0] == 409
    finally:
        post(router.url + "/pdctl/release", {"txn": "someone-else"})
    workers = get(router.url + "/workers")[1]["workers"]
    assert not any(w["quarantined"] for w in workers)
    assert all(w["weight_version"] != "refused" for w in workers)
    status, _ = post(router.url + "/generate", {"text": "ok", **GREEDY})
    assert status == 200


def test_fsdp2_model_pushed_from_two_gloo_ranks(fleet, tmp_path):
    """FSDP2 on CPU: two torchrun ranks hold a sharded model; full_tensors gathers it one tensor
    at a time on both ranks while rank 0 pushes; the engines end equal to the unsharded model."""
    procs, router = fleet
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "tests.weights.fsdp_main",
            "--engines",
            json.dumps(targets(procs)),
            "--port",
            str(free_port()),
            "--router",
            router.url,
            "--seed",
            "23",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["sharded"] and rank1["sharded"]
    assert rank0["most_alive"] == rank1["most_alive"] == 1
    assert rank0["report"]["pushed"] and rank0["report"]["engines"] == ["e0", "e1", "e2"]
    assert rank1["report"]["pushed"] is False and rank1["report"]["bytes"] == 0
    expected = weights_checksum(model(seed=23))
    for p in procs:
        status, sums = post(p.url + "/weights_checker", {"action": "checksum"})
        assert status == 200 and sums["checksums"] == expected, p.url


def test_a_group_that_cannot_form_names_the_engine_and_does_not_hang(tmp_path) -> None:
    """An engine that refuses its ranks (a TP 2 engine declared with 1 GPU) is named at once; a
    group that waits for ranks nobody has (a TP 1 engine declared with 2) fails at the timeout."""
    from tests.helpers import sims

    with sims(tmp_path, ("--tp-size", "2"), ()) as (tp2, tp1):
        refusing = WeightSync(
            [{"id": "tp2", "url": tp2.url, "gpus": 1}],
            master_address="127.0.0.1",
            master_port=free_port(),
            timeout_secs=30,
        )
        with pytest.raises(WeightSyncError) as err:
            refusing.connect()
        refusing.close()
        assert err.value.phase == "connect" and err.value.engine == "tp2" and "do not fit" in str(err.value)
        short = WeightSync(
            [{"id": "tp1", "url": tp1.url, "gpus": 2}],
            master_address="127.0.0.1",
            master_port=free_port(),
            timeout_secs=2,
        )
        with pytest.raises(WeightSyncError) as err:
            short.connect()
        short.close()
        assert err.value.phase == "connect" and ("tp1" in str(err.value) or "did not form" in str(err.value))
