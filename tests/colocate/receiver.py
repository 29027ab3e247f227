"""A trainer rank for the data plane tests: takes STEPS steps with ``DataPlane.from_env`` and
saves what it got (``torch.save``: a list of dicts, one per step) to OUT; a DataPlaneError is
saved as ``{"error": message, "engine": ..., "rank": ..., "step": ...}`` instead.

``python receiver.py STEPS OUT [RANK] [--linger]`` (RANK: torchrun's RANK when absent; with
``--linger`` the process, its end of the plane open, stays alive after saving until its stdin
closes: a trainer that caught the error and goes on)."""

from __future__ import annotations

import os
import sys

import torch

from pdctl.colocate import DataPlane
from pdctl.errors import DataPlaneError


def main() -> None:
    linger = "--linger" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--linger"]
    steps, out = int(args[0]), args[1]
    rank = int(args[2]) if len(args) > 2 else None
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
    torch.save(got, out + ".part")
    os.replace(out + ".part", out)  # (whole when it appears: a lingering receiver is read alive)
    if linger:
        sys.stdin.read()


if __name__ == "__main__":
    main()
