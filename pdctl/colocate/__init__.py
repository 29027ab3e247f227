"""The colocated data plane (TorchSpec's design): hidden states from engine TP rank i to trainer
rank i on the same GPU, point to point, inside one union world of trainer and engine ranks.

- ``pdctl.colocate.env``: the contract (``PDCTL_DATA_PLANE``), the hook specs; no torch.
- ``pdctl.colocate.engine``: ``hook_factory`` for the engines' ``--forward-hooks``.
- ``pdctl.colocate.trainer``: ``DataPlane.from_env()`` and ``recv()`` for the trainer.

Nothing here imports torch until it is used: the planner reads ``env`` on the control machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdctl.lazy import lazy_exports

if TYPE_CHECKING:
    from pdctl.colocate.trainer import DataPlane, Step

__all__ = ["DataPlane", "Step"]


__getattr__ = lazy_exports(__name__, dict.fromkeys(__all__, "pdctl.colocate.trainer"))
