"""Weight updates over a real gloo group: this test is trainer rank 0, sims are the engines."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch
import torch.distributed as dist

from pdctl.sglang import init_weights_update_group_body, update_weights_from_distributed_body
from pdctl.sglang.group import destroy_group, init_custom_process_group
from pdctl.sim import resolve_model, save_checkpoint, weights_checksum
from pdctl.sim.model import TinyLM, encode
from tests.helpers import eventually, free_port, get, post, sims

GROUP = "weight_update_group"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A tp-1 sim and a tp-2 sim (one helper rank): 1 + 1 + 2 = world size 4."""
    with sims(tmp_path_factory.mktemp("w"), (), ("--tp-size", "2")) as procs:
        yield procs


def join_group(engines, offsets, world):
    port = free_port()
    with cf.ThreadPoolExecutor(len(engines)) as pool:
        futs = [
            pool.submit(
                post,
                e.url + "/init_weights_update_group",
                init_weights_update_group_body(
                    master_address="127.0.0.1", master_port=port, rank_offset=o, world_size=world, backend="gloo"
                ),
            )
            for e, o in zip(engines, offsets, strict=True)
        ]
        group = init_custom_process_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=port,
            world_size=world,
            rank=0,
            group_name=GROUP,
            timeout_secs=60,
        )
        for f in futs:
            status, out = f.result()
            assert status == 200 and out["success"], out
    return group


def push(engines, group, tensors, *, version=None, load_format=None):
    """One update: HTTP to every engine concurrently with the broadcasts, in names order."""
    body = update_weights_from_distributed_body(
        names=[n for n, _ in tensors],
        dtypes=[str(t.dtype).replace("torch.", "") for _, t in tensors],
        shapes=[list(t.shape) for _, t in tensors],
        weight_version=version,
        load_format=load_format,
    )
    with cf.ThreadPoolExecutor(len(engines)) as pool:
        futs = [pool.submit(post, e.url + "/update_weights_from_distributed", body) for e in engines]
        if load_format == "flattened_bucket":
            flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in tensors])
            dist.broadcast(flat, src=0, group=group)
        else:
            for h in [dist.broadcast(t.contiguous(), src=0, group=group, async_op=True) for _, t in tensors]:
                h.wait()
        return [f.result() for f in futs]


def reference_greedy(model: TinyLM, prompt: str, n: int) -> list[int]:
    ids = encode(prompt)
    out = []
    for _ in range(n):
        logits, _ = model.prefill(ids + out)
        out.append(int(torch.argmax(logits[-1])))
    return out


def test_update_changes_the_model_exactly(engines) -> None:
    group = join_group(engines, offsets=[1, 2], world=4)
    try:
        for e in engines:
            assert post(e.url + "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []})[1][
                "message"
            ].startswith("update_weights_from_distributed must run between begin_weight_update()")
            assert post(e.url + "/begin_weight_update", {"selector": "all"})[1]["success"]
            assert "already open" in post(e.url + "/begin_weight_update", {})[1]["message"]
        new = resolve_model("sim://tiny?seed=123", "auto", None)
        # Sent as float32 in two buckets, the second flattened: what a trainer does.
        tensors = [(n, p.to(torch.float32)) for n, p in new.named_parameters()]
        half = len(tensors) // 2
        for status, out in push(engines, group, tensors[:half]):
            assert status == 200 and out["success"], out
        for status, out in push(engines, group, tensors[half:], version="v1", load_format="flattened_bucket"):
            assert status == 200 and out["success"], out
        for e in engines:
            assert post(e.url + "/end_weight_update", {})[1]["success"]
        reference = resolve_model("sim://tiny", "auto", None)
        reference.load_weights(tensors)
        expected = weights_checksum(reference)
        for e in engines:
            status, out = post(e.url + "/weights_checker", {"action": "checksum"})
            assert out["checksums"] == expected and out["weight_version"] == "v1"
            assert get(e.url + "/model_info")[1]["weight_version"] == "v1"
            name = "model.layers.0.self_attn.q_proj.weight"
            read = post(e.url + "/get_weights_by_name", {"name": name, "truncate_size": 2})[1]
            assert torch.tensor(read, dtype=torch.float32).equal(dict(tensors)[name][:2])
            _, gen = post(
                e.url + "/generate",
                {
                    "text": "after the push",
                    "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
                },
            )
            assert gen["output_ids"] == reference_greedy(reference, "after the push", 12)
            assert gen["meta_info"]["weight_version"] == "v1"
    finally:
        for e in engines:
            post(e.url + "/destroy_weights_update_group", {"group_name": GROUP})
        destroy_group(group)


