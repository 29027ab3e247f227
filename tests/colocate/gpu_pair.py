"""One side of a same-GPU data plane pair for tests/colocate/test_gpu.py.

``python gpu_pair.py engine|trainer PORT BACKEND OUT``: the engine feeds one forward of 4
prompts (CUDA tensors made from a fixed seed on cuda:0) to a ``Producer``; the trainer takes
the step with ``DataPlane.recv`` on cuda:0 and writes what it got (or its DataPlaneError) to OUT."""

from __future__ import annotations

import json
import sys

import torch

from pdctl.colocate.env import DataPlaneSpec, EngineRanks

TOKENS, HIDDEN, BATCH = 64, 256, 4


def expected() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(BATCH * TOKENS, HIDDEN, device="cuda", generator=generator, dtype=torch.bfloat16)
    ids = torch.arange(BATCH * TOKENS, device="cuda") % 1000 + 1
    return ids, hidden


def main() -> None:
    role, port, backend, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.cuda.set_device(0)
    spec = DataPlaneSpec(
        master_address="127.0.0.1",
        master_port=port,
        trainer_ranks=1,
        engines=(EngineRanks(id="gpu-engine", tp=1, first_rank=1),),
        backend=backend,
        batch_size=BATCH,
        timeout_secs=120,
    )
    ids, hidden = expected()
    if role == "engine":
        from pdctl.colocate.engine import Producer

        producer = Producer(spec, "gpu-engine", tp_ranks=[0])
        positions = torch.arange(TOKENS, device="cuda").repeat(BATCH)
        producer.add_forward(ids, positions, hidden)
        torch.cuda.synchronize()
        with open(out, "w") as f:
            json.dump({"failure": producer.failure, "steps_sent": producer.steps_sent}, f)
        return
    from pdctl.colocate.trainer import DataPlane
    from pdctl.errors import DataPlaneError

    try:
        plane = DataPlane(spec, 0, device="cpu" if backend == "gloo" else "cuda:0")
        step = plane.recv()
        torch.cuda.synchronize()
        got = step.hidden.to("cuda")
        result = {
            "equal": bool(torch.equal(got, hidden)),
            "device": str(step.hidden.device),
            "dtype": str(step.hidden.dtype),
            "ids": bool(torch.equal(step.input_ids.to("cuda"), ids)),
        }
    except DataPlaneError as exc:
        result = {"error": str(exc)}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
