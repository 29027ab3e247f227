"""One side of a same-GPU data plane pair for tests/colocate/test_gpu.py.

``python gpu_pair.py engine|trainer PORT BACKEND OUT [DIE_AFTER]``: the engine feeds ``STEPS``
forwards (CUDA tensors made from a fixed seed on cuda:0, float32, sent as bfloat16, with one
auxiliary layer) to a ``Producer``, then exits (at once, without closing anything, after
``DIE_AFTER`` steps where given); the trainer takes as many steps as it can with
``DataPlane.recv`` and writes what it got, and the error that ended it, to OUT."""

from __future__ import annotations

import json
import os
import sys

import torch

from pdctl.colocate.env import DataPlaneSpec, EngineRanks

HIDDEN, BATCH = 256, 4
STEPS = (64, 128, 32)
"""Tokens per sequence of each step: the second outgrows the trainer's buffer, the third fits it."""


def expected(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = STEPS[step]
    generator = torch.Generator(device="cuda").manual_seed(7 + step)
    hidden = torch.randn(BATCH * tokens, HIDDEN, device="cuda", generator=generator)
    aux = torch.randn(BATCH * tokens, HIDDEN, device="cuda", generator=generator)
    ids = (torch.arange(BATCH * tokens, device="cuda") * (step + 1)) % 1000 + 1
    return ids, hidden, aux


def main() -> None:
    role, port, backend, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    die_after = int(sys.argv[5]) if len(sys.argv) > 5 else None
    torch.cuda.set_device(0)
    spec = DataPlaneSpec(
        master_address="127.0.0.1",
        master_port=port,
        trainer_ranks=1,
        engines=(EngineRanks(id="gpu-engine", tp=1, first_rank=1),),
        backend=backend,
        batch_size=BATCH,
        aux_layers=(1,),
        dtype="bfloat16",
        timeout_secs=60,
    )
    if role == "engine":
        from pdctl.colocate.engine import Producer

        producer = Producer(spec, "gpu-engine", tp_ranks=[0])
        for step, tokens in enumerate(STEPS):
            if step == die_after:
                os._exit(3)  # (a crash: no goodbye on any socket)
            ids, hidden, aux = expected(step)
            positions = torch.arange(tokens, device="cuda").repeat(BATCH)
            producer.add_forward(ids, positions, hidden, (aux,))
        torch.cuda.synchronize()
        with open(out, "w") as f:
            json.dump({"failure": producer.failure, "steps_sent": producer.steps_sent}, f)
        return
    from pdctl.colocate.trainer import DataPlane
    from pdctl.errors import DataPlaneError

    plane = DataPlane(spec, 0, device="cpu" if backend == "gloo" else "cuda:0")
    steps, error = [], None
    try:
        for step in range(len(STEPS)):
            got = plane.recv()
            ids, hidden, aux = expected(step)
            steps.append(
                {
                    "step": got.step,
                    "hidden_equal": bool(torch.equal(got.hidden.to("cuda"), hidden.to(torch.bfloat16))),
                    "aux_equal": bool(torch.equal(got.aux[0].to("cuda"), aux.to(torch.bfloat16))),
                    "ids_equal": bool(torch.equal(got.input_ids.to("cuda"), ids)),
                    "seq_lens": got.seq_lens.tolist(),
                    "device": str(got.hidden.device),
                    "dtype": str(got.hidden.dtype),
                }
            )
    except DataPlaneError as exc:
        error = {"message": str(exc), "engine": exc.engine, "rank": exc.rank, "step": exc.step}
    with open(out, "w") as f:
        json.dump({"steps": steps, "error": error, "buffers": getattr(plane, "_generation", None)}, f)


if __name__ == "__main__":
    main()