def test_flattened_bucket_alignment_rule(engines) -> None:
    group = join_group(engines[:1], offsets=[1], world=2)
    try:
        post(engines[0].url + "/begin_weight_update", {})
        bad = [
            ("model.norm.weight", torch.ones(63, dtype=torch.float16)),
            ("model.layers.0.input_layernorm.weight", torch.ones(64, dtype=torch.float32)),
        ]
        ((status, out),) = push(engines[:1], group, bad, load_format="flattened_bucket")
        assert status == 400 and "Unaligned received tensor" in out["message"]
        unknown = [("model.nope", torch.ones(4))]
        ((status, out),) = push(engines[:1], group, unknown)
        assert status == 400 and "unknown parameter 'model.nope'" in out["message"]
        post(engines[0].url + "/end_weight_update", {})
    finally:
        post(engines[0].url + "/destroy_weights_update_group", {})
        destroy_group(group)


def test_group_errors_are_clear(engines) -> None:
    status, out = post(engines[0].url + "/init_weights_update_group", {"master_address": "127.0.0.1"})
    assert status == 400 and not out["success"] and "master_port" in out["message"]
    status, out = post(
        engines[1].url + "/init_weights_update_group",
        init_weights_update_group_body(
            master_address="127.0.0.1", master_port=1, rank_offset=3, world_size=4, backend="gloo"
        ),
    )
    assert status == 400 and "do not fit world_size 4" in out["message"]
    status, out = post(engines[0].url + "/destroy_weights_update_group", {})  # SGLang's answer, to the letter
    assert (status, out) == (400, {"success": False, "message": "The group to be destroyed does not exist."})
    status, out = post(engines[0].url + "/destroy_weights_update_group")  # an empty body: the default group
    assert status == 400 and out["message"] == "The group to be destroyed does not exist."


def test_update_from_disk_and_version(engines, tmp_path) -> None:
    model = resolve_model("sim://tiny?seed=9", "auto", None)
    save_checkpoint(model, tmp_path / "ckpt")
    e = engines[0]
    status, out = post(
        e.url + "/update_weights_from_disk", {"model_path": str(tmp_path / "ckpt"), "weight_version": "disk"}
    )
    assert status == 200 and out["success"], out
    assert post(e.url + "/weights_checker", {})[1]["checksums"] == weights_checksum(model)
    status, out = post(e.url + "/update_weight_version", {"new_version": "v9"})
    assert out["new_version"] == "v9" and get(e.url + "/model_info")[1]["weight_version"] == "v9"
    assert post(e.url + "/update_weights_from_disk", {"model_path": "/nonexistent"})[0] == 400


