"""What a framework's failed update, a vanished framework and a killed router leave behind, driven
through the router's SGLang control routes as frameworks drive them (tests/weights/framework.py)
against real sim engines: only the engines an update may have changed leave rotation, everything
else serves on, a held fleet says so on every health surface, and nothing stays paused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from pdctl.sim import weights_checksum
from pdctl.sim.model import PRESETS, TinyLM
from tests.helpers import RouterProcess, SimProcess, eventually, get, http, pd_router_args, post, sims
from tests.weights.framework import Load, Trainer

GREEDY = {"sampling_params": {"max_new_tokens": 8, "temperature": 0}}
LEASE = "3"  # --framework-lease-secs of these routers: a vanished framework's transaction ends after it


def model(seed: int) -> TinyLM:
    return TinyLM(replace(PRESETS["tiny"], seed=seed))


def checksums(proc: SimProcess) -> dict:
    return post(proc.url + "/weights_checker", {"action": "checksum"})[1]["checksums"]


def workers(router: RouterProcess) -> dict[str, dict]:
    return {w["url"]: w for w in get(router.url + "/workers")[1]["workers"]}


def version_of(proc: SimProcess) -> str:
    return get(proc.url + "/model_info")[1]["weight_version"]


def in_rotation(router: RouterProcess, *procs: SimProcess) -> bool:
    state = workers(router)
    return all(state[p.url]["is_healthy"] and not state[p.url]["quarantined"] for p in procs)


def reason_phrase(url: str, body: dict) -> tuple[int, str]:
    """The status and the reason phrase of the status line (what AReaL prints of a failure)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.reason
    except urllib.error.HTTPError as exc:
        return exc.code, exc.reason


@pytest.fixture
def fleet(tmp_path):
    """prefill tp 1, decode tp 2, decode tp 1 (world 1 + 4), a router that ends a silent
    framework's transaction after LEASE seconds and keeps its state in a file."""
    # A rank left in a broadcast whose trainer died waits this long (SGLang: torch's 30 minutes).
    timeout = ("--sim-weight-group-timeout-secs", "10")
    specs = [
        ("--disaggregation-mode", "prefill", *timeout),
        ("--disaggregation-mode", "decode", "--tp-size", "2", *timeout),
        ("--disaggregation-mode", "decode", *timeout),
    ]
    with sims(tmp_path, *specs) as procs:
        router = router_of(tmp_path, procs).start("/readiness")
        try:
            yield procs, router
        finally:
            router.stop()


def router_of(tmp_path: Path, procs: list[SimProcess]) -> RouterProcess:
    return RouterProcess(
        tmp_path,
        *pd_router_args(procs[:1], procs[1:], "--policy", "round_robin", "--health-check-interval-secs", "1"),
        "--framework-lease-secs", LEASE, "--state-file", str(tmp_path / "router-state.json"),
    )  # fmt: skip


