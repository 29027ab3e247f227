"""A 2-rank FSDP2 trainer for tests (run under torchrun, gloo on CPU): shards a sim model,
pushes it with ``full_tensors`` through ``WeightSync`` on every rank, and writes what it saw."""

from __future__ import annotations

import argparse
import json
import weakref
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from pdctl.sim.model import PRESETS, TinyLM
from pdctl.weights import WeightSync, full_tensors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", required=True, help="JSON list of {id, url, gpus}")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--router", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = TinyLM(replace(PRESETS["tiny"], seed=args.seed))
    for layer in model.model.layers:  # per layer, then the rest: how FSDP2 models are wrapped
        fully_shard(layer)
    fully_shard(model)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())

    # How many gathered tensors are alive at once while the helper is read (one: no second model).
    alive: list[weakref.ref] = []
    most_alive = 0
    for _, tensor in full_tensors(model):
        alive = [r for r in alive if r() is not None]
        most_alive = max(most_alive, len(alive) + 1)
        alive.append(weakref.ref(tensor))
        del tensor

    sync = WeightSync(
        json.loads(args.engines),
        master_address="127.0.0.1",
        master_port=args.port,
        router_url=args.router,
        timeout_secs=60,
        bucket_mb=0.05,
        verify="full",
    )
    with sync:
        report = sync.push(lambda: full_tensors(model), version=f"fsdp-{args.seed}")
    out = {"rank": rank, "sharded": sharded, "most_alive": most_alive, "report": report.to_dict()}
    (args.out / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
