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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from pdctl.roles import Role

TARGETS_FILE = "prometheus-targets.json"


@dataclass(frozen=True, slots=True)
class Target:
    """One running process as Prometheus may scrape it (the cluster's state makes them:
    ``ClusterState.scrape_targets``)."""

    process: str
    role: Role
    node: str
    url: str | None
    """Its HTTP entrypoint; None for a process with nothing to scrape (a trainer, a follower node)."""
    metrics_port: int | None = None
    """The router's ``--prometheus-port`` (a router is scraped there, not on its main port)."""


def targets(cluster: str, processes: Sequence[Target]) -> list[dict[str, Any]]:
    """The file_sd entries for ``cluster``'s ``processes``, one per scrape target, in their order."""
    out = []
    for target in processes:
        if target.url is None:
            continue  # a trainer, or a multi-node engine's follower node: nothing to scrape
        address = urlsplit(target.url).netloc
        if target.role == Role.ROUTER:
            if target.metrics_port is None:
                continue
            host = urlsplit(target.url).hostname or "127.0.0.1"
            port = target.metrics_port
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        labels = {"cluster": cluster, "role": str(target.role), "process": target.process, "node": target.node}
        out.append({"targets": [address], "labels": labels})
    return out


def write_targets(directory: Path, cluster: str, processes: Sequence[Target]) -> Path:
    """Atomically (re)write ``directory/TARGETS_FILE`` for ``cluster``'s ``processes`` (0600,
    like the state)."""
    path = directory / TARGETS_FILE
    tmp = directory / f".{TARGETS_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(targets(cluster, processes), out, indent=2)
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
