"""A trainer rank for the data plane tests: takes STEPS steps with ``DataPlane.from_env`` and
saves what it got (``torch.save``: a list of dicts, one per step) to OUT; a DataPlaneError is
saved as ``{"error": message, "engine": ..., "rank": ..., "step": ...}`` instead.

``python receiver.py STEPS OUT [RANK]`` (RANK: torchrun's RANK when absent)."""

from __future__ import annotations

import sys

import torch

from pdctl.colocate import DataPlane
from pdctl.errors import DataPlaneError


def main() -> None:
    steps, out = int(sys.argv[1]), sys.argv[2]
    rank = int(sys.argv[3]) if len(sys.argv) > 3 else None
    got: list[dict] = []
    plane = DataPlane.from_env(rank=rank)
    out = out.replace("{rank}", str(plane.rank))
    try:
        for _ in range(steps):
            step = plane.recv()
            got.append(
                {
                    "step": step.step,
                    "engine": step.engine,
                    "tp_rank": step.tp_rank,
                    "input_ids": step.input_ids.clone(),
                    "seq_lens": step.seq_lens.clone(),
                    "loss_mask": step.loss_mask.clone(),
                    "hidden": step.hidden.clone(),
                    "aux": [a.clone() for a in step.aux],
                }
            )
    except DataPlaneError as exc:
        got.append({"error": str(exc), "engine": exc.engine, "rank": exc.rank, "step": exc.step})
    torch.save(got, out)


if __name__ == "__main__":
    main()