def test_flush_cache_fails_the_update_while_requests_run(tmp_path) -> None:
    """SGLang: with flush_cache true (the default) an update made while requests still run (paused
    in place) loads the weights but reports the cache as not flushed."""
    with sims(tmp_path, ("--sim-decode-ms-per-step", "20")) as (engine,):
        group = join_group([engine], offsets=[1], world=2)
        try:
            with cf.ThreadPoolExecutor(1) as pool:
                running = pool.submit(
                    post,
                    engine.url + "/generate",
                    {"text": "long", "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}},
                )

                def runs() -> bool:
                    if get(engine.url + "/server_info")[1]["internal_states"][0]["num_running_reqs"] >= 1:
                        return True
                    assert not running.done(), running.result()  # (it must run when the update comes)
                    return False

                eventually(runs, 60, interval=0.01, what="the request running")
                post(engine.url + "/pause_generation", {"mode": "in_place"})
                post(engine.url + "/begin_weight_update", {})
                new = resolve_model("sim://tiny?seed=77", "auto", None)
                tensors = [(n, p.to(torch.float32)) for n, p in new.named_parameters()][:2]
                body = update_weights_from_distributed_body(
                    names=[n for n, _ in tensors],
                    dtypes=["float32"] * 2,
                    shapes=[list(t.shape) for _, t in tensors],
                    flush_cache=True,
                )
                with cf.ThreadPoolExecutor(1) as p2:
                    fut = p2.submit(post, engine.url + "/update_weights_from_distributed", body)
                    for _, t in tensors:
                        dist.broadcast(t.contiguous(), src=0, group=group)
                    status, out = fut.result()
                assert status == 400 and "the cache was not flushed" in out["message"]
                post(engine.url + "/end_weight_update", {})
                post(engine.url + "/continue_generation", {})
                assert running.result()[0] == 200
            sums = post(engine.url + "/weights_checker", {})[1]["checksums"]
            reference = resolve_model("sim://tiny", "auto", None)
            reference.load_weights(tensors)
            assert sums[tensors[0][0]] == weights_checksum(reference)[tensors[0][0]]  # loaded all the same
        finally:
            post(engine.url + "/destroy_weights_update_group", {})
            destroy_group(group)


def test_rank_digest_sees_every_byte_order_and_size() -> None:
    """The digest TP ranks compare: equal for equal data in other buffers, different when any one
    byte, the order, a name or a size differs (every position is tried for a small tensor)."""
    from pdctl.sim.weights import checksum

    base = [("a", torch.arange(1000, dtype=torch.float64)), ("b", torch.arange(37, dtype=torch.bfloat16))]
    copy = [(n, t.clone()) for n, t in base]
    assert checksum(base) == checksum(copy)
    flat = torch.cat([t.view(-1).view(torch.uint8) for _, t in base])  # the flattened_bucket layout
    views = [("a", flat[:8000].view(torch.float64)), ("b", flat[8000:].view(torch.bfloat16))]
    assert checksum(views) == checksum(base)
    seen = {checksum(base)}
    for i in range(flat.numel()):
        changed = flat.clone()
        changed[i] ^= 1
        seen.add(checksum([("a", changed[:8000].view(torch.float64)), ("b", changed[8000:].view(torch.bfloat16))]))
    assert len(seen) == flat.numel() + 1
    assert checksum(base[::-1]) != checksum(base)
    assert checksum([("c", base[0][1]), base[1]]) != checksum(base)
    assert checksum([(base[0][0], base[0][1][:-1]), base[1]]) != checksum(base)
    # sample: the same for equal data, and still sees order, names, sizes and each tensor's ends
    assert checksum(views, "sample") == checksum(base, "sample") != checksum(base[::-1], "sample")
    assert checksum([("c", base[0][1]), base[1]], "sample") != checksum(base, "sample")
    big = torch.arange(100_000, dtype=torch.float64)
    for index in (0, 99_999):
        changed = big.clone()
        changed[index] += 1
        assert checksum([("w", changed)], "sample") != checksum([("w", big)], "sample")


def test_a_model_serves_fewer_positions_than_its_table(tmp_path) -> None:
    """``context_length`` below ``max_positions`` (refit_stall's big checkpoint): the engine serves
    and limits by the context, the whole table still loads, and --context-length cannot exceed it."""
    from dataclasses import replace

    from pdctl.sim.model import PRESETS, SimError

    config = replace(PRESETS["tiny"], max_positions=8192, context_length=64)
    save_checkpoint(TinyLM(config), tmp_path / "big")
    model = resolve_model(str(tmp_path / "big"), "auto", None)
    assert model.config.context == 64 and model.model["embed_positions"].weight.shape[0] == 8192
    assert resolve_model(str(tmp_path / "big"), "auto", 32).config.context == 32
    with pytest.raises(SimError, match="exceeds the model's 8192 positions"):
        resolve_model(str(tmp_path / "big"), "auto", 9000)
    with sims(tmp_path, ("--model-path", str(tmp_path / "big"))) as (engine,):
        status, out = post(engine.url + "/generate", {"input_ids": [65] * 40})  # no max_new_tokens: up to the context
        assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 24}, out
        body = {"input_ids": [65] * 40, "sampling_params": {"max_new_tokens": 100}}
        status, out = post(engine.url + "/generate", body)
        assert status == 400 and "exceeds the model's maximum context length of 64" in str(out), out  # as SGLang
        status, out = post(engine.url + "/generate", {"input_ids": [65] * 65, "sampling_params": {"max_new_tokens": 1}})
        assert status == 400, out


def test_a_corrupt_checkpoint_is_refused_with_sglangs_answer_and_no_traceback(engines, tmp_path) -> None:
    """Found by a probe: a corrupt model.safetensors gave a traceback in the engine's log and the
    client a bare 500. Refused as SGLang refuses a load it cannot do: 400 ``{"success": false}``,
    the old weights kept."""
    e = engines[0]
    before = post(e.url + "/weights_checker", {"action": "checksum"})[1]["checksum"]
    save_checkpoint(resolve_model("sim://tiny?seed=3", "auto", None), tmp_path / "bad")
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"not a safetensors file")
    status, out = post(e.url + "/update_weights_from_disk", {"model_path": str(tmp_path / "bad")})
    assert status == 400 and out["success"] is False and "SafetensorError" in out["message"], out
    assert post(e.url + "/weights_checker", {"action": "checksum"})[1]["checksum"] == before
    assert "Traceback" not in e.log.read_text()
