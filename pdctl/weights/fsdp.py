"""Full tensors from an FSDP2 (DTensor-sharded) model, one tensor at a time.

What slime and verl do before a push: gather each sharded parameter to its full size just
before it is sent, so the largest extra memory is one parameter, never a second copy of the
model. ``DTensor.full_tensor()`` is an all-gather, a collective: every rank of the training
group must read the iterator in the same order (``WeightSync.push`` does that on every rank;
only rank 0 sends what it reads).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

try:  # torch >= 2.4; older torch has it under torch.distributed._tensor
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    from torch.distributed._tensor import DTensor  # same class, old home


def full_tensors(
    model: nn.Module, *, dtype: torch.dtype | None = None, buffers: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for each parameter (and persistent buffer) of ``model``.

    Sharded (DTensor) entries are all-gathered one by one; plain tensors are yielded as they
    are. ``dtype`` casts each tensor after gathering (e.g. ``torch.bfloat16`` for an engine
    serving in bf16). Names are the model's own (FSDP2 does not rename parameters).
    """
    state = model.state_dict()
    params = {name for name, _ in model.named_parameters()}
    for name, value in state.items():
        if not buffers and name not in params:
            continue
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor
