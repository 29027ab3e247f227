"""The colocated data plane on real processes (CPU, gloo): a sim engine loads pdctl's hooks through
``--forward-hooks`` exactly as the plan writes them, trainer ranks are separate processes that
take steps with ``DataPlane.recv``. What a trainer rank receives must equal, bit for bit, the
hidden states the same engine returns over HTTP (``return_hidden_states``) for its shard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pdctl.colocate.env import DATA_PLANE_ENV, DataPlaneSpec, EngineRanks, hook_specs
from pdctl.colocate.world import join
from pdctl.plan.argv import POSITIONS_MODULE
from pdctl.sim.model import encode, resolve_model
from tests.helpers import SimProcess, eventually, free_port, post

RECEIVER = Path(__file__).with_name("receiver.py")
REPO = Path(__file__).resolve().parents[2]


def plane(
    tp: int, *, batch_size: int, aux: tuple[int, ...] = (), timeout: float = 120, dtype: str | None = None
) -> DataPlaneSpec:
    return DataPlaneSpec(
        master_address="127.0.0.1",
        master_port=free_port(),
        trainer_ranks=tp,
        engines=(EngineRanks(id="regular-0", tp=tp, first_rank=tp),),
        backend="gloo",
        batch_size=batch_size,
        aux_layers=aux,
        timeout_secs=timeout,
        dtype=dtype,
    )


class Colocated:
    """One sim engine of TP ``spec``'s and one receiver process per trainer rank."""

    def __init__(self, tmp: Path, spec: DataPlaneSpec, steps: int, *, linger: bool = False):
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp, self.spec, self.steps, self.linger = tmp, spec, steps, linger
        env = {DATA_PLANE_ENV: spec.to_json(), "PYTHONPATH": str(REPO)}
        self.receivers = [
            subprocess.Popen(
                [sys.executable, str(RECEIVER), str(steps), str(tmp / f"rank{r}.pt"), str(r)]
                + (["--linger"] if linger else []),
                stdin=subprocess.PIPE if linger else None,
                env={**os.environ, **env},
                stdout=(tmp / f"rank{r}.log").open("w"),
                stderr=subprocess.STDOUT,
            )
            for r in range(spec.trainer_ranks)
        ]
        hooks = hook_specs("regular-0", positions_module=POSITIONS_MODULE["sim"], aux_layers=spec.aux_layers)
        tp = spec.engines[0].tp
        args = ["--tp-size", str(tp), "--forward-hooks", json.dumps(hooks), "--disable-radix-cache",
                "--enable-return-hidden-states", "--skip-server-warmup"]  # fmt: skip
        self.engine = SimProcess(tmp, *args, env=env)

    def __enter__(self) -> Colocated:
        try:
            self.engine.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def received(self, rank: int, timeout: float = 120) -> list[dict]:
        """What trainer rank ``rank`` saved: once it ended (or, lingering, once it saved)."""
        out = self.tmp / f"rank{rank}.pt"
        if not self.linger:
            self.receivers[rank].wait(timeout=timeout)

        def saved() -> bool:
            if out.exists():
                return True
            assert self.receivers[rank].poll() is None, f"rank {rank} saved nothing"
            return False

        eventually(saved, timeout, what=f"rank {rank} saving what it received")
        return torch.load(out)

    def __exit__(self, *_exc: object) -> None:
        self.engine.stop()
        for proc in self.receivers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def generate(url: str, text: str, max_new_tokens: int = 2) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "return_hidden_states": True}  # fmt: skip
    status, out = post(url + "/generate", body, timeout=120)
    assert status == 200, out
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_a_trainer_rank_receives_its_shard_bit_for_bit_as_http_returns_it(tmp_path, tp) -> None:
    batch = 2 * tp
    spec = plane(tp, batch_size=batch, aux=(0, 1))
    prompts = [f"prompt {i}: " + "ab" * i for i in range(2 * batch)]  # two steps, lengths all differ
    with Colocated(tmp_path, spec, steps=2) as run:
        answers = [generate(run.engine.url, p) for p in prompts]  # in order: prefill order is request order
        received = [run.received(r) for r in range(tp)]
    model = resolve_model("sim://tiny", "auto", None)
    for rank, steps in enumerate(received):
        assert [s.get("error") for s in steps] == [None, None], steps
        for k, step in enumerate(steps):
            assert (step["step"], step["engine"], step["tp_rank"]) == (k, "regular-0", rank)
            shard = range(k * batch + rank * 2, k * batch + rank * 2 + 2)  # TP rank j: sequences j*B/TP..
            ids = [encode(prompts[i]) for i in shard]
            assert step["input_ids"].tolist() == [t for seq in ids for t in seq]
            assert step["seq_lens"].tolist() == [len(seq) for seq in ids]
            assert step["loss_mask"].tolist() == [m for seq in ids for m in [1] * (len(seq) - 1) + [0]]
            # The prompt's rows of meta_info.hidden_states (then one row per decode step, not sent).
            rows = [answers[i]["meta_info"]["hidden_states"][0] for i in shard]
            http = torch.cat([torch.tensor(r, dtype=torch.float64) for r in rows])
            assert step["hidden"].dtype == torch.float64 and torch.equal(step["hidden"], http)
            # Auxiliary layers: the residual stream after model.layers.0 and .1, as a local copy computes it.
            assert len(step["aux"]) == 2
            for layer, got in zip((0, 1), step["aux"], strict=True):
                want = torch.cat([_layer_output(model, seq, layer) for seq in ids])
                torch.testing.assert_close(got, want)


