"""A push with a router is the router's fleet transaction (pdctl.weights.routed,
pdctl.router.transaction.routes): the routes refuse what is not the push's, a push whose trainer
stops it (Ctrl-C) or goes silent ends at once or at its lease, and the router verifies what the
engines hold against the trainer's own checksums."""

from __future__ import annotations

import pytest

from pdctl.sim import weights_checksum
from pdctl.sim.model import PRESETS, TinyLM, resolve_model, save_checkpoint
from pdctl.weights import Fleet, WeightSync, WeightSyncError
from tests.helpers import RouterProcess, eventually, free_port, get, pd_router_args, post, sims
from tests.weights.conftest import targets

GREEDY = {"sampling_params": {"max_new_tokens": 8, "temperature": 0}}
JOIN = {"rank_offset": 1, "world_size": 7}


def model(seed: int) -> TinyLM:
    from dataclasses import replace

    return TinyLM(replace(PRESETS["tiny"], seed=seed))


def sync_for(procs, router, **kw) -> WeightSync:
    port = free_port()
    return WeightSync(targets(procs), master_address="127.0.0.1", master_port=port, router_url=router.url, **kw)


def workers(router) -> dict[str, dict]:
    return {w["url"]: w for w in get(router.url + "/workers")[1]["workers"]}


def held(router) -> bool:
    return get(router.url + "/pdctl/weights")[1]["held"]


def checksums(proc) -> dict:
    return post(proc.url + "/weights_checker", {"action": "checksum"})[1]["checksums"]


def push_whole(procs, router, seed: int) -> None:
    """A good push: every engine back in rotation on it (what each test leaves behind)."""
    with sync_for(procs, router) as sync:
        report = sync.push(list(model(seed).named_parameters()), version=f"seed{seed}")
    assert report.engines == ["e0", "e1", "e2"] and not report.failed
    eventually(lambda: not any(w["quarantined"] for w in workers(router).values()), 30, what="every engine in rotation")


def test_an_open_push_refuses_every_other_driver_and_its_abort_changes_nothing(fleet):
    _, router = fleet
    before = {u: w["weight_version"] for u, w in workers(router).items()}
    status, opened = post(router.url + "/pdctl/push/open", {"version": "v-open", "lease_secs": 60})
    assert status == 200 and opened["txn"].startswith("push-") and len(opened["engines"]) == 3, opened
    txn = opened["txn"]
    try:
        assert held(router)
        # A framework's calls (no X-Pdctl-Txn) are refused while the push is open...
        for path, body in [
            ("/pause_generation", {"mode": "abort"}),
            ("/continue_generation", {}),
            ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}),
            ("/init_weights_update_group", {"master_address": "::1", "master_port": 1, **JOIN}),
            ("/update_weights_from_disk", {"model_path": "sim://tiny?seed=1"}),
            ("/release_memory_occupation", {"tags": ["kv_cache"]}),
            ("/flush_cache", {}),
            ("/abort_request", {"abort_all": True}),
        ]:
            status, answer = post(router.url + path, body)
            assert status == 409 and txn in str(answer), (path, status, answer)
        # ...as are another push and a step naming another push.
        assert post(router.url + "/pdctl/push/open", {})[0] == 409
        assert post(router.url + "/pdctl/push/commit", {"txn": "push-0"})[0] == 409
        assert post(router.url + "/pdctl/push/renew", {"txn": txn})[0] == 200
    finally:
        status, outcome = post(router.url + "/pdctl/push/abort", {"txn": txn, "why": "the test is done"})
    assert status == 200 and outcome["complete"] == [] and outcome["failed"] == {}, outcome
    assert not held(router)
    assert {u: w["weight_version"] for u, w in workers(router).items()} == before
    assert not any(w["quarantined"] for w in workers(router).values())
    assert post(router.url + "/generate", {"text": "after", **GREEDY})[0] == 200
    assert post(router.url + "/pdctl/push/commit", {"txn": txn})[0] == 409  # it has ended
    # A late call of the ended push (its trainer's bucket still in a pool thread) starts nothing.
    late = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}
    status, answer = post(router.url + "/update_weights_from_distributed", late, headers={"X-Pdctl-Txn": txn})
    assert status == 409 and "not open" in str(answer), answer
    assert not held(router)


