"""The node agent's replies, defined once: ``pdctl.node.agent`` and ``pdctl.node.mps`` build them, the
cluster code reads them (through ``pdctl.remote.agent_api``). JSON on the wire; TypedDicts here
so that a key spelled differently on the two sides is a type error, not a KeyError on a node.
Light on purpose: the agent imports this on every call.
"""

from __future__ import annotations

from typing import Any, TypedDict


class BusyPort(TypedDict):
    """A port the plan needs that is taken on the node: its number and, when the agent could tell, the
    owning process's pid and name (``None`` when unknown)."""

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
    """What the control plane checks before a launch: which Python and pdctl the agent ran under,
    whether sglang and torch import there, the planned ports already taken (``busy_ports``, empty
    when all are free), and the kernel's ephemeral port range (``None`` when unreadable). ``gpus``,
    the visible GPU count, is present only when the request asked for a GPU check."""

    gpus: int  # only when asked to check GPUs


class Started(TypedDict):
    """One process the agent started: its pid, its process group (the same number: each starts a new
    session) and create time, the identity ``status`` and ``stop`` check so that a reused pid is
    never mistaken for it."""

    pid: int
    pgid: int
    create_time: float  # seconds since the node booted (pdctl.node.proc.start_time)


class _SpawnBase(TypedDict):
    started: dict[str, Started]


class SpawnReply(_SpawnBase, total=False):
    """Every process of the request was started: ``started`` maps each process id to its ``Started``
    record; ``configured`` lists those whose secret flags went into a --config file (an older agent
    leaves it out, and the control machine then refuses the launch)."""

    # the processes whose secret flags went into a --config file (an agent older than that
    # leaves this out: the control machine then refuses the launch)
    configured: list[str]


class _WaitReadyBase(TypedDict):
    ready: bool
    ready_ids: list[str]


class WaitReadyReply(_WaitReadyBase, total=False):
    """The outcome of waiting for the node's targets: ``ready`` is true only when every target answered
    its health URL; ``ready_ids`` lists those that did. Otherwise ``failed`` names the first target
    not ready and ``reason`` says why (deadline passed, a process exited, or the caller went away);
    ``died`` is set when a target or watched process exited."""

    failed: str  # the first target that did not become ready
    reason: str
    died: str  # a target or watched process that exited


class ProcessState(TypedDict, total=False):
    """What the node knows of one recorded process now. Only ``alive`` is always present; a supervised
    process that waits for a restart counts as not alive. The other keys appear when they apply, as
    their comments say."""

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
    """Each requested process's state, keyed by process id."""

    processes: dict[str, ProcessState]


class StopReply(TypedDict):
    """The outcome of stopping a run's processes: how many exited after SIGTERM, how many had to be
    killed, and the pids still running afterwards (empty when all are gone)."""

    terminated: int
    killed: int
    left: list[int]


class ReadReply(TypedDict, total=False):
    """A piece of a file on the node, decoded as text. ``size`` is the offset to read from next (the
    file's size when the last lines were asked for); ``error`` is set, with empty ``data``, when the
    file could not be read."""

    size: int  # always present
    data: str  # always present
    error: str  # the file could not be read


class RmReply(TypedDict):
    """The paths that existed and were removed (paths already absent are left out)."""

    removed: list[str]


class RetargetReply(TypedDict):
    """Where the supervised process's new restart command was written; the running process is untouched
    until it next restarts."""

    written: str


class MpsStartReply(TypedDict):
    """An MPS control daemon serves ``pipe_dir``: its pid and create time, and whether this call
    started it. When ``started`` is false the daemon was already there and ``down`` must leave it
    running."""

    pid: int
    create_time: float
    started: bool  # False: a daemon already served the pipe directory (down leaves it)
    pipe_dir: str


class MpsStopReply(TypedDict, total=False):
    """The MPS daemon is stopped or was already gone. ``forced`` is true when it outlived ``quit`` and
    was killed; ``detail`` says what happened; ``left`` lists pids that survived the kill."""

    forced: bool  # always present
    detail: str  # always present
    left: list[int]


class MpsStatusReply(TypedDict):
    """Whether the recorded MPS daemon still runs and its control pipe still exists."""

    running: bool
    control_pipe: bool
