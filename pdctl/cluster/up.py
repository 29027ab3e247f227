"""``up``: preflight every node, launch engines, wait until healthy, router (with a planner that
acts, the prefills' decode CUDA graph capture: pdctl.cluster.graph_capture), then trainer.

Colocated plans first start each node's CUDA MPS control daemon, then the trainer (it claims
its memory share first), then engines and router.

Nothing starts unless every node passes preflight. Every process is recorded in the state
file as soon as its node reports its pid. Any failure, or Ctrl-C, stops everything already
started (on every node) and raises LifecycleError with the failing process's last log lines.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, NoReturn

from pdctl.cluster import planner_process
from pdctl.cluster.down import stop_processes
from pdctl.cluster.graph_capture import capture_decode_graphs
from pdctl.cluster.journal import interrupts_deferred
from pdctl.cluster.keys import ClusterKeys, load_keys, save_keys
from pdctl.cluster.mps import start_daemons, stop_daemons
from pdctl.cluster.nodes import Events, NodeSet, quiet
from pdctl.cluster.router_control import RouterControl, secret_env
from pdctl.cluster.state import ClusterState, Phase, ProcessRecord, StateStore, declared_of, node_to_dict
from pdctl.errors import LifecycleError, RemoteError
from pdctl.node.agent import RUN_ID_ENV
from pdctl.node.replies import SpawnReply, WaitReadyReply
from pdctl.plan import LaunchSpec, Plan
from pdctl.plan.planner import run_dir
from pdctl.remote import agent_api
from pdctl.remote.base import Executor
from pdctl.role_planner.config import PlannerConfig
from pdctl.roles import Role
from pdctl.signals import INTERRUPTS
from pdctl.topology.model import Topology

LOG_TAIL_LINES = 50
WATCH_SLICE_SECS = 2.0
"""While engines start, how often every node is asked whether a watched process died."""
DEFAULT_TRAINER_STARTUP_SECS = 10.0
"""How long ``up`` watches a just-started trainer (``trainer.startup_secs``): an exit with an
error in that time fails ``up``; one that exits 0 has completed."""


def up(
    top: Topology,
    plan: Plan,
    *,
    store: StateStore | None = None,
    nodes: NodeSet | None = None,
    ready_timeout_secs: float = 900.0,
    events: Events = quiet,
    source: str = "",
) -> ClusterState:
    """Bring ``plan`` up. Returns the state (status ``up``).

    Raises:
        LifecycleError: preflight failed (nothing started), or launch failed (all stopped).
    """
    store = store or StateStore()
    if nodes is None:
        with NodeSet(top.nodes) as owned:  # SSH connections closed when up returns
            return up(
                top, plan, store=store, nodes=owned, ready_timeout_secs=ready_timeout_secs, events=events, source=source
            )
    with store.locked(plan.name):
        existing = store.load(plan.name)
        if existing and existing.status != Phase.DOWN and existing.processes:
            raise LifecycleError(
                f"cluster {plan.name!r} is already {existing.status} with {len(existing.processes)} processes; "
                f"run `pdctl down {plan.name}` first"
            )
        _preflight(top, plan, nodes, events)
        state = starting_state(top, plan, source)
        store.save(state)
        save_keys(store, plan.name, ClusterKeys.generate())  # a new engine and control key per up
        try:
            if plan.mps:  # before any GPU process: a CUDA client that finds no daemon runs without MPS
                start_daemons(plan, state, store, nodes, events)
            elif top.placement.colocate:
                events("mps", "placement.mps is false: colocated processes share GPUs without MPS")
            trainers = [p for p in plan.processes if p.role is Role.TRAINER]

            def start_trainers() -> None:
                _launch(trainers, state, store, nodes, top, events)
                _watch_trainers(trainers, state, nodes, plan.trainer_startup_secs)

            if plan.trainer_first:  # it claims its memory share before the engines size their pools
                start_trainers()
            # The router starts with the engines (its startup overlaps theirs); it admits each
            # engine at the engine's first passed health check.
            engines = [p for p in plan.processes if p.role.is_engine]
            _launch([*engines, plan.router], state, store, nodes, top, events)
            entrypoints = [p for p in engines if p.entrypoint]
            others = [p for p in engines if not p.entrypoint]  # node ranks >= 1 of multi-node engines
            watch = [*others, *trainers] if plan.trainer_first else others
            wait_ready(entrypoints, state, nodes, ready_timeout_secs, events, watch=watch)
            wait_ready([plan.router], state, nodes, 60.0, events, path="/readiness")
            if PlannerConfig.from_dict(plan.planner).captures_at_up():
                capture_decode_graphs(state, store, RouterControl.of(state, store), events)
            if not plan.trainer_first:
                start_trainers()
        except (Exception, KeyboardInterrupt) as exc:
            with _uninterrupted():  # a second Ctrl-C must not leave half of it running
                _fail(exc, plan, state, store, nodes, events)
        state.status = Phase.UP
        store.save(state)
        with interrupts_deferred():  # started and recorded whole: `down` must find what runs
            if planner_process.start(state, store) is not None:
                events("planner", f"started (mode {(plan.planner or {}).get('mode')}; log {state.planner['log']})")
                store.save(state)
        return state


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Ignore Ctrl-C (SIGINT), SIGTERM and SIGHUP for the block, when this is the main thread
    (signals go there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in INTERRUPTS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _fail(
    exc: BaseException, plan: Plan, state: ClusterState, store: StateStore, nodes: NodeSet, events: Events
) -> NoReturn:
    """Stop everything that started, then raise LifecycleError saying why ``up`` failed."""
    events("up", "failed; stopping everything that started (Ctrl-C is ignored until that is done)")
    detail = _failure_detail(exc, state, nodes)
    state.status = Phase.FAILED
    store.save(state)
    try:
        stop_processes(state, nodes, events=events)
        state.processes.clear()
        stop_daemons(state, nodes, events)
        state.status = Phase.DOWN
    except LifecycleError as cleanup:
        detail += f"\ncleanup incomplete: {cleanup} (run `pdctl down {plan.name}` to retry)"
    store.save(state)
    raise LifecycleError(detail) from exc


def _preflight(top: Topology, plan: Plan, nodes: NodeSet, events: Events) -> None:
    ports: dict[str, list[int]] = defaultdict(list)
    gpus: dict[str, int] = defaultdict(int)
    for proc in plan.processes:
        ports[proc.node].extend(proc.owned_ports())
        if proc.gpu_ids:
            gpus[proc.node] = max(gpus[proc.node], max(proc.gpu_ids) + 1)
    check_gpus = top.engine == "sglang"
    # The control plane installs without torch; the nodes that run the sim or a trainer need it.
    torch_nodes = {
        p.node for p in plan.processes if p.role is Role.TRAINER or (top.engine == "sim" and p.role.is_engine)
    }
    names = [n.name for n in top.nodes if n.name in ports]
    events("preflight", f"checking {len(names)} node(s)")
    results = nodes.each(
        names,
        lambda ex: agent_api.preflight(ex, sorted(ports[ex.node.name]), check_gpus=check_gpus),
    )
    problems = []
    for name, res in results.items():
        if isinstance(res, RemoteError):
            problems.append(str(res))
            continue
        for busy in res["busy_ports"]:
            owner = (
                f"pid {busy['pid']} ({busy.get('name') or '?'}: {busy.get('cmdline') or ''})"
                if busy.get("pid")
                else ("a process pdctl cannot see (another user?)")
            )
            problems.append(f"node {name}: port {busy['port']} is already in use by {owner}")
        if top.engine == "sglang" and not res["sglang"]:
            problems.append(f"node {name}: sglang is not importable by {res['python']} (pip install sglang)")
        if name in torch_nodes and not res.get("torch", True):
            problems.append(
                f"node {name}: torch is not importable by {res['python']} (the sim engine and the trainer need it: "
                "pip install 'pdctl[sim]')"
            )
        if check_gpus and res.get("gpus", 0) < gpus[name]:
            problems.append(f"node {name}: the plan uses {gpus[name]} GPUs but {res.get('gpus', 0)} are visible")
    if problems:
        raise LifecycleError("preflight failed, nothing was started:\n  " + "\n  ".join(problems))
    events("preflight", "ok")


def _launch(
    specs: list[LaunchSpec], state: ClusterState, store: StateStore, nodes: NodeSet, top: Topology, events: Events
) -> None:
    launch(specs, state, store, nodes, secret_env(top.router.api_key_env), events)


def launch(
    specs: list[LaunchSpec],
    state: ClusterState,
    store: StateStore,
    nodes: NodeSet,
    secrets: dict[str, str],
    events: Events,
) -> None:
    """Start ``specs`` on their nodes (each under its supervisor) and record them in ``state``;
    the router and the trainer get ``secrets`` (the router's client key) and the cluster's keys
    in their environment, engines the engine key (SGLang's ``--api-key``, in a ``--config`` file
    that the node's agent writes 0600: not in the command line, which every user of the node can
    read)."""
    keys = load_keys(store, state.name)
    if keys is not None:
        secrets = {**secrets, **keys.env()}
    by_node: dict[str, list[LaunchSpec]] = defaultdict(list)
    for spec in specs:
        by_node[spec.node].append(spec)
    # The engines whose key goes in a --config file (an older pdctl's key that begins with '-'
    # cannot: SGLang would read it as a flag; that one goes on the command line as before).
    keyed_engines = keys is not None and keyed(state) and not keys.engine.startswith("-")
    key_files = {s.id for s in specs if keyed_engines and s.role.is_engine}

    def spawn(ex: Executor) -> SpawnReply:
        payload = []
        for spec in by_node[ex.node.name]:
            payload.append(spawn_entry(spec, state, keys, secrets, key_file=spec.id in key_files))
            events(spec.id, "starting")
        return agent_api.spawn(ex, payload)

    # Spawned and recorded whole: a Ctrl-C meanwhile waits until the state names every process
    # that started (else it would run with nothing to stop it but a search of the nodes).
    with interrupts_deferred():
        results = nodes.each(list(by_node), spawn)
        errors = []
        for node, res in results.items():
            if isinstance(res, RemoteError):
                errors.append(str(res))
                continue
            configured = res.get("configured", [])
            for spec in by_node[node]:
                if spec.id in key_files and spec.id not in configured:
                    # an older pdctl on the node: it ignored the key file and started the engine open
                    errors.append(
                        f"node {node}: its pdctl did not write {spec.id}'s key file (older than this one?): "
                        "the engine would serve without a key; install this pdctl version on the node"
                    )
                info = res["started"][spec.id]
                state.processes[spec.id] = process_record(spec, info["pid"], info["pgid"], info["create_time"])
                events(spec.id, f"started pid {info['pid']} on {node}")
        store.save(state)
    if errors:
        raise LifecycleError("launch failed: " + "; ".join(errors))


def starting_state(top: Topology, plan: Plan, source: str = "") -> ClusterState:
    """A new run of ``plan``'s cluster, nothing started yet: a new run id, its nodes, run
    directories, plan and what ``apply`` may not change."""
    return ClusterState(
        name=plan.name,
        run_id=uuid.uuid4().hex,
        status=Phase.STARTING,
        nodes=[node_to_dict(n) for n in top.nodes],
        router_url=plan.router_url,
        run_dirs={n.name: run_dir(n, plan.name) for n in top.nodes},
        plan=plan,
        source=source,
        declared=declared_of(top),
    )


def process_record(spec: LaunchSpec, pid: int, pgid: int, create_time: float) -> ProcessRecord:
    """What the state keeps of ``spec``'s started process."""
    return ProcessRecord(
        id=spec.id,
        role=spec.role,
        node=spec.node,
        pid=pid,
        pgid=pgid,
        create_time=create_time,
        log_path=spec.log_path,
        ports=dict(spec.ports),
        url=spec.url,
        health_path=spec.health_path,
        engine_id=spec.engine_id,
        node_rank=spec.node_rank,
        exit_file=_exit_file(spec),
    )


def spawn_entry(
    spec: LaunchSpec, state: ClusterState, keys: ClusterKeys | None, secrets: dict[str, str], *, key_file: bool
) -> dict[str, Any]:
    """What the node agent starts for ``spec`` (pdctl.node.agent ``spawn``): its command, environment,
    log, supervisor story and, for an engine, its key (``key_file``: in a ``--config`` file)."""
    env = {**spec.env, RUN_ID_ENV: state.run_id, "PDCTL_CLUSTER": state.name, "PDCTL_PROCESS": spec.id}
    if spec.role in (Role.ROUTER, Role.TRAINER):  # the trainer's weight pushes call the router
        env.update(secrets)
    entry: dict[str, Any] = {
        "id": spec.id,
        "argv": list(spec.argv),
        "env": env,
        "cwd": spec.cwd,
        "log_path": spec.log_path,
        "exit_file": _exit_file(spec),
        "restart": spec.restart,
    }
    if spec.peer_weights is not None:  # its supervisor starts it from a peer, and relays its seed side
        entry["peer_weights"] = dict(spec.peer_weights)
    if spec.liveness_secs and spec.url:  # probed on SGLang's open /ready (no key needed)
        entry["liveness"] = {"url": spec.url + "/ready", "timeout_secs": spec.liveness_secs}
    if not keyed(state):  # engine_auth: none: the topology asked for engines any caller may reach
        return entry
    if key_file:  # not in the plan: `pdctl plan` never shows it
        assert keys is not None
        entry["config"] = {"api-key": keys.engine}
    elif keys is not None and spec.role.is_engine:
        entry["argv"] = [*spec.argv, f"--api-key={keys.engine}"]  # one word: the key begins with '-'
    return entry


def keyed(state: ClusterState) -> bool:
    """Whether the cluster's engines take the engine key (``engine_auth: key``, the default)."""
    return state.plan.engine_auth != "none"


def _exit_file(spec: LaunchSpec) -> str:
    return spec.log_path + ".exit"


def _watch_trainers(specs: list[LaunchSpec], state: ClusterState, nodes: NodeSet, secs: float) -> None:
    """Fail ``up`` if a trainer exits with an error within ``secs`` of its start (all of them
    exiting 0 ends the watch: the run completed)."""
    if not specs:
        return
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for spec in specs:
        rec = state.processes[spec.id]
        by_node[spec.node].append(
            {"id": spec.id, "pid": rec.pid, "create_time": rec.create_time, "exit_file": rec.exit_file}
        )
    deadline = time.monotonic() + secs
    while True:
        results = nodes.each(list(by_node), lambda ex: agent_api.status(ex, by_node[ex.node.name]))
        finished = True
        for res in results.values():
            if isinstance(res, RemoteError):
                raise res
            for proc_id, entry in res["processes"].items():
                code = entry.get("exit_code")
                if not entry["alive"] and code != 0:
                    why = f"it exited with code {code} within {secs:g}s of its start (trainer.startup_secs)"
                    raise not_ready(proc_id, why, state, nodes)
                finished &= not entry["alive"]
        if finished or time.monotonic() >= deadline:
            return
        time.sleep(0.5)


class ReadinessError(LifecycleError):
    """A process did not become ready in time, or exited first (``process_id`` names it); the message says why."""

    def __init__(self, process_id: str, reason: str):
        super().__init__(f"{process_id} did not become ready: {reason}")
        self.process_id = process_id


def wait_ready(
    specs: list[LaunchSpec],
    state: ClusterState,
    nodes: NodeSet,
    timeout: float,
    events: Events,
    path: str | None = None,
    watch: list[LaunchSpec] | None = None,
) -> None:
    """Wait until every spec answers its health path; fail at the first death among them or
    among ``watch`` (the other node ranks of multi-node engines: no HTTP API of their own,
    but their engine cannot come up without them). With processes to watch, each node is
    asked in slices of WATCH_SLICE_SECS, so a death on any node ends the wait within one."""
    targets: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for spec in specs:
        rec = state.processes[spec.id]
        url = f"{spec.url}{path or spec.health_path or '/health'}"
        targets[spec.node][spec.id] = {
            "id": spec.id,
            "url": url,
            "pid": rec.pid,
            "create_time": rec.create_time,
            "exit_file": rec.exit_file,
        }
        events(spec.id, "waiting until healthy")
    watched: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for spec in watch or []:
        rec = state.processes[spec.id]
        watched[spec.node].append(
            {"id": spec.id, "pid": rec.pid, "create_time": rec.create_time, "exit_file": rec.exit_file}
        )
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        slice_secs = min(left, WATCH_SLICE_SECS) if watched else left
        involved = [n for n in {**targets, **watched} if targets.get(n) or watched.get(n)]

        def wait_slice(ex: Executor, s: float = slice_secs) -> WaitReadyReply:
            return agent_api.wait_ready(ex, list(targets[ex.node.name].values()), watched[ex.node.name], s)

        results = nodes.each(involved, wait_slice)
        for node, res in results.items():
            if isinstance(res, RemoteError):
                raise res
            if res.get("died"):
                raise not_ready(res["died"], res["reason"], state, nodes)
            for proc_id in res.get("ready_ids", []):
                targets[node].pop(proc_id, None)
                events(proc_id, "healthy")
        if not any(targets.values()):
            return
        if time.monotonic() >= deadline:
            late = min(i for t in targets.values() for i in t)
            raise not_ready(late, f"not healthy after {timeout:.0f}s", state, nodes)


def _failure_detail(exc: BaseException, state: ClusterState, nodes: NodeSet) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted; everything that started was stopped"
    return str(exc)


def not_ready(process_id: str, reason: str, state: ClusterState, nodes: NodeSet) -> ReadinessError:
    """The ReadinessError for ``process_id``, its log's last lines appended: why it died or hangs
    is there, and `up`, `restart` and `apply` all print it (an engine that died on a busy port
    said only 'process exited')."""
    rec = state.processes.get(process_id)
    if rec is None:
        return ReadinessError(process_id, reason)
    try:
        tail = agent_api.read_tail(nodes.executor(rec.node), rec.log_path, LOG_TAIL_LINES)
        reason += f"\n--- last {LOG_TAIL_LINES} lines of {rec.log_path} on {rec.node} ---\n{tail.get('data', '')}"
    except RemoteError as read_error:
        reason += f"\n(could not read its log: {read_error})"
    return ReadinessError(process_id, reason)
