"""AReaL 1.0.4's own client, unmodified, driving a pdctl fleet through its router: run by
.venv-areal's interpreter (scripts/areal-venv.sh), never pdctl's (AReaL is not a pdctl dependency).

    areal_driver.py ROUTER_HOST:PORT ALLOCATION WORKDIR

What AReaL's trainer does around a rollout load, in its own calls (``RemoteSGLangEngine`` and the
sequence of ``areal/engine/fsdp_engine.py``): concurrent ``agenerate`` calls (logprobs, AReaL's
abort-and-resubmit loop); a disk update (``pause_generation``, ``update_weights_from_disk`` waiting
on its name_resolve key, ``continue_generation``); a distributed update (``init_weights_update_group``
beside rank 0's own ``init_custom_process_group``, ``pause_generation``, per bucket
``update_weights_from_distributed`` and rank 0's gloo broadcasts, ``continue_generation``). The
trainer's weights are pdctl's sim model of a given seed. Writes ``WORKDIR/result.json``.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import socket
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist
from areal.api.alloc_mode import ModelAllocation
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig
from areal.api.io_struct import ModelRequest, ParamSpec, WeightUpdateMeta
from areal.engine.core.distributed import init_custom_process_group
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.infra.platforms import current_platform
from areal.utils import name_resolve, names

from pdctl.sim.model import resolve_model, save_checkpoint
from tests.helpers import eventually

DISK_SEED, PUSH_SEED = 71, 72
BUCKET_BYTES = 64 * 1024  # several buckets for the tiny model, one in flight at a time as AReaL sends them


def main() -> None:
    addr, allocation, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(work / "name_resolve")))
    config = InferenceEngineConfig(
        experiment_name="pdctl", trial_name="facade", setup_timeout=60, backend=allocation, request_timeout=120
    )
    engine = RemoteSGLangEngine(config)
    engine.initialize(addr=[addr])
    result: dict = {"backend": current_platform.communication_backend}

    # -- rollouts: AReaL's agenerate, concurrently, for the whole run ------------------------------------
    stop = threading.Event()
    responses: list = []
    errors: list[str] = []

    async def rollout(i: int) -> None:
        while not stop.is_set():
            prompt = list(f"rollout {i}".encode())
            try:
                gconfig = GenerationHyperparameters(max_new_tokens=160, greedy=True)
                responses.append(await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=gconfig)))
            except Exception as exc:  # a failed rollout: the test fails on any
                errors.append(f"{type(exc).__name__}: {exc}")

    def rollouts() -> None:
        async def all_of() -> None:
            await asyncio.gather(*(rollout(i) for i in range(6)))

        asyncio.run(all_of())

    def at_version(version: int) -> list:
        return [r for r in list(responses) if set(r.output_versions) == {version}]

    load = threading.Thread(target=rollouts, name="rollouts")
    load.start()
    # Rollouts in flight when the first pause comes: one has finished, five are on their way.
    eventually(lambda: responses or errors, 300, what="a first rollout")

    # -- a disk update (fsdp_engine._update_weights_from_disk) ---------------------------------------------
    ckpt = work / "ckpt"
    save_checkpoint(resolve_model(f"sim://tiny?seed={DISK_SEED}", "auto", None), ckpt)
    engine.pause_generation()
    meta = WeightUpdateMeta(type="disk", path=str(ckpt), clear_checkpoint_after_load=False)
    future = engine.update_weights_from_disk(meta)
    name_resolve.add(names.update_weights_from_disk("pdctl", "facade", engine.get_version()), str(time.time()))
    future.result(timeout=120)
    engine.continue_generation()
    engine.set_version(1)
    eventually(lambda: at_version(1) or errors, 300, what="a rollout on the disk update's weights")

    # -- a distributed update (fsdp_engine: init once, then pause, buckets, continue) ------------------------
    alloc = ModelAllocation.from_str(allocation)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    meta = WeightUpdateMeta(
        type="xccl",
        gen_allocation=alloc,
        nccl_master_address="127.0.0.1",
        nccl_master_port=port,
        nccl_group_name="update_weight_group",
    )
    future = engine.init_weights_update_group(meta)
    group = init_custom_process_group(
        backend=current_platform.communication_backend,
        world_size=alloc.parallel.world_size + 1,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        group_name="update_weight_group",
        timeout=datetime.timedelta(seconds=120),
    )
    future.result(timeout=120)
    trainer = resolve_model(f"sim://tiny?seed={PUSH_SEED}", "auto", None)
    named = [(n, p.detach().contiguous()) for n, p in trainer.named_parameters()]
    buckets, bucket, size = [], [], 0
    for name, tensor in named:
        if bucket and size + tensor.numel() * tensor.element_size() > BUCKET_BYTES:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    buckets.append(bucket)
    engine.pause_generation()
    for bucket in buckets:
        specs = [ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).split("torch.")[1]) for n, t in bucket]
        future = engine.update_weights_from_distributed(meta, specs)
        handles = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in bucket]
        for handle in handles:
            handle.wait()
        future.result(timeout=120)
    engine.continue_generation()
    engine.set_version(2)
    eventually(lambda: len(at_version(2)) >= 3 or errors, 300, what="rollouts on the pushed weights")

    stop.set()
    load.join(timeout=300)
    dist.destroy_process_group(group)
    multi = [r for r in responses if len(set(r.output_versions)) > 1]
    result.update(
        rollouts=len(responses),
        errors=errors[:5],
        error_count=len(errors),
        stop_reasons=sorted({r.stop_reason for r in responses}),
        resubmitted=len(multi),
        logprobs_ok=all(len(r.output_logprobs) == len(r.output_tokens) == 160 for r in responses),
        buckets=len(buckets),
        after_push=[[r.input_tokens, r.output_tokens] for r in at_version(2)][:3],
    )
    engine.destroy()
    (work / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
