"""The trainer's share of a GPU it shares with an engine (``placement: colocate``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from pdctl.errors import WeightSyncError

log = logging.getLogger("pdctl.weights")
TRAIN_FRAC_ENV = "PDCTL_TRAIN_FRAC"


def apply_memory_fraction(device: int | None = None, env: Mapping[str, str] | None = None) -> float | None:
    """Cap this process's CUDA caching allocator at the trainer's fraction of the GPU.

    Reads ``PDCTL_TRAIN_FRAC`` (``pdctl up`` sets it from ``placement.train_frac`` for a
    colocated trainer) and calls ``torch.cuda.set_per_process_memory_fraction`` for ``device``
    (default: ``LOCAL_RANK``'s GPU, as torchrun assigns them). Call it first, before the model
    is built: ``up`` starts the trainer before the engines so that its share is claimed before
    they size their KV pools. Past the cap, an allocation raises CUDA out-of-memory.

    Returns the fraction applied; None when the variable is unset (not colocated) or there is
    no CUDA device (said in the log). Raises WeightSyncError for a value that is not in (0, 1).
    """
    env = os.environ if env is None else env
    raw = env.get(TRAIN_FRAC_ENV)
    if not raw:
        return None
    try:
        fraction = float(raw)
    except ValueError as exc:
        raise WeightSyncError(f"${TRAIN_FRAC_ENV}={raw!r} is not a number") from exc
    if not 0 < fraction < 1:
        raise WeightSyncError(f"${TRAIN_FRAC_ENV}={raw} is not a fraction of a GPU (0 < fraction < 1)")
    import torch

    if not torch.cuda.is_available():
        log.info("no CUDA device: the memory fraction %.2f is not applied", fraction)
        return None
    index = int(env.get("LOCAL_RANK", "0")) if device is None else device
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    log.info("CUDA device %d capped at %.2f of its memory for this trainer rank", index, fraction)
    return fraction
