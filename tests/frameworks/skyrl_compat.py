"""What skyrl-train 0.3.1 needs of the ray and torch installed beside AReaL (.venv-areal), imported
before its code runs; nothing of skyrl-train's own code, nor what it sends, is changed:

- ray 2.60 keeps ``PlacementGroupSchedulingStrategy`` in ``ray.util.scheduling_strategies`` only,
  where skyrl-train imports it from ``ray.util.placement_group`` (older ray had it in both);
- skyrl-train picks torch's keyword for a process group's options by comparing version *strings*
  (``"2.13.0" >= "2.6"`` is False), so on torch 2.10+ it passes ``pg_options``, which torch renamed
  ``backend_options`` in 2.6: the private helper it calls is given the old name back.
"""

import importlib
import sys

import ray.util.scheduling_strategies as strategies
import torch.distributed.distributed_c10d as c10d

importlib.import_module("ray.util.placement_group")
sys.modules["ray.util.placement_group"].PlacementGroupSchedulingStrategy = strategies.PlacementGroupSchedulingStrategy

_helper = c10d._new_process_group_helper


def _new_process_group_helper(*args, pg_options=None, **kwargs):  # type: ignore[no-untyped-def]
    if pg_options is not None:
        kwargs.setdefault("backend_options", pg_options)
    return _helper(*args, **kwargs)


importlib.import_module("skyrl_train.distributed.utils")._new_process_group_helper = _new_process_group_helper