def names_of(params: list, *picks: int) -> dict:
    named = [params[i] for i in picks]
    return {
        "names": [n for n, _ in named],
        "dtypes": [str(t.dtype).split(".")[1] for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
    }


def test_an_update_refused_before_any_weight_moved_changes_nothing(fleet):
    """Unknown names, then a wrong shape, as a framework's first bucket: every engine refuses
    before its model is touched; no engine leaves rotation, each keeps its checksums and version,
    the clients see no failure, and the refusal's message is the reason phrase AReaL prints."""
    procs, router = fleet
    before = {p.url: checksums(p) for p in procs}
    versions = {p.url: version_of(p) for p in procs}
    params = list(model(seed=71).named_parameters())
    trainer = Trainer(router.url, 5, group_name="g")
    try:
        assert trainer.init()[0] == 200
        with Load(router.url, max_new_tokens=16) as load:
            assert post(router.url + "/pause_generation", {})[0] == 200
            bogus = [("bogus.a", params[0][1])]
            status, out = trainer.bucket(bogus)
            assert status == 400 and "unknown parameter 'bogus.a'" in out["message"], out
            assert "never changed and serve on" in out["message"] and "may hold part" not in out["message"], out
            # The transaction is over: the framework's continue (AReaL sends none after a failure) is a no-op.
            assert post(router.url + "/continue_generation", {})[0] == 200
            (name, tensor) = params[1]
            status, out = trainer.bucket([(name, tensor.reshape(-1)[:3].clone())])  # a shape the model does not have
            assert status == 400 and "shape" in out["message"], out
            eventually(lambda: load.answers >= 8, 60, what="answers after the refusals")
        assert not load.failures, load.failures[:3]
    finally:
        trainer.close()
    state = workers(router)
    assert not any(w["quarantined"] for w in state.values()), state
    for p in procs:
        assert checksums(p) == before[p.url] and version_of(p) == versions[p.url], p.url
    assert get(router.url + "/pdctl/weights")[1]["last_push"]["state"] == "failed"
    # AReaL prints `status=400, message='<reason phrase>'`: the phrase says why.
    body = {"names": ["bogus.b"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nowhere"}
    status, phrase = reason_phrase(router.url + "/update_weights_from_distributed", body)
    assert status == 400 and "Group nowhere not in" in phrase, phrase


def test_a_decode_killed_before_the_first_bucket_leaves_the_others_serving(fleet, tmp_path):
    """The framework paused; decode tp 1 dies; the first bucket is refused at once naming it and
    nothing is sent to anyone: the prefill and the other decode never changed, so they serve on
    (no client fails). Its supervisor's restart (here: the test's) and the framework's retried
    update over a new group bring every engine to the new weights with no `pdctl restart`."""
    procs, router = fleet
    prefill, decode2, decode1 = procs
    params = list(model(seed=72).named_parameters())
    trainer = Trainer(router.url, 5, group_name="k")
    try:
        assert trainer.init()[0] == 200
        with Load(router.url, max_new_tokens=16) as load:
            assert post(router.url + "/pause_generation", {})[0] == 200
            os.killpg(decode1.proc.pid, signal.SIGKILL)
            decode1.proc.wait()
            status, out = trainer.pool.submit(
                post, router.url + "/update_weights_from_distributed", {**names_of(params, 0, 1), "group_name": "k"}
            ).result()
            assert status == 400 and decode1.url in out["message"] and "nothing was sent" in out["message"], out
            assert "never changed and serve on" in out["message"], out
            answered = load.answers
            eventually(lambda: load.answers >= answered + 8, 60, what="answers from the engines that never changed")
        assert not load.failures, load.failures[:3]
        assert in_rotation(router, prefill, decode2)
    finally:
        trainer.close()
    restarted = SimProcess(tmp_path, *decode1.args, port=decode1.port, name="restarted").start()
    procs[2] = restarted
    assert post(router.url + "/destroy_weights_update_group", {"group_name": "k"})[0] == 200
    retry = Trainer(router.url, 5, group_name="k")
    try:
        assert retry.init()[0] == 200
        assert post(router.url + "/pause_generation", {})[0] == 200
        assert all(a[0] == 200 for a in retry.push(params))
        assert post(router.url + "/continue_generation", {})[0] == 200
    finally:
        retry.close()
    expected = weights_checksum(model(seed=72))
    assert all(checksums(p) == expected for p in procs)
    eventually(
        lambda: in_rotation(router, *procs), 30, interval=0.2, what=lambda: f"all in rotation: {workers(router)}"
    )


def test_a_decode_killed_between_buckets_takes_out_only_what_the_update_changed(fleet, tmp_path):
    """After one bucket every engine holds part of the update: they leave rotation labelled
    pdctl:partial, the transaction ends at once (nothing stays held: the readiness names the
    missing roles, not a hold) and a retried update makes them whole."""
    procs, router = fleet
    prefill, decode2, decode1 = procs
    params = list(model(seed=73).named_parameters())
    trainer = Trainer(router.url, 5, group_name="k")
    try:
        assert trainer.init()[0] == 200
        assert post(router.url + "/pause_generation", {})[0] == 200
        assert trainer.bucket(params[:2])[0] == 200
        os.killpg(decode1.proc.pid, signal.SIGKILL)
        decode1.proc.wait()
        status, out = trainer.pool.submit(
            post, router.url + "/update_weights_from_distributed", {**names_of(params, 2, 3), "group_name": "k"}
        ).result()
        assert status == 400 and "may hold part of it" in out["message"], out
    finally:
        trainer.close()
    state = workers(router)
    for p in (prefill, decode2):
        assert "holds part of weight update" in (state[p.url]["quarantined"] or ""), state
        assert version_of(p).startswith("pdctl:partial:")
    status, ready = get(router.url + "/readiness")
    assert status == 503 and "held by" not in ready.get("reason", ""), ready
    restarted = SimProcess(tmp_path, *decode1.args, port=decode1.port, name="restarted").start()
    procs[2] = restarted
    assert post(router.url + "/destroy_weights_update_group", {"group_name": "k"})[0] == 200
    retry = Trainer(router.url, 5, group_name="k")
    try:
        assert retry.init()[0] == 200
        assert post(router.url + "/pause_generation", {})[0] == 200
        assert all(a[0] == 200 for a in retry.push(params))
        assert post(router.url + "/continue_generation", {})[0] == 200
    finally:
        retry.close()
    expected = weights_checksum(model(seed=73))
    assert all(checksums(p) == expected for p in procs)
    eventually(
        lambda: in_rotation(router, *procs), 30, interval=0.2, what=lambda: f"all in rotation: {workers(router)}"
    )
    assert post(router.url + "/generate", {"text": "whole again", **GREEDY})[0] == 200


TRAINER_DIES = """
import os, signal, sys, time
import torch, torch.distributed as dist
from tests.helpers import get, post
from tests.weights.framework import Trainer

router, params = sys.argv[1], torch.load(sys.argv[2])
trainer = Trainer(router, 5, group_name="doomed")
assert trainer.init()[0] == 200, "init"
(a, ta), (b, tb) = params
body = {"names": [a, b], "dtypes": [str(t.dtype).split(".")[1] for t in (ta, tb)],
        "shapes": [list(ta.shape), list(tb.shape)], "group_name": "doomed"}
trainer.pool.submit(post, router + "/update_weights_from_distributed", body, timeout=120)
while (get(router + "/pdctl/weights")[1].get("last_push") or {}).get("state") != "pushing":
    time.sleep(0.01)  # until the router has the call (it starts the push record before it forwards it)
dist.broadcast(ta, src=0, group=trainer.group)  # the first tensor only: it dies inside the call
print("sent the first tensor", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_trainer_killed_inside_a_broadcast_leaves_tp2_engines_able_to_take_the_next_update(fleet, tmp_path):
    """kill -9 of the framework's trainer between the two broadcasts of one call: every engine's
    receive fails (the TP-2 decode's helper rank too), they leave rotation, and the next trainer's
    group and whole update succeed on every engine with no restart (the sim read its TP helper's
    late reply as the next command's answer, and every later update failed)."""
    procs, router = fleet
    params = list(model(seed=74).named_parameters())
    saved = tmp_path / "two.pt"
    import torch

    torch.save([(n, t.detach().clone()) for n, t in params[:2]], saved)
    assert post(router.url + "/pause_generation", {})[0] == 200
    dying = subprocess.run(
        [sys.executable, "-c", TRAINER_DIES, router.url, str(saved)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert dying.returncode == -signal.SIGKILL and "sent the first tensor" in dying.stdout, dying.stderr[-2000:]
    eventually(
        lambda: get(router.url + "/pdctl/weights")[1]["last_push"]["state"] == "failed",
        120,
        what=lambda: f"the update failed: {get(router.url + '/pdctl/weights')[1]}",
    )
    assert all(version_of(p).startswith("pdctl:partial:") for p in procs)
    # The framework leaves the broken group before it makes a new one. Its answer is the event to
    # wait for: the TP-2 decode's helper rank, fed in the broadcast through another engine's rank
    # (gloo's tree), waits out the group's timeout before it can leave, and a new group's rendezvous
    # begun meanwhile could close its window without it (seen once in a full suite: the next init's
    # gloo connect timed out). Its late answer to the failed receive comes first, and is not taken
    # for the destroy's.
    assert post(router.url + "/destroy_weights_update_group", {"group_name": "doomed"}, timeout=120)[0] == 200
    trainer = Trainer(router.url, 5, group_name="next")
    try:
        assert trainer.init()[0] == 200
        assert post(router.url + "/pause_generation", {})[0] == 200
        answers = trainer.push(params)
        assert all(a[0] == 200 for a in answers), answers
        assert post(router.url + "/continue_generation", {})[0] == 200
    finally:
        trainer.close()
    expected = weights_checksum(model(seed=74))
    assert all(checksums(p) == expected for p in procs)
    eventually(
        lambda: in_rotation(router, *procs), 30, interval=0.2, what=lambda: f"all in rotation: {workers(router)}"
    )


def test_a_paused_and_vanished_framework_is_said_everywhere_and_ends_by_itself(fleet, tmp_path):
    """A framework pauses and dies: while its pause holds, /readiness and /health_generate answer
    503 naming it and since when, and /pdctl/weights carries it; requests wait, and after the
    lease they are served (nothing left rotation: no weight moved). Its late load from disk (AReaL
    writes the checkpoint between its pause and the load) then runs as a transaction of its own."""
    procs, router = fleet
    assert post(router.url + "/pause_generation", {"mode": "retract"})[0] == 200
    status, ready = get(router.url + "/readiness")
    assert status == 503 and "held by a framework's pause" in ready["reason"] and "since" in ready["reason"], ready
    status, out = get(router.url + "/health_generate")
    assert status == 503 and "held by a framework's pause" in out["error"]["message"], out
    hold = get(router.url + "/pdctl/weights")[1]["hold"]
    assert hold["driver"] == "framework" and hold["secs"] >= 0 and "framework's pause" in hold["by"], hold
    assert get(router.url + "/workers")[1]["hold"]["txn"] == hold["txn"]
    status, out = post(router.url + "/generate", {"text": "held", **GREEDY}, timeout=60)
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length", out
    assert get(router.url + "/readiness")[0] == 200
    assert not any(w["quarantined"] for w in workers(router).values())
    from pdctl.sim.model import save_checkpoint

    save_checkpoint(model(seed=75), tmp_path / "late")
    status, out = post(router.url + "/update_weights_from_disk", {"model_path": str(tmp_path / "late")})
    assert status == 200, out
    assert post(router.url + "/continue_generation", {})[0] == 200
    expected = weights_checksum(model(seed=75))
    assert all(checksums(p) == expected for p in procs)
    assert post(router.url + "/generate", {"text": "after", **GREEDY})[0] == 200


def test_released_memory_is_read_as_sglang_reads_it_and_bounded_like_a_pause(fleet):
    """/release_memory_occupation: a missing body and tags that are no list are refused as
    SGLang refuses them, unknown keys ignored as SGLang ignores them (all memory released); the
    router holds requests meanwhile and says so; a second release and a resume of what is not
    released are refused (each would end an SGLang engine); a framework that dies with the
    memory released gets it back after the lease, and requests flow."""
    _procs, router = fleet
    status, out = http("POST", router.url + "/release_memory_occupation")
    assert status == 400 and "Field required" in out["error"]["message"], out
    assert post(router.url + "/release_memory_occupation", {"tags": "weights"})[0] == 400
    assert post(router.url + "/resume_memory_occupation", {"tags": ["weights"]})[0] == 400  # nothing released
    assert post(router.url + "/release_memory_occupation", {"bogus": 1}) == (200, None)
    status, ready = get(router.url + "/readiness")
    assert status == 503 and "memory released" in ready["reason"], ready
    status, out = post(router.url + "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 400 and "already released" in out["error"]["message"], out
    status, out = post(router.url + "/generate", {"text": "after the lease", **GREEDY}, timeout=60)
    assert status == 200, out
    assert get(router.url + "/readiness")[0] == 200
    # And a framework that resumes what it released ends the hold itself.
    assert post(router.url + "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert post(router.url + "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert get(router.url + "/readiness")[0] == 200 and get(router.url + "/pdctl/weights")[1]["hold"] is None


def test_a_router_killed_during_a_pause_or_an_update_ends_them_when_it_starts(fleet, tmp_path):
    """SIGKILL of the router while a framework's pause holds: the router that starts on the same
    state file continues the engines its predecessor paused, and serves at once. Killed again
    inside an update: the engines that took part stay out (their pdctl:updating label), their
    update sessions are closed (a new update can open one), and a whole update brings them back."""
    procs, router = fleet
    assert post(router.url + "/pause_generation", {})[0] == 200
    os.killpg(router.proc.pid, signal.SIGKILL)
    router.proc.wait()
    second = router_of(tmp_path, procs).start()
    try:
        status, out = post(second.url + "/generate", {"text": "served", **GREEDY}, timeout=30)
        assert status == 200, out  # held engines would not answer within the router's worker wait
        assert json.loads((tmp_path / "router-state.json").read_text()).get("transaction") is None
        params = list(model(seed=76).named_parameters())
        trainer = Trainer(second.url, 5, group_name="u")
        try:
            assert trainer.init()[0] == 200
            assert post(second.url + "/pause_generation", {})[0] == 200
            assert trainer.bucket(params[:2])[0] == 200
            os.killpg(second.proc.pid, signal.SIGKILL)
            second.proc.wait()
        finally:
            trainer.close()
        third = router_of(tmp_path, procs).start()
        try:
            eventually(
                lambda: all("part of weight update" in (w["quarantined"] or "") for w in workers(third).values()),
                30,
                what=lambda: f"every engine out for its partial update: {workers(third)}",
            )
            again = Trainer(third.url, 5, group_name="v")
            try:
                assert again.init()[0] == 200
                assert post(third.url + "/pause_generation", {})[0] == 200
                assert all(a[0] == 200 for a in again.push(params))  # begin_weight_update: no session left open
                assert post(third.url + "/continue_generation", {})[0] == 200
            finally:
                again.close()
            eventually(lambda: in_rotation(third, *procs), 30, interval=0.2, what=lambda: f"{workers(third)}")
            assert post(third.url + "/generate", {"text": "whole", **GREEDY})[0] == 200
        finally:
            third.stop()
    finally:
        second.stop()