def test_a_silent_push_ends_at_its_lease_and_requests_flow(fleet):
    _, router = fleet
    status, _ = post(router.url + "/pdctl/push/open", {"version": "v-silent", "lease_secs": 1})
    assert status == 200
    eventually(lambda: not held(router), 30, interval=0.1, what="the lease to end the push")
    assert not any(w["quarantined"] for w in workers(router).values())  # nothing moved: nothing left rotation
    status, out = post(router.url + "/generate", {"text": "after the lease", **GREEDY})
    assert status == 200, out


def test_a_ctrl_c_in_the_middle_of_a_push_ends_it_at_once(fleet):
    """The trainer is interrupted between buckets: the router ends the push now (not at its
    lease), the engines that took part of it leave rotation, and the next push brings them back."""
    procs, router = fleet
    params = list(model(seed=41).named_parameters())

    def tensors():
        for i, pair in enumerate(params):
            if i == len(params) // 2:
                raise KeyboardInterrupt
            yield pair

    with sync_for(procs, router, bucket_mb=0.01, lease_secs=600) as sync, pytest.raises(KeyboardInterrupt):
        sync.push(tensors, version="interrupted")
    assert not held(router)  # a lease of 600 s did not have to run out
    last = get(router.url + "/pdctl/weights")[1]["last_push"]
    assert last["state"] == "failed" and "KeyboardInterrupt" in str(last["failed"]), last
    assert all(w["quarantined"] for w in workers(router).values())
    push_whole(procs, router, seed=42)
    assert all(checksums(p) == weights_checksum(model(seed=42)) for p in procs)


def test_the_router_verifies_against_the_trainers_checksums(fleet, monkeypatch):
    """The router compares what each engine holds with the checksums the trainer took of what it
    sent: a trainer whose sums say otherwise (here: one tensor's, changed) fails every engine in
    ``verify`` and none stays in rotation on weights it cannot vouch for."""
    procs, router = fleet
    import pdctl.weights.transaction as transaction

    real = transaction.tensor_checksum
    victim = next(iter(dict(model(seed=43).named_parameters())))
    monkeypatch.setattr(
        transaction, "tensor_checksum", lambda n, t, mode: "0" * 64 if n == victim else real(n, t, mode)
    )
    with sync_for(procs, router, verify="sample") as sync, pytest.raises(WeightSyncError) as err:
        sync.push(list(model(seed=43).named_parameters()), version="unverified")
    report = err.value.report
    assert err.value.phase == "verify" and set(report.failed) == {"e0", "e1", "e2"}, report.failed
    assert all(f"first {victim}" in f.reason for f in report.failed.values())
    assert all(w["quarantined"] for w in workers(router).values())
    monkeypatch.undo()
    push_whole(procs, router, seed=44)


def test_a_load_longer_than_the_framework_lease_ends_whole(tmp_path):
    """The router drives ``pdctl weights load`` itself: no lease runs out under it, however long
    the engines take to load (here 2.5 s each against a 1 s framework lease)."""
    checkpoint = tmp_path / "ckpt"
    save_checkpoint(resolve_model("sim://tiny?seed=9", "auto", None), checkpoint)
    slow = ("--sim-disk-load-ms", "2500")
    specs = [("--disaggregation-mode", role, *slow) for role in ("prefill", "decode")]
    with sims(tmp_path, *specs) as procs:
        lease = ("--framework-lease-secs", "1")
        router = RouterProcess(tmp_path, *pd_router_args(procs[:1], procs[1:], *lease)).start("/readiness")
        try:
            report = Fleet([p.url for p in procs], router_url=router.url).load_from_disk(str(checkpoint), "slow")
            assert len(report.engines) == 2 and not report.failed and not report.skipped, report
            assert not held(router)
            assert {w["weight_version"] for w in workers(router).values()} == {"slow"}
            assert not any(w["quarantined"] for w in workers(router).values())
            status, out = post(router.url + "/generate", {"text": "loaded", **GREEDY})
            assert status == 200 and out["meta_info"]["weight_version"] == "slow", out
        finally:
            router.stop()