def _layer_output(model, ids: list[int], layer: int) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    handle = model.model["layers"][layer].register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        model.prefill(ids)
    finally:
        handle.remove()
    return seen[0]


def test_a_hundred_steps_are_each_received_once_in_order(tmp_path) -> None:
    spec = plane(2, batch_size=2)
    steps = 100
    with Colocated(tmp_path, spec, steps=steps) as run:
        for k in range(steps):
            for j in range(2):
                generate(run.engine.url, f"s{k}r{j}", max_new_tokens=1)
        received = [run.received(r) for r in range(2)]
    for rank, got in enumerate(received):
        assert [s["step"] for s in got] == list(range(steps))
        assert [bytes(s["input_ids"].tolist()).decode() for s in got] == [f"s{k}r{rank}" for k in range(steps)]


def test_an_engine_that_dies_mid_step_fails_recv_naming_it(tmp_path) -> None:
    """Step 0 arrives; step 1 never completes (one sequence of two, then the engine is killed):
    every trainer rank's recv fails, naming the engine and its rank, well before the timeout."""
    spec = plane(2, batch_size=2, timeout=600)
    with Colocated(tmp_path, spec, steps=2) as run:
        generate(run.engine.url, "first")
        generate(run.engine.url, "second")
        generate(run.engine.url, "third")  # half of step 1
        assert run.engine.proc is not None
        run.engine.proc.kill()
        received = [run.received(r) for r in range(2)]
    for rank, got in enumerate(received):
        assert got[0]["step"] == 0 and "error" not in got[0]
        error = got[1]
        assert error["engine"] == "regular-0" and error["rank"] == 2 + rank and error["step"] == 1, error
        assert "engine regular-0 TP rank" in error["error"] and "closed the connection" in error["error"], error


def test_a_step_never_sent_times_out_naming_the_engine_rank(tmp_path) -> None:
    spec = plane(1, batch_size=2, timeout=3)
    with Colocated(tmp_path, spec, steps=1) as run:
        generate(run.engine.url, "only one of two")
        got = run.received(0)
    assert got[0]["engine"] == "regular-0" and got[0]["rank"] == 1 and got[0]["step"] == 0
    assert "nothing sent within 3 s" in got[0]["error"], got


def test_an_engine_whose_trainer_is_gone_logs_it_once_and_keeps_serving(tmp_path) -> None:
    spec = plane(1, batch_size=1)
    with Colocated(tmp_path, spec, steps=1) as run:
        generate(run.engine.url, "taken")
        assert run.received(0)[0]["step"] == 0  # the receiver took its one step and exited
        for text in ("nobody takes this", "nor this"):
            answer = generate(run.engine.url, text)  # the step fails at once (connection closed)...
            assert answer["meta_info"]["finish_reason"]["type"] == "length"  # ...the request does not
        log = run.engine.log.read_text()
    assert log.count("data plane of engine regular-0: step 1 to trainer rank 0 failed") == 1, log[-2000:]
    assert "keeps serving" in log


