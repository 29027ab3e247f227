"""``down``: stop every process of a cluster on every node; idempotent.

Whole process groups get SIGTERM, then SIGKILL after a grace period, all nodes in
parallel, trainer rank 0 last (it hosts the torch.distributed store; killing it first
makes the other ranks fail their teardown). Processes that left their group are found by
the run id in their environment. A node that cannot be reached keeps its processes in the
state file so that a retry finishes the job.
"""

from __future__ import annotations

from collections import defaultdict

from pdctl.cluster import planner_process
from pdctl.cluster.mps import stop_daemons
from pdctl.cluster.nodes import Events, NodeSet, quiet
from pdctl.cluster.state import ClusterState, Phase, StateStore
from pdctl.errors import LifecycleError, RemoteError
from pdctl.node.replies import StopReply
from pdctl.remote import agent_api
from pdctl.remote.base import Executor
from pdctl.roles import Role

GRACE_SECS = 10.0


def down(
    name: str,
    *,
    store: StateStore | None = None,
    nodes: NodeSet | None = None,
    purge: bool = False,
    events: Events = quiet,
) -> str:
    """Stop cluster ``name``. Returns a one-line summary; raises LifecycleError if anything is left."""
    store = store or StateStore()
    with store.locked(name):
        state = store.load(name)
        if state is None:
            return f"no cluster {name!r} in {store.root}; nothing to do"
        if nodes is None:
            with NodeSet(state.node_objects().values()) as owned:  # connections closed on return
                return _down(state, store, owned, purge, events)
        return _down(state, store, nodes, purge, events)


def _down(state: ClusterState, store: StateStore, nodes: NodeSet, purge: bool, events: Events) -> str:
    name = state.name
    if state.status == Phase.DOWN and not state.processes and not state.mps and not state.planner:
        summary = f"cluster {name!r} is already down"
    else:
        count = len(state.processes)
        state.status = Phase.STOPPING
        store.save(state)
        planner = bool(state.planner)
        if planner:  # first: it must not switch an engine that is being stopped
            planner_process.stop(state)
            events("planner", "stopped")
            store.save(state)
        try:
            stop_processes(state, nodes, events=events)
            state.processes.clear()
            stop_daemons(state, nodes, events)  # after their clients: quit waits for them
        finally:
            store.save(state)  # what was stopped is forgotten even when a node failed
        state.status = Phase.DOWN
        state.journal = None  # a day-2 step left half done has nothing left to finish
        state.cordoned_ahead = None  # (nor engines a move cordoned ahead: they are stopped)
        store.save(state)
        summary = f"cluster {name!r} is down ({count} processes stopped{' and its planner' if planner else ''})"
    if purge:
        results = nodes.each(state.run_dirs, lambda ex: agent_api.rm(ex, [state.run_dirs[ex.node.name]]))
        failed = [str(r) for r in results.values() if isinstance(r, RemoteError)]
        if failed:
            raise LifecycleError("purge failed (state kept): " + "; ".join(failed))
        store.remove(name)
        summary += "; logs and state removed"
    return summary


def stop_processes(
    state: ClusterState, nodes: NodeSet, *, events: Events = quiet, grace_secs: float = GRACE_SECS
) -> None:
    """Stop every recorded process (and run-id-tagged stragglers) on every node.

    Processes confirmed gone are removed from ``state.processes``. Raises LifecycleError
    naming unreachable nodes and survivors; what is left stays in the state.
    """
    last = [p for p in state.processes.values() if p.role == Role.TRAINER and p.node_rank == 0]
    last_node = last[0].node if last else None
    first = [p for p in state.processes.values() if p not in last]
    problems: list[str] = []
    # Phase 1: everything but trainer rank 0. The run-id sweep skips rank 0's node until phase 2.
    all_nodes = [n for n in state.node_objects() if n != last_node] + ([last_node] if last_node else [])
    problems += _stop_phase(state, nodes, first, [n for n in all_nodes if n != last_node], events, grace_secs)
    if last_node:
        problems += _stop_phase(state, nodes, last, [last_node], events, grace_secs)
    if problems:
        raise LifecycleError("some processes may still run:\n  " + "\n  ".join(problems))


def stop_records(state: ClusterState, nodes: NodeSet, records: list, *, events: Events = quiet) -> None:
    """Stop these processes only (their groups, supervisors included); they leave ``state.processes``.
    Raises LifecycleError naming what may still run."""
    problems = _stop_phase(state, nodes, records, [], events, GRACE_SECS)
    if problems:
        raise LifecycleError("some processes may still run:\n  " + "\n  ".join(problems))


def _stop_phase(state, nodes: NodeSet, records, sweep_nodes: list[str], events: Events, grace: float) -> list[str]:
    by_node = defaultdict(list)
    for rec in records:
        by_node[rec.node].append(rec)
    targets = list(dict.fromkeys([*by_node, *sweep_nodes]))
    for rec in records:
        events(rec.id, "stopping")

    def stop(ex: Executor) -> StopReply:
        procs = [{"pid": r.pid, "pgid": r.pgid, "create_time": r.create_time} for r in by_node.get(ex.node.name, [])]
        run_id = state.run_id if ex.node.name in sweep_nodes else None
        return agent_api.stop(ex, procs, run_id=run_id, grace_secs=grace)

    problems = []
    for node, res in nodes.each(targets, stop).items():
        if isinstance(res, RemoteError):
            problems.append(f"{res} (its processes stay in the state file; retry `pdctl down {state.name}`)")
            continue
        if res["left"]:
            problems.append(f"node {node}: pids {res['left']} survived SIGKILL")
            continue
        for rec in by_node.get(node, []):
            state.processes.pop(rec.id, None)
            events(rec.id, "stopped")
    return problems
