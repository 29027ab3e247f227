"""``status`` and ``logs``: read-only views of a running cluster."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pdctl.cluster import planner_process
from pdctl.cluster.journal import entry_of
from pdctl.cluster.keys import load_keys
from pdctl.cluster.mps import MpsStatus, daemon_status
from pdctl.cluster.nodes import NodeSet
from pdctl.cluster.planner_record import recent_decisions
from pdctl.cluster.state import ClusterState, Phase, StateStore
from pdctl.errors import LifecycleError, RemoteError
from pdctl.node.seed_states import PeerState
from pdctl.remote import agent_api
from pdctl.roles import Role
from pdctl.sglang import Endpoint


@dataclass
class ProcessStatus:
    """One recorded process as ``pdctl status`` reports it: what its node says of it now (alive,
    health, supervisor's story) and, for an engine, the weight version it serves."""

    id: str
    role: str
    node: str
    pid: int
    alive: bool | None  # None: node unreachable
    healthy: bool | None = None
    weight_version: str | None = None
    ports: dict[str, int] = field(default_factory=dict)
    uptime_secs: float | None = None
    url: str | None = None
    error: str | None = None
    exit_code: int | None = None
    """For a process that has exited and whose status was kept (trainers)."""
    restarts: int | None = None
    """How often its node's supervisor restarted it (pdctl.node.supervise); None: unknown."""
    last_exit: dict[str, Any] | None = None
    """Its last exit: ``{"code": N (negative: killed by signal -N), "at": epoch seconds}``."""
    supervisor: str | None = None
    """running, backoff (restarting), exited, gave_up (left down: ``reason`` says why)."""
    reason: str | None = None
    peer: dict[str, Any] | None = None
    """Its last start's weights from a peer (pdctl.node.peer_weights): ``state`` and ``detail``."""
    supervisor_pid: int | None = None
    """The recorded process: its supervisor (``pid`` is the supervised process)."""
    kept_args: dict[str, list[Any]] | None = None
    """A switched engine's flags that differ from its group's, ``{flag: [its value, its group's]}``,
    while the process that switched runs (its next restart takes its group's)."""

    @property
    def completed(self) -> bool:
        """A trainer that ran to its end with exit 0: the run is done, nothing is wrong."""
        return self.role == Role.TRAINER and self.alive is False and self.exit_code == 0

    @property
    def ok(self) -> bool:
        """Alive and not known to be unhealthy, or a trainer that completed."""
        return (bool(self.alive) and self.healthy is not False) or self.completed


@dataclass
class EngineStatus:
    """One engine as a lifecycle unit: up only while every one of its processes (one per
    node for a multi-node engine) is alive and its entrypoint is healthy."""

    id: str
    role: str
    processes: list[str]
    up: bool
    problem: str | None = None
    """What is wrong, e.g. ``decode-0.h2 is not running``."""
    rotation: str | None = None
    """Why the router does not route to it although it runs (cordoned, quarantined, failing the
    router's checks, its circuit open, not registered); None: in rotation, or no router to ask."""


@dataclass
class ClusterStatus:
    """A cluster's status as ``pdctl status`` reports it: its phase, every process, every engine as a
    unit, the router's workers and hold, MPS daemons, an unfinished day-2 step and the planner."""

    name: str
    status: Phase
    router_url: str | None
    processes: list[ProcessStatus]
    router_workers: list[dict[str, Any]] | None = None
    engines: list[EngineStatus] = field(default_factory=list)
    mps: list[MpsStatus] = field(default_factory=list)
    """Each node's CUDA MPS control daemon (colocated clusters)."""
    step: str | None = None
    """A day-2 command's step on one engine that did not finish (pdctl.cluster.journal), or one in
    progress now (``in progress:``)."""
    hold: dict[str, Any] | None = None
    """What holds the router's new requests now (a framework's pause, a push), as the router says:
    ``reason`` in words, ``since`` (epoch seconds), ``secs``."""
    planner: list[dict[str, Any]] = field(default_factory=list)
    """The P:D planner's latest decisions (``pdctl planner``; pdctl.cluster.planner_loop), oldest first."""
    planner_process: dict[str, Any] | None = None
    """The planner ``up`` started (pdctl.cluster.planner_process.describe), if any."""

    @property
    def ok(self) -> bool:
        """Up as declared: every process alive and healthy (the router's readiness says it can
        serve each role), every engine of the plan up and in the router's rotation, no day-2
        step left half done, no weight update holding the router's requests, and its planner
        (if it runs one) running."""
        return (
            self.status == Phase.UP
            and all(p.ok for p in self.processes)
            and all(e.up and e.rotation is None for e in self.engines)
            and self.step is None
            and self.hold is None
            and (self.planner_process is None or bool(self.planner_process["alive"]))
        )

    @property
    def completed(self) -> bool:
        """Its trainer ran to its end with exit 0 (the engines and router still serve)."""
        trainers = [p for p in self.processes if p.role == Role.TRAINER]
        return bool(trainers) and all(p.completed for p in trainers)

    def to_dict(self) -> dict[str, Any]:
        """The status as JSON-ready data, with ``ok`` and ``completed`` added."""
        from dataclasses import asdict

        return {**asdict(self), "ok": self.ok, "completed": self.completed}


def status(name: str, *, store: StateStore | None = None, nodes: NodeSet | None = None) -> ClusterStatus:
    store = store or StateStore()
    state = load_state(store, name)
    if nodes is None:
        with NodeSet(state.node_objects().values()) as owned:  # connections closed on return
            return status(name, store=store, nodes=owned)
    keys = load_keys(store, name)
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in state.processes.values():
        query: dict[str, Any] = {"id": rec.id, "pid": rec.pid, "create_time": rec.create_time}
        if rec.exit_file:
            query["exit_file"] = rec.exit_file
        if rec.url and rec.health_path:
            query["health_url"] = rec.url + ("/readiness" if rec.role == Role.ROUTER else rec.health_path)
            query["info_url"] = rec.url + ("/workers" if rec.role == Role.ROUTER else Endpoint.MODEL_INFO.value)
            if keys is not None:  # the router's /workers is control plane, an engine's /model_info needs its key
                query["info_key"] = keys.control if rec.role == Role.ROUTER else keys.engine
        by_node[rec.node].append(query)
    results = nodes.each(by_node, lambda ex: agent_api.status(ex, by_node[ex.node.name], timeout=60))
    out: list[ProcessStatus] = []
    router_workers = None
    hold = None
    for rec in state.processes.values():
        res = results.get(rec.node)
        ps = ProcessStatus(
            id=rec.id, role=rec.role, node=rec.node, pid=rec.pid, alive=None, ports=rec.ports, url=rec.url
        )
        if isinstance(res, RemoteError):
            ps.error = str(res)
        elif res is not None:
            entry = res["processes"][rec.id]
            ps.alive = entry["alive"]
            ps.healthy = entry.get("healthy")
            ps.uptime_secs = entry.get("uptime_secs")
            ps.exit_code = entry.get("exit_code")
            ps.restarts = entry.get("restarts")
            ps.last_exit = entry.get("last_exit")
            ps.supervisor = entry.get("supervisor")
            ps.reason = entry.get("reason")
            ps.peer = entry.get("peer")
            if entry.get("child_pid"):
                ps.supervisor_pid, ps.pid = rec.pid, int(entry["child_pid"])
            info = entry.get("info")
            if isinstance(info, dict):
                if rec.role == Role.ROUTER:
                    router_workers = info.get("workers")
                    hold = info.get("hold") if isinstance(info.get("hold"), dict) else None
                else:
                    ps.weight_version = info.get("weight_version")
        out.append(ps)
    planned = state.plan.process_map()
    for ps in out:
        spec = planned.get(ps.id)
        kept = spec.kept_args if spec is not None else None
        if kept is not None and kept.pid == ps.pid and ps.alive:
            ps.kept_args = {flag: list(pair) for flag, pair in kept.args.items()}
    order = state.plan.order()
    out.sort(key=lambda p: order.get(p.id, len(order)))  # plan order: prefill, decode, router, trainer
    engines, daemons = _engines(state, out, router_workers, hold), daemon_status(state, nodes)
    result = ClusterStatus(state.name, state.status, state.router_url, out, router_workers, engines, daemons)
    result.step = _step(state)
    result.hold = hold
    result.planner = recent_decisions(store, name, 5)  # (pdctl.cluster.planner_record)
    result.planner_process = planner_process.describe(state)
    return result


def _step(state: ClusterState) -> str | None:
    entry, ahead = entry_of(state), state.cordoned_ahead
    said = []
    if entry is not None:
        if _running_pdctl(entry.pid):
            said.append(f"in progress: `pdctl {entry.command}` (pid {entry.pid}) is to {entry.kind.value} {entry.unit}")
        else:
            said.append(f"{entry.describe()}; run `pdctl {entry.command}` again to finish it, or `pdctl down`")
    if ahead is not None:
        engines, command = ", ".join(sorted(ahead["engines"])), ahead["command"]
        if _running_pdctl(int(ahead["pid"])):
            said.append(f"in progress: `pdctl {command}` (pid {ahead['pid']}) drains {engines} ahead of their switch")
        else:
            said.append(
                f"`pdctl {command}` stopped with {engines} out of rotation ahead of a switch it never made; the "
                "next `pdctl switch`, `restart` or `apply` (or the planner, as it starts again) takes them back"
            )
    return "; ".join(said) or None


def _running_pdctl(pid: int) -> bool:
    """Whether ``pid`` is a pdctl command still running on this machine (a journal's writer)."""
    import psutil

    try:
        return pid > 0 and "pdctl" in " ".join(psutil.Process(pid).cmdline())
    except (psutil.Error, OSError):
        return False


def rotation_of(worker: dict[str, Any] | None) -> str | None:
    """Why the router does not route to a worker it lists (None: it does)."""
    if worker is None:
        return "not registered with the router"
    if worker.get("cordoned"):
        return f"cordoned ({worker['cordoned']})"
    if worker.get("quarantined"):
        return f"quarantined ({worker['quarantined']})"
    if not worker.get("is_healthy"):
        return "failing the router's health checks"
    if worker.get("circuit_open"):
        return "its circuit breaker is open"
    return None


def _engines(
    state: ClusterState,
    processes: list[ProcessStatus],
    router_workers: list[dict[str, Any]] | None,
    hold: dict[str, Any] | None = None,
) -> list[EngineStatus]:
    by_id = {p.id: p for p in processes}
    listed = {w.get("url"): w for w in router_workers or [] if isinstance(w, dict)}
    out = []
    for engine in state.plan.engines:
        ids = list(engine.process_ids)
        problem = None
        paused = False
        for pid in ids:
            p = by_id.get(pid)
            if p is None or p.alive is False:
                problem = f"{pid} is not running"
            elif p.alive is None:
                problem = f"{pid} cannot be reached ({p.error})"
            elif p.healthy is False and hold is not None and (listed.get(engine.url) or {}).get("is_healthy"):
                # Paused by the update that holds the router: SGLang's /health (a generation) waits
                # while paused; the router, which reads /model_info meanwhile, says it is alive.
                paused = True
            elif p.healthy is False:
                problem = f"{pid} fails its health check"
            if problem:
                break
        rotation = f"paused: the router is {hold.get('reason')}" if paused and hold is not None else None
        if router_workers is not None and engine.url and problem is None and not paused:
            rotation = rotation_of(listed.get(engine.url))
            peer = by_id[ids[0]].peer if ids and ids[0] in by_id else None
            if rotation and peer and peer.get("state") != PeerState.DONE:  # why no peer brought the fleet's weights
                rotation += f"; weights from a peer: {peer.get('state')}: {peer.get('detail')}"
        out.append(EngineStatus(engine.id, engine.role.value, ids, problem is None, problem, rotation))
    return out


def load_state(store: StateStore, name: str) -> ClusterState:
    """The state of cluster ``name``; LifecycleError when there is none."""
    state = store.load(name)
    if state is None:
        raise LifecycleError(f"no cluster {name!r} in {store.root}")
    return state


@dataclass(frozen=True)
class LogSource:
    """Where a process's log lives: its node and path (a stopped process's too)."""

    node: str
    log_path: str


def _log_source(state: ClusterState, process: str) -> LogSource:
    if process in state.processes:
        rec = state.processes[process]
        return LogSource(rec.node, rec.log_path)
    for spec in state.plan.processes:
        if spec.id == process:  # stopped, but its log is still on the node
            return LogSource(spec.node, spec.log_path)
    known = ", ".join(p.id for p in state.plan.processes) or "none"
    raise LifecycleError(f"no process {process!r} in cluster {state.name!r}; processes: {known}")


def logs(
    name: str,
    process: str,
    *,
    lines: int = 50,
    follow: bool = False,
    store: StateStore | None = None,
    nodes: NodeSet | None = None,
    poll_secs: float = 0.5,
    stop: Callable[[], bool] = lambda: False,
) -> Iterator[str]:
    """Yield the last ``lines`` lines of a process's log, then (with follow) new text as it comes."""
    store = store or StateStore()
    state = load_state(store, name)
    source = _log_source(state, process)
    if nodes is None:
        with NodeSet(state.node_objects().values()) as owned:  # its SSH connection closed when done
            yield from logs(name, process, lines=lines, follow=follow, store=store, nodes=owned,
                            poll_secs=poll_secs, stop=stop)  # fmt: skip
        return
    ex = nodes.executor(source.node)
    first = agent_api.read_tail(ex, source.log_path, lines)
    if "error" in first:
        raise LifecycleError(f"node {source.node}: {first['error']}")
    yield first["data"]
    offset = first["size"]
    while follow and not stop():
        time.sleep(poll_secs)
        chunk = agent_api.read_from(ex, source.log_path, offset)
        if chunk.get("data"):
            yield chunk["data"]
        offset = chunk.get("size", offset)