def test_a_step_the_trainer_refuses_fails_on_the_engine_which_keeps_serving(tmp_path) -> None:
    """The trainer rank catches its error (aux_layers [0, 99]: the sim has no layer 99) and lives
    on: the engine must not wait for a ready for as long as it lives (its forward, and every
    request, would hang), but fail the step, say so once, and serve."""
    with Colocated(tmp_path, plane(1, batch_size=1, aux=(0, 99)), steps=1, linger=True) as run:
        generate(run.engine.url, "where is layer 99")  # (hangs while the engine waits)
        got = run.received(0)[0]
        assert "sent 1 auxiliary layer(s)" in got["error"], got
        assert run.receivers[0].poll() is None  # the trainer lives on
        answer = generate(run.engine.url, "and serves on")
        assert answer["meta_info"]["finish_reason"]["type"] == "length"
        log = run.engine.log.read_text()
    assert log.count("trainer rank 0 refused step 0") == 1 and "keeps serving" in log, log[-2000:]


def test_the_dtype_set_is_what_arrives_and_a_missing_aux_layer_is_named(tmp_path) -> None:
    """dtype float32: the sim's float64 rows, cast once on the engine. aux_layers [0, 99]: the sim
    has no layer 99, so its hook matches one module only; the trainer names what is missing."""
    with Colocated(tmp_path / "cast", spec := plane(1, batch_size=1, dtype="float32"), steps=1) as run:
        answer = generate(run.engine.url, "cast me")
        got = run.received(0)[0]
    assert spec.dtype == "float32" and got["hidden"].dtype == torch.float32
    http = torch.tensor(answer["meta_info"]["hidden_states"][0], dtype=torch.float64)
    assert torch.equal(got["hidden"], http.float())
    with Colocated(tmp_path / "aux", plane(1, batch_size=1, aux=(0, 99)), steps=1) as run:
        generate(run.engine.url, "where is layer 99")
        got = run.received(0)[0]
    assert got["step"] == 0 and got["engine"] == "regular-0"
    assert "sent 1 auxiliary layer(s) for aux_layers [0, 99]" in got["error"], got


def test_a_rank_that_joins_later_than_the_step_timeout_still_joins_and_steps_time_out_after_it() -> None:
    """An engine loads its model before it joins: the trainer's join waits for it under the join's
    timeout, not ``timeout_secs`` (it failed after ``timeout_secs``, found with an engine slow to
    start beside other jobs). Operations then time out after ``timeout_secs``."""
    spec = replace(plane(1, batch_size=1, timeout=1), join_timeout_secs=60)
    joined: list = []
    trainer = threading.Thread(target=lambda: joined.append(_join_or_error(spec, 0)))
    trainer.start()
    # Once rank 0's store answers, its group waits for rank 1: joining 2.5 timeouts later is the case.
    dist.TCPStore(spec.master_address, spec.master_port, is_master=False, timeout=timedelta(seconds=60))
    time.sleep(2.5 * spec.timeout_secs)
    engine = _join_or_error(spec, 1)
    trainer.join()
    assert not isinstance(joined[0], BaseException), joined[0]
    assert not isinstance(engine, BaseException), engine
    with pytest.raises(RuntimeError, match=f"Timed out waiting {int(spec.timeout_secs * 1000)}ms"):  # nothing sent
        joined[0].group.recv([torch.empty(1)], 1, 0).wait()


def test_a_rank_that_never_joins_is_named_and_one_that_joins_twice_is_refused() -> None:
    spec = replace(plane(1, batch_size=1), join_timeout_secs=1)
    with pytest.raises(RuntimeError, match="engine regular-0 TP rank 0 did not join within 1 s"):
        join(spec, [0])
    spec = replace(plane(1, batch_size=1), join_timeout_secs=60)
    joined: list = []
    trainer = threading.Thread(target=lambda: joined.append(_join_or_error(spec, 0)))
    trainer.start()
    first = _join_or_error(spec, 1)
    trainer.join()
    assert not isinstance(first, BaseException) and not isinstance(joined[0], BaseException), (first, joined)
    with pytest.raises(RuntimeError, match="engine regular-0 TP rank 0 already joined this union world"):
        join(spec, [1])  # (an engine restarted under a running trainer)


def _join_or_error(spec: DataPlaneSpec, rank: int):
    try:
        return join(spec, [rank])[0]
    except BaseException as exc:  # (a thread's: handed to the test)
        return exc
