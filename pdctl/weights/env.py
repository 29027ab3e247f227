"""The trainer's environment contract: what ``pdctl up`` gives the trainer and ``WeightSync.from_env``
reads. One home for the variable names and the defaults both sides use; no torch here.

``PDCTL_WEIGHT_GROUP`` holds the plan's weight group as JSON (``pdctl.plan.model.WeightGroup.to_dict``),
read here as ``WeightGroupEnv``: the flat group's rendezvous, its engines (id, url, GPUs, first
rank), the bucket size and the refit mode with its staleness bound.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdctl.refit import DEFAULT_BUCKET_MB, RefitMode, parse_staleness
from pdctl.sglang import DEFAULT_GROUP_NAME

WEIGHT_GROUP_ENV = "PDCTL_WEIGHT_GROUP"
ROUTER_URL_ENV = "PDCTL_ROUTER_URL"
API_KEY_ENV_ENV = "PDCTL_API_KEY_ENV"
ENGINE_KEY_ENV = "PDCTL_ENGINE_KEY"
"""The cluster's engine key (``pdctl up`` makes one per cluster): engines require it."""
CONTROL_KEY_ENV = "PDCTL_CONTROL_KEY"
"""The cluster's control-plane admin key: the router's hold, release, workers and cordon."""
CONTROL_KEYS_ENV = "PDCTL_CONTROL_KEYS"
"""The router's ``--control-plane-api-keys-env`` variable: ``pdctl:pdctl:admin:KEY``."""
"""Names the variable holding the router's (and engines') API key; the key itself is never in the plan."""
READY_TIMEOUT_ENV = "PDCTL_READY_TIMEOUT_SECS"
"""Set by ``pdctl up`` when the trainer starts before the engines (colocate): ``connect`` waits
that long for every engine, and the router, to be ready."""
"""Bytes per update call, in MiB: the topology's default and ``WeightSync``'s."""


@dataclass(frozen=True)
class WeightGroupEnv:
    """What ``$PDCTL_WEIGHT_GROUP`` holds: the flat weight group ``pdctl up`` gives the trainer,
    read by ``WeightSync.from_env``."""

    master_address: str
    master_port: int
    engines: tuple[Mapping[str, Any], ...]
    """Each ``{"id", "url", "gpus", "rank_offset"}``."""
    backend: str = "nccl"
    group_name: str = DEFAULT_GROUP_NAME
    bucket_mb: int = DEFAULT_BUCKET_MB
    refit: RefitMode = RefitMode.DRAIN
    max_staleness: int | None = None

    @classmethod
    def from_json(cls, raw: str) -> WeightGroupEnv:
        """Raises ValueError naming what is wrong."""
        try:
            group = json.loads(raw)
            return cls(
                master_address=str(group["master_address"]),
                master_port=int(group["master_port"]),
                engines=tuple(
                    {"id": e["id"], "url": e["url"], "gpus": int(e["gpus"]), "rank_offset": e.get("rank_offset")}
                    for e in group["engines"]
                ),
                backend=str(group.get("backend", "nccl")),
                group_name=str(group.get("group_name", DEFAULT_GROUP_NAME)),
                bucket_mb=int(group.get("bucket_mb", DEFAULT_BUCKET_MB)),
                refit=RefitMode.parse(group.get("refit"), "refit"),
                max_staleness=parse_staleness(group.get("max_staleness")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"missing or malformed field {exc}") from exc
