"""Typed calls of the node agent: one function per command, each returning the reply type
``pdctl.node.agent`` builds (``pdctl.node.replies``). The cluster code calls the agent only here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from pdctl.node.replies import (
    MpsStartReply,
    MpsStatusReply,
    MpsStopReply,
    PreflightReply,
    ReadReply,
    RetargetReply,
    RmReply,
    SpawnReply,
    StatusReply,
    StopReply,
    WaitReadyReply,
)
from pdctl.remote.base import Executor

Json = Mapping[str, Any]


def preflight(ex: Executor, ports: list[int], *, check_gpus: bool) -> PreflightReply:
    return cast(PreflightReply, ex.agent("preflight", {"ports": ports, "check_gpus": check_gpus}, timeout=60))


def spawn(ex: Executor, processes: Sequence[Json]) -> SpawnReply:
    return cast(SpawnReply, ex.agent("spawn", {"processes": processes}, timeout=120))


def wait_ready(ex: Executor, targets: Sequence[Json], watch: Sequence[Json], timeout_secs: float) -> WaitReadyReply:
    request = {"targets": targets, "watch": watch, "timeout_secs": timeout_secs}
    return cast(WaitReadyReply, ex.agent("wait-ready", request, timeout=timeout_secs + 60))


def status(ex: Executor, processes: Sequence[Json], *, timeout: float = 120) -> StatusReply:
    return cast(StatusReply, ex.agent("status", {"processes": processes}, timeout=timeout))


def stop(ex: Executor, processes: Sequence[Json], *, run_id: str | None, grace_secs: float) -> StopReply:
    request = {"processes": processes, "run_id": run_id, "grace_secs": grace_secs}
    return cast(StopReply, ex.agent("stop", request, timeout=grace_secs + 60))


def read_tail(ex: Executor, path: str, lines: int) -> ReadReply:
    """The last ``lines`` lines of a file on the node."""
    return cast(ReadReply, ex.agent("read", {"path": path, "lines": lines}, timeout=30))


def read_from(ex: Executor, path: str, offset: int) -> ReadReply:
    """A file's bytes from ``offset`` (at most 1 MiB); ``size`` is where the next read starts."""
    return cast(ReadReply, ex.agent("read", {"path": path, "offset": offset}, timeout=30))


def rm(ex: Executor, paths: list[str]) -> RmReply:
    return cast(RmReply, ex.agent("rm", {"paths": paths}))


def retarget(ex: Executor, process: Json) -> RetargetReply:
    """``process`` (a spawn entry: argv, config, log_path, exit_file) restarts with its new argv."""
    return cast(RetargetReply, ex.agent("retarget", {"process": process}))


def mps_start(ex: Executor, request: Json, *, timeout: float) -> MpsStartReply:
    return cast(MpsStartReply, ex.agent("mps-start", dict(request), timeout=timeout))


def mps_stop(ex: Executor, request: Json, *, timeout: float) -> MpsStopReply:
    return cast(MpsStopReply, ex.agent("mps-stop", dict(request), timeout=timeout))


def mps_status(ex: Executor, record: Json) -> MpsStatusReply:
    return cast(MpsStatusReply, ex.agent("mps-status", dict(record), timeout=60))
