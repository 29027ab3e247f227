"""The node agent's replies, defined once: ``pdctl.node.agent`` and ``pdctl.node.mps`` build them, the
cluster code reads them (through ``pdctl.remote.agent_api``). JSON on the wire; TypedDicts here
so that a key spelled differently on the two sides is a type error, not a KeyError on a node.
Light on purpose: the agent imports this on every call.
"""

from __future__ import annotations

from typing import Any, TypedDict


class BusyPort(TypedDict):
    port: int
    pid: int | None
    name: str | None


class _PreflightBase(TypedDict):
    python: str
    pdctl: str
    sglang: bool
    torch: bool
    busy_ports: list[dict[str, Any]]  # BusyPort, plus the owner's cmdline when known
    ephemeral_range: list[int] | None


class PreflightReply(_PreflightBase, total=False):
    gpus: int  # only when asked to check GPUs


class Started(TypedDict):
    pid: int
    pgid: int
    create_time: float


class _SpawnBase(TypedDict):
    started: dict[str, Started]


class SpawnReply(_SpawnBase, total=False):
    # the processes whose secret flags went into a --config file (an agent older than that
    # leaves this out: the control machine then refuses the launch)
    configured: list[str]


class _WaitReadyBase(TypedDict):
    ready: bool
    ready_ids: list[str]


class WaitReadyReply(_WaitReadyBase, total=False):
    failed: str  # the first target that did not become ready
    reason: str
    died: str  # a target or watched process that exited


class ProcessState(TypedDict, total=False):
    alive: bool  # always present
    exit_code: int | None  # a dead process with an exit file (None: killed before it wrote)
    uptime_secs: float
    rss_mb: float | None
    healthy: bool  # when a health URL was given
    info: Any  # the JSON of the info URL, None when it did not answer
    restarts: int  # from the supervisor's file (pdctl.node.supervise), when it has written one
    last_exit: dict[str, Any] | None  # {"code": N (negative: a signal), "at": epoch seconds}
    supervisor: str | None  # running, backoff, exited, gave_up
    reason: str | None  # why it was left down
    peer: dict[str, Any]  # its last start's weights from a peer (pdctl.node.peer_weights), when it has one
    child_pid: int  # the supervised process itself (the recorded pid is its supervisor)


class StatusReply(TypedDict):
    processes: dict[str, ProcessState]


class StopReply(TypedDict):
    terminated: int
    killed: int
    left: list[int]


class ReadReply(TypedDict, total=False):
    size: int  # always present
    data: str  # always present
    error: str  # the file could not be read


class RmReply(TypedDict):
    removed: list[str]


class RetargetReply(TypedDict):
    written: str


class MpsStartReply(TypedDict):
    pid: int
    create_time: float
    started: bool  # False: a daemon already served the pipe directory (down leaves it)
    pipe_dir: str


class MpsStopReply(TypedDict, total=False):
    forced: bool  # always present
    detail: str  # always present
    left: list[int]


class MpsStatusReply(TypedDict):
    running: bool
    control_pipe: bool
