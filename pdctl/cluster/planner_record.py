"""The P:D planner's decisions on disk: ``planner.jsonl`` beside the cluster's state (0600), the
latest ``KEEP_DECISIONS`` of them, for ``pdctl planner --history`` and ``pdctl status --json``."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from pdctl.cluster.state import StateStore

DECISIONS_FILE = "planner.jsonl"
KEEP_DECISIONS = 200


def decisions_path(store: StateStore, name: str) -> Path:
    return store.dir(name) / DECISIONS_FILE


def recent_decisions(store: StateStore, name: str, count: int = 10) -> list[dict[str, Any]]:
    """The latest ``count`` decisions of cluster ``name``'s planner, oldest first (none: [])."""
    try:
        lines = decisions_path(store, name).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines[-count:]:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def append_decision(store: StateStore, name: str, entry: dict[str, Any]) -> None:
    """Add ``entry``, dropping the oldest beyond ``KEEP_DECISIONS`` (written whole, then renamed)."""
    path = decisions_path(store, name)
    try:
        lines = path.read_text().splitlines()[-(KEEP_DECISIONS - 1) :]
    except OSError:
        lines = []
    lines.append(json.dumps(entry))
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write("\n".join(lines) + "\n")
    os.replace(tmp, path)
