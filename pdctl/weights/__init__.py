"""Trainer side of pdctl: push weights from trainer rank 0 into every prefill and decode engine.

    from pdctl.weights import WeightSync
    sync = WeightSync.from_env()          # the env `pdctl up` gives the trainer
    sync.connect()                         # builds the flat group
    report = sync.push(named_tensors, version="step-12")
    sync.close()

See ``pdctl.weights.sync`` for the transaction and its failure rules, ``full_tensors`` for
FSDP2 models, ``apply_memory_fraction`` for a trainer that shares its GPUs with engines
(colocate), and ``pdctl.weights.fleet`` for the torch-free part (engines, router, loads from
disk) that the control machine uses. ``WeightSync`` and ``full_tensors`` import torch on first
use, so ``pdctl.weights.fleet`` works where torch is not installed.
"""

from typing import TYPE_CHECKING

from pdctl.errors import WeightSyncError
from pdctl.lazy import lazy_exports
from pdctl.weights.fleet import EngineTarget, Fleet
from pdctl.weights.memory import apply_memory_fraction
from pdctl.weights.report import PushReport

if TYPE_CHECKING:
    from pdctl.weights.fsdp import full_tensors
    from pdctl.weights.sync import WeightSync

__all__ = [
    "EngineTarget",
    "Fleet",
    "PushReport",
    "WeightSync",
    "WeightSyncError",
    "apply_memory_fraction",
    "full_tensors",
]


__getattr__ = lazy_exports(__name__, {"WeightSync": "pdctl.weights.sync", "full_tensors": "pdctl.weights.fsdp"})
