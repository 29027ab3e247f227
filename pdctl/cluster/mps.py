"""The CUDA MPS control daemons of a colocated cluster, driven through each node's agent.

``up`` starts one per node before any GPU process (``start_daemons``), ``down`` stops the
ones this cluster started after every process is gone (``stop_daemons``), ``status`` asks
whether they still run (``daemon_status``). A daemon that already served the pipe directory
is reused and left running by ``down``. The state file keeps each node's daemon
(``ClusterState.mps``) so that ``down`` needs no topology.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdctl.cluster.nodes import Events, NodeSet, quiet
from pdctl.cluster.state import ClusterState, StateStore
from pdctl.errors import LifecycleError, RemoteError
from pdctl.node.replies import MpsStartReply, MpsStopReply
from pdctl.plan import Plan
from pdctl.remote import agent_api
from pdctl.remote.base import Executor

START_TIMEOUT_SECS = 20.0
QUIT_GRACE_SECS = 10.0


@dataclass
class MpsStatus:
    """One node's CUDA MPS control daemon as ``pdctl status`` reports it; ``error`` says why the node
    could not be asked."""

    node: str
    pid: int
    started: bool
    """False: the daemon was already running; ``down`` leaves it."""
    running: bool | None
    """None: the node cannot be reached."""
    control_pipe: bool | None = None
    error: str | None = None


def start_daemons(plan: Plan, state: ClusterState, store: StateStore, nodes: NodeSet, events: Events = quiet) -> None:
    """Make sure a daemon serves each node's pipe directory; record each in ``state``.

    Raises LifecycleError naming every node where MPS cannot run (what did start is recorded,
    so the caller's cleanup stops it)."""
    wanted = {d.node: d for d in plan.mps}
    envs = _node_envs(state)

    def start(ex: Executor) -> MpsStartReply:
        d = wanted[ex.node.name]
        request = {"pipe_dir": d.pipe_dir, "log_dir": d.log_dir, "env": envs.get(d.node, {}),
                   "timeout_secs": START_TIMEOUT_SECS}  # fmt: skip
        return agent_api.mps_start(ex, request, timeout=START_TIMEOUT_SECS + 60)

    for node in wanted:
        events(f"mps.{node}", "starting the MPS control daemon")
    problems = []
    for node, res in nodes.each(list(wanted), start).items():
        if isinstance(res, RemoteError):
            problems.append(str(res))
            continue
        d = wanted[node]
        state.mps[node] = {"pid": res["pid"], "create_time": res["create_time"], "pipe_dir": d.pipe_dir,
                           "log_dir": d.log_dir, "started": res["started"]}  # fmt: skip
        how = "started" if res["started"] else "already running, reused (down leaves it)"
        events(f"mps.{node}", f"{how}: pid {res['pid']}, pipe {d.pipe_dir}")
    store.save(state)
    if problems:
        text = "\n  ".join(problems)
        hint = "\n  (placement.mps: false runs colocated processes without MPS)"
        hint = "" if "placement.mps: false" in text else hint  # the missing-binary message gives it already
        raise LifecycleError(f"MPS cannot run, nothing else was started:\n  {text}{hint}")


def stop_daemons(state: ClusterState, nodes: NodeSet, events: Events = quiet) -> None:
    """Stop the daemons this cluster started (``quit``, then force after a grace period); forget
    the reused ones. Raises LifecycleError for a node that cannot be reached (kept in state)."""
    envs = _node_envs(state)
    for node, d in list(state.mps.items()):
        if not d["started"]:
            events(f"mps.{node}", f"left running (pid {d['pid']}; pdctl did not start it)")
            del state.mps[node]
    targets = list(state.mps)
    if not targets:
        return

    def stop(ex: Executor) -> MpsStopReply:
        d = state.mps[ex.node.name]
        request = {**d, "env": envs.get(ex.node.name, {}), "grace_secs": QUIT_GRACE_SECS}
        return agent_api.mps_stop(ex, request, timeout=3 * QUIT_GRACE_SECS + 60)

    for node in targets:
        events(f"mps.{node}", "stopping the MPS control daemon")
    problems = []
    for node, res in nodes.each(targets, stop).items():
        if isinstance(res, RemoteError):
            problems.append(f"{res} (the daemon stays in the state file; retry `pdctl down {state.name}`)")
            continue
        if res.get("left"):
            problems.append(f"node {node}: MPS pids {res['left']} survived SIGKILL")
            continue
        events(f"mps.{node}", f"stopped ({res['detail']})")
        del state.mps[node]
    if problems:
        raise LifecycleError("MPS daemons may still run:\n  " + "\n  ".join(problems))


def daemon_status(state: ClusterState, nodes: NodeSet) -> list[MpsStatus]:
    if not state.mps:
        return []
    results = nodes.each(list(state.mps), lambda ex: agent_api.mps_status(ex, state.mps[ex.node.name]))
    out = []
    for node, d in state.mps.items():
        res = results.get(node)
        status = MpsStatus(node=node, pid=d["pid"], started=d["started"], running=None)
        if isinstance(res, RemoteError):
            status.error = str(res)
        elif res is not None:
            status.running, status.control_pipe = res["running"], res["control_pipe"]
        out.append(status)
    return out


def _node_envs(state: ClusterState) -> dict[str, dict[str, str]]:
    """Each node's own environment from the topology (its PATH finds nvidia-cuda-mps-control)."""
    return {n["name"]: dict(n.get("env") or {}) for n in state.nodes}
