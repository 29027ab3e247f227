"""AReaL 1.0.4's own client, unmodified, through an engine killed in the middle of its distributed
update: run by .venv-areal's interpreter (scripts/areal-venv.sh).

    areal_kill_driver.py ROUTER_HOST:PORT ALLOCATION WORKDIR

AReaL's calls as its trainer makes them (``areal/engine/fsdp_engine.py``): init the group beside rank
0's own, pause, the first bucket; then it writes WORKDIR/bucket-1 and waits for WORKDIR/killed (the
test kills a decode), sends the second bucket and records what AReaL raised (it raises without a
continue). Then it waits for WORKDIR/back (the decode restarted) and retries as a trainer would:
the group joined again (AReaL has no destroy; same name), pause, every bucket, continue. Writes
WORKDIR/result.json.
"""

from __future__ import annotations

import datetime
import json
import socket
import sys
from pathlib import Path

import torch.distributed as dist
from areal.api.alloc_mode import ModelAllocation
from areal.api.cli_args import InferenceEngineConfig
from areal.api.io_struct import ParamSpec, WeightUpdateMeta
from areal.engine.core.distributed import init_custom_process_group
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.infra.platforms import current_platform

from pdctl.sim.model import resolve_model
from tests.helpers import eventually

SEED = 73
BUCKET_BYTES = 64 * 1024


def wait_for(path: Path) -> None:
    """The test's signal: a file it writes when it has done its part (bounded: a test that died
    must not leave this waiting)."""
    eventually(path.exists, 300, what=f"the test's {path.name}")


def joined(engine: RemoteSGLangEngine, alloc: ModelAllocation, name: str) -> tuple[WeightUpdateMeta, object]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    meta = WeightUpdateMeta(
        type="xccl", gen_allocation=alloc, nccl_master_address="127.0.0.1", nccl_master_port=port, nccl_group_name=name
    )
    future = engine.init_weights_update_group(meta)
    group = init_custom_process_group(
        backend=current_platform.communication_backend, world_size=alloc.parallel.world_size + 1,
        init_method=f"tcp://127.0.0.1:{port}", rank=0, group_name=name, timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    future.result(timeout=120)
    return meta, group


def send(engine: RemoteSGLangEngine, meta: WeightUpdateMeta, group: object, bucket: list) -> None:
    """One bucket as AReaL's trainer sends it: the update call, rank 0's broadcasts, their wait, the answer."""
    specs = [ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).split("torch.")[1]) for n, t in bucket]
    future = engine.update_weights_from_distributed(meta, specs)
    handles = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in bucket]
    for handle in handles:
        handle.wait()
    future.result(timeout=120)


def main() -> None:
    addr, allocation, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    config = InferenceEngineConfig(
        experiment_name="pdctl", trial_name="kill", setup_timeout=60, backend=allocation, request_timeout=120
    )
    engine = RemoteSGLangEngine(config)
    engine.initialize(addr=[addr])
    alloc = ModelAllocation.from_str(allocation)
    trainer = resolve_model(f"sim://tiny?seed={SEED}", "auto", None)
    named = [(n, p.detach().contiguous()) for n, p in trainer.named_parameters()]
    buckets, bucket, size = [], [], 0
    for name, tensor in named:
        if bucket and size + tensor.numel() * tensor.element_size() > BUCKET_BYTES:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    buckets.append(bucket)
    result: dict = {"buckets": len(buckets)}

    meta, group = joined(engine, alloc, "update_weight_group")
    engine.pause_generation()
    send(engine, meta, group, buckets[0])
    (work / "bucket-1").write_text("sent")
    wait_for(work / "killed")
    try:
        send(engine, meta, group, buckets[1])
        result["raised"] = None
    except Exception as exc:  # AReaL raises here; its trainer's step fails and it sends no continue
        result["raised"] = f"{type(exc).__name__}: {exc}"

    wait_for(work / "back")
    dist.destroy_process_group(group)  # the trainer's side of the group the failure left (torch keeps names unique)
    meta, group = joined(engine, alloc, "update_weight_group")  # its retry: the same name, a new group
    engine.pause_generation()
    for bucket in buckets:
        send(engine, meta, group, bucket)
    engine.continue_generation()
    result["retried"] = True
    dist.destroy_process_group(group)
    engine.destroy()
    (work / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
