"""Prometheus' view of a cluster: a file_sd target list kept beside the state, and a scrape
configuration that reads it.

Targets: each engine's HTTP entrypoint (SGLang's ``/metrics``, with ``--enable-metrics``, which
pdctl always passes) and the router's metrics port (``--prometheus-port``), labelled ``cluster``,
``role``, ``process`` and ``node``. The file is rewritten with every save of the state (``up``,
``apply``, ``restart``, ``down``: a stopped cluster lists nothing), so Prometheus, which watches
file_sd files, follows the cluster without a reload.

Keys: none. SGLang leaves ``/metrics`` open whatever ``--api-key`` says (sglang-protocol.md), and
so does pdctl's router (on its main port and its metrics port), so the configuration carries no
credential and no key is ever written into it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import yaml

from pdctl.roles import Role

TARGETS_FILE = "prometheus-targets.json"


class _Process(Protocol):  # what a target needs of a pdctl.cluster.state.ProcessRecord
    id: str
    role: Role
    node: str
    url: str | None
    ports: dict[str, int]


class _Cluster(Protocol):  # ... and of a ClusterState (which saves through write_targets: no import back)
    name: str
    plan: dict[str, Any]

    @property
    def processes(self) -> Mapping[str, _Process]: ...


def targets(state: _Cluster) -> list[dict[str, Any]]:
    """The file_sd entries for ``state``'s running processes, one per scrape target, plan order."""
    order = {p["id"]: i for i, p in enumerate(state.plan.get("processes", []))}
    out = []
    for rec in sorted(state.processes.values(), key=lambda r: order.get(r.id, len(order))):
        if rec.url is None:
            continue  # a trainer, or a multi-node engine's follower node: nothing to scrape
        address = urlsplit(rec.url).netloc
        if rec.role == Role.ROUTER:
            port = rec.ports.get("metrics")
            if port is None:
                continue
            host = urlsplit(rec.url).hostname or "127.0.0.1"
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        labels = {"cluster": state.name, "role": str(rec.role), "process": rec.id, "node": rec.node}
        out.append({"targets": [address], "labels": labels})
    return out


def write_targets(directory: Path, state: _Cluster) -> Path:
    """Atomically (re)write ``directory/TARGETS_FILE`` for ``state`` (0600, like the state)."""
    path = directory / TARGETS_FILE
    tmp = directory / f".{TARGETS_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(targets(state), out, indent=2)
        out.write("\n")
    os.replace(tmp, path)
    return path


def scrape_config(cluster: str, targets_path: Path, *, interval_secs: float = 5.0) -> str:
    """A whole Prometheus configuration (YAML) with one job that scrapes ``cluster`` through the
    file_sd list at ``targets_path``."""
    interval = f"{interval_secs:g}s"
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": f"pdctl-{cluster}",
                "scrape_interval": interval,
                "scrape_timeout": f"{min(interval_secs, 10.0):g}s",
                "metrics_path": "/metrics",
                "file_sd_configs": [{"files": [str(targets_path)], "refresh_interval": "30s"}],
            }
        ],
    }
    header = (
        f"# Prometheus configuration for pdctl cluster {cluster!r} (`pdctl metrics {cluster} --prometheus-config`).\n"
        f"# Its targets are read from {targets_path}, which pdctl up/apply/restart/down keep current;\n"
        "# Prometheus must be able to read that file (it is 0600 in a 0700 directory: run Prometheus as the\n"
        "# same user, or copy it). The engines' and the router's /metrics need no key: none is written here.\n"
    )
    return header + yaml.safe_dump(config, sort_keys=False)
