"""Trainer side of pdctl: push weights from trainer rank 0 into every prefill and decode engine.

    from pdctl.weights import WeightSync
    sync = WeightSync.from_env()          # the env `pdctl up` gives the trainer
    sync.connect()                         # builds the flat group
    report = sync.push(named_tensors, version="step-12")
    sync.close()

See ``pdctl.weights.sync`` for the transaction and its failure rules, and ``full_tensors`` for
FSDP2 models.
"""

from pdctl.errors import WeightSyncError
from pdctl.weights.fsdp import full_tensors
from pdctl.weights.report import PushReport
from pdctl.weights.sync import EngineTarget, WeightSync

__all__ = ["EngineTarget", "PushReport", "WeightSync", "WeightSyncError", "full_tensors"]
