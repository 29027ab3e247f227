"""``apply``: change a running cluster to match its edited topology, without a full restart.

The new topology is planned with the running processes' ports and GPUs kept (PortCursors ``keep``,
place_gpus ``keep``), then compared with the running plan engine by engine:
- an engine only in the new plan is **added**: started, then registered with the router, which
  takes it into rotation once it is healthy and holds the fleet's weight version;
- one whose processes differ (command line, environment, node, GPUs) is **replaced**, one at a
  time, as ``pdctl restart`` does (cordon, drain, stop, start the new command, back in rotation);
- one that leaves the file beside one of the other PD role that enters it, both in groups with
  ``role_switch``, is **switched** live (pdctl.cluster.switch: no restart, same GPUs and ports);
- one only in the running plan is **removed**: cordoned (its requests finish), unregistered,
  stopped.
Running engines keep their GPUs as well as their ports. Added first, replaced and switched next,
removed last, so that a role never drops to zero capacity. The
router learns worker changes through its worker API (and keeps them across its own restarts);
a router whose own settings changed is replaced (its clients see a short outage). Fields that
cannot change live (``declared_of``) are refused, naming the field, unless ``recreate`` (then
the cluster is taken down and brought up again). The trainer keeps running as it is: its weight
group does not yet learn the new engine set.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType
from typing import Any

from pdctl.cluster import switch
from pdctl.cluster.down import down, stop_records
from pdctl.cluster.journal import ChangeKind, Journal, StepPhase, interrupts_deferred
from pdctl.cluster.nodes import Events, NodeSet, quiet
from pdctl.cluster.restart import (
    drop_unit,
    engine_role,
    recover,
    relaunch,
    replace_engine,
    wait_routable,
)
from pdctl.cluster.router_control import RouterControl
from pdctl.cluster.state import ClusterState, Phase, StateStore, declared_of
from pdctl.cluster.step import StepContext
from pdctl.cluster.up import launch, up, wait_ready
from pdctl.errors import LifecycleError, RemoteError, TopologyError
from pdctl.plan import LaunchSpec, Plan, make_plan
from pdctl.plan.model import EngineSpec, KeptArgs
from pdctl.remote import agent_api
from pdctl.roles import Role
from pdctl.router.config import Flag
from pdctl.topology.model import Topology

COMPARED = ("argv", "env", "node", "host", "gpu_ids", "ports", "cwd")
"""What makes a running process different from its new plan (and so replaced)."""
WORKER_FLAGS = {Flag.PREFILL: 2, Flag.DECODE: 1}
"""The router's per-worker flags and how many values each takes (the worker API changes those)."""


@dataclass(frozen=True)
class Change:
    """One step of an apply: a unit (an engine, or the router) to add, replace, switch or remove, the
    processes it touches, and why."""

    kind: ChangeKind
    unit: str  # an engine id, or "router"
    processes: tuple[str, ...]
    why: str
    was: str | None = None
    """A switch: the running engine that becomes ``unit`` (pdctl.cluster.switch)."""
    to_role: Role | None = None
    """A switch: the role it takes."""
    keeps: dict[str, list[str | None]] = field(default_factory=dict)
    """A switch: the flags the switched process keeps from its old group until its next restart,
    ``{flag: [its value, its new group's]}`` (SGLang keeps a process's args across a switch)."""


@dataclass
class ApplyPlan:
    """What ``apply`` would do to a cluster: its changes in the order they run, the fields it refuses
    to change live, and notes for the user. Empty changes and refusals mean the cluster already
    matches."""

    name: str
    changes: list[Change] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    """``field: was -> now``, for each field that cannot change on a running cluster."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (``pdctl apply --json``)."""
        changes = [{**asdict(c), "kind": c.kind.value} for c in self.changes]
        return {"name": self.name, "changes": changes, "refused": self.refused, "notes": self.notes}

    def text(self) -> str:
        """The plan as lines for a person: one per change, refusal and note, or one line saying there
        is nothing to do."""
        if not self.changes and not self.refused:
            return f"cluster {self.name!r} already matches the file; nothing to do"
        lines = [f"cluster {self.name!r}:"]
        signs = {ChangeKind.ADD: "+", ChangeKind.REPLACE: "~", ChangeKind.REMOVE: "-", ChangeKind.SWITCH: "="}
        for c in self.changes:
            if c.kind is ChangeKind.SWITCH:
                lines.append(f"  = switch {c.was} -> {c.to_role} (becomes {c.unit}): {c.why}")
            else:
                lines.append(f"  {signs[c.kind]} {c.kind.value} {c.unit} ({', '.join(c.processes)}): {c.why}")
        for r in self.refused:
            lines.append(f"  ! refused {r}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def diff(state: ClusterState, top: Topology, plan: Plan, switches: Mapping[str, str] | None = None) -> ApplyPlan:
    """What applying ``plan`` (``top``'s, planned with the running ports and GPUs kept) would
    change; ``switches`` (new engine id -> the running engine it is) are made by role switch
    instead of an add and a removal."""
    switches = switches or {}
    switched = set(switches.values())
    out = ApplyPlan(state.name)
    was = state.declared or {}
    for key, value in declared_of(top).items():
        if key in was and was[key] != value:
            out.refused.append(f"{key}: {was[key]!r} -> {value!r} cannot change on a running cluster (use --recreate)")
    old = _units(state.plan.processes)
    new = _units(plan.processes)
    for unit, procs in new.items():
        if unit.startswith("trainer"):
            continue
        if unit in switches:
            planned = next(iter(procs.values()))
            role = planned.role
            running = next(iter(old.get(switches[unit], {}).values()), None)
            keeps: dict[str, list[str | None]] = {}
            if running is not None:
                derived = switch.switched_spec(running, unit, role)
                keeps, _ = switch.kept_args(list(derived.argv), list(planned.argv))
            why = "no restart: same process, GPUs and ports"
            if keeps:
                kept = ", ".join(f"{flag} {mine} (its new group's: {theirs})" for flag, (mine, theirs) in keeps.items())
                why += f"; until its next restart it keeps its own {kept}"
            out.changes.append(
                Change(ChangeKind.SWITCH, unit, tuple(procs), why, was=switches[unit], to_role=role, keeps=keeps)
            )
            continue
        if unit not in old:
            out.changes.append(Change(ChangeKind.ADD, unit, tuple(procs), "new in the file"))
            continue
        why = _difference(old[unit], procs, router=unit == "router")
        if why:
            out.changes.append(Change(ChangeKind.REPLACE, unit, tuple(procs), why))
    for unit, procs in old.items():
        if unit not in new and not unit.startswith("trainer") and unit not in switched:
            out.changes.append(Change(ChangeKind.REMOVE, unit, tuple(procs), "no longer in the file"))
    order = {ChangeKind.ADD: 0, ChangeKind.REPLACE: 1, ChangeKind.SWITCH: 2, ChangeKind.REMOVE: 3}
    out.changes.sort(key=lambda c: (order[c.kind], c.unit == "router"))
    if any(u.startswith("trainer") for u in new) and any(c.unit != "router" for c in out.changes):
        out.notes.append("the trainer keeps running as it is: its weight group does not include added engines yet")
    return out


def _units(processes: tuple[LaunchSpec, ...]) -> dict[str, dict[str, LaunchSpec]]:
    """Processes grouped by lifecycle unit: engine id, ``router``, ``trainer``."""
    units: dict[str, dict[str, LaunchSpec]] = {}
    for spec in processes:
        unit = spec.engine_id or ("router" if spec.role is Role.ROUTER else "trainer")
        units.setdefault(unit, {})[spec.id] = spec
    return units


def _difference(old: dict[str, LaunchSpec], new: dict[str, LaunchSpec], *, router: bool) -> str:
    """Why unit ``old`` (as it runs) must be replaced to become ``new`` (as planned); empty when it need not."""
    if set(old) != set(new):
        return f"processes {sorted(old)} -> {sorted(new)}"
    for pid, spec in new.items():
        for key in COMPARED:
            a, b = _compared(old[pid], key), _compared(spec, key)
            if key == "argv" and router:
                a, b = _router_settings(a), _router_settings(b)
            if key == "argv" and old[pid].switched and a != b:
                # A switched engine runs its old group's soft flags until its next restart (SGLang keeps
                # a process's args across a switch): only a flag that changes its tensors or parallelism
                # is a reason to restart it.
                _, hard = switch.kept_args(a, b)
                if not hard:
                    continue
            if a != b:
                return f"{pid}: {key} changed" + (f" ({a} -> {b})" if key in ("gpu_ids", "ports", "node") else "")
    return ""


def _compared(spec: LaunchSpec, key: str) -> Any:
    """Field ``key`` of ``spec`` as plain data (lists and dicts), as a change's reason prints it."""
    value = getattr(spec, key)
    if isinstance(value, tuple):
        return list(value)
    return dict(value) if isinstance(value, Mapping) else value


def _router_settings(argv: list[str]) -> list[str]:
    """The router's command line without its worker list (which the worker API changes live)."""
    out, skip = [], 0
    for i, arg in enumerate(argv):
        if skip:
            skip -= 1
        elif arg in WORKER_FLAGS:
            skip = WORKER_FLAGS[arg]
        elif arg == Flag.WORKER_URLS:
            skip = len(list(a for a in argv[i + 1 :] if a.startswith(("http://", "https://"))))
        elif arg != Flag.PD_DISAGGREGATION:
            out.append(arg)
    return out


def keep_ports(state: ClusterState) -> dict[str, tuple[str, int, int]]:
    """The running processes' ports, for the planner (``PROCESS:NAME`` -> node, port, count)."""
    out = {}
    for spec in state.plan.processes:
        for name, port in spec.ports.items():
            count = spec.dist_init_block if name == "dist_init" else 1
            out[f"{spec.id}:{name}"] = (spec.node, int(port), max(1, count))
    return out


def apply(
    top: Topology,
    *,
    dry_run: bool = False,
    recreate: bool = False,
    store: StateStore | None = None,
    nodes: NodeSet | None = None,
    events: Events = quiet,
    source: str = "",
    ready_timeout_secs: float = 900.0,
) -> ApplyPlan:
    """Change running cluster ``top.name`` to match ``top``; returns what changed (or would).

    Raises:
        LifecycleError: no such cluster, not up, a refused change (without ``recreate``), or a
            step that failed (what was done stays done; the state file says what runs).
    """
    store = store or StateStore()
    state = store.load(top.name)
    if state is None:
        raise LifecycleError(f"no cluster {top.name!r} in {store.root}; start it with `pdctl up`")
    if state.status != Phase.UP:
        raise LifecycleError(f"cluster {top.name!r} is {state.status}; apply works on a cluster that is up")
    plan, changes = _planned(state, top)
    if dry_run:
        return changes
    if changes.refused:
        if not recreate:
            raise LifecycleError("apply refused:\n  " + "\n  ".join(changes.refused))
        events("apply", "recreating the cluster (--recreate)")
        down(top.name, store=store, events=events)
        up(top, make_plan(top), store=store, events=events, source=source, ready_timeout_secs=ready_timeout_secs)
        return changes
    if not changes.changes:
        return changes
    with store.locked(top.name):
        if nodes is None:
            with NodeSet(top.nodes) as owned:
                _apply(state, store, owned, top, plan, changes, events, ready_timeout_secs)
        else:
            _apply(state, store, nodes, top, plan, changes, events, ready_timeout_secs)
    return changes


def _planned(state: ClusterState, top: Topology) -> tuple[Plan, ApplyPlan]:
    """``top`` planned on the running cluster (its engines keep their ports and GPUs), and what
    applying it changes: an engine that leaves the file beside one of the other role that enters
    it is switched live where it may be (pdctl.cluster.switch), planned on the running one's GPUs
    and ports."""
    ports = keep_ports(state)
    plan = make_plan(top, ports, switch.keep_gpus(state))
    changes = diff(state, top, plan)
    removed = [c.unit for c in changes.changes if c.kind is ChangeKind.REMOVE]
    added = {c.unit for c in changes.changes if c.kind is ChangeKind.ADD}
    pairs = switch.candidates(state, removed, {e.id: e for e in plan.engines if e.id in added})
    unswitchable: dict[str, str] = {}
    while pairs:  # (twice at most: the pairs that hold on their new GPUs and ports)
        alias_ports, alias_gpus = switch.aliases(state, pairs, ports)
        try:
            aliased = make_plan(top, alias_ports, alias_gpus)
        except TopologyError:
            break
        held, why = switch.confirmed(state, pairs, aliased.process_map())
        unswitchable.update(why)
        if held == pairs:
            result = diff(state, top, aliased, {new: old for old, new in pairs})
            result.notes += _not_switched(unswitchable)
            return aliased, result
        pairs = held
    changes.notes += _not_switched(unswitchable)
    return plan, changes


def _not_switched(why: Mapping[str, str]) -> list[str]:
    return [f"{old}: {reason}; it is added and removed instead (a restart)" for old, reason in why.items()]


def _apply(
    state: ClusterState,
    store: StateStore,
    nodes: NodeSet,
    top: Topology,
    plan: Plan,
    changes: ApplyPlan,
    events: Events,
    ready_timeout: float,
) -> None:
    from pdctl.cluster.state import node_to_dict

    state.nodes = [node_to_dict(n) for n in top.nodes]  # nodes may be added
    state.run_dirs.update({n.name: state.run_dirs.get(n.name) or _run_dir(plan, n.name) for n in top.nodes})
    router = RouterControl.of(state, store)
    journal = Journal(state, store, "apply")
    recover(state, store, nodes, router, events, ready_timeout)
    old_engines = state.plan.engine_map()
    _check_switches(state, store, changes, {e.id: e for e in plan.engines}, old_engines)
    # Engines that switch after the first are cordoned ahead as it begins, so that their drains
    # overlap (as in a move of `pdctl switch` or the planner: pdctl.cluster.switch.switch_all); only
    # in a move one way: switches both ways (a swap) go one at a time, as _check_switches counts
    # each role between them, and one cordoned ahead would leave its role without it meanwhile.
    switches = [c for c in changes.changes if c.kind is ChangeKind.SWITCH and c.was]
    ahead = [c.was for c in switches[1:] if c.was] if len({c.to_role for c in switches}) == 1 else []
    step = StepContext(state, store, nodes, router, journal, events, ready_timeout)
    with switch.cordons_lifted_on_failure(state, store, router, events):
        _changes(step, plan, changes, old_engines, ahead)
    changed = {c.unit for c in changes.changes}
    state.plan = replace(plan, processes=_running_specs(state, plan, changed))
    state.declared = declared_of(top)
    store.save(state)


def _changes(
    step: StepContext, plan: Plan, changes: ApplyPlan, old_engines: Mapping[str, EngineSpec], ahead: list[str]
) -> None:
    """Make ``changes`` in their order (adds, replacements, switches, removals) toward ``plan``
    (``old_engines``: the running ones before); as the first switch begins, the engines of the
    others (``ahead``) are cordoned ahead."""
    state, store, nodes, router, journal = step.state, step.store, step.nodes, step.router, step.journal
    events, ready_timeout = step.events, step.ready_timeout
    specs = {s.id: s for s in plan.processes}
    engines = {e.id: e for e in plan.engines}
    for change in changes.changes:
        unit_specs = unclaimed_logs(state, [specs[p] for p in change.processes if p in specs])
        if change.kind is ChangeKind.ADD:
            _add(state, store, nodes, router, journal, change, unit_specs, engines[change.unit], events, ready_timeout)
        elif change.kind is ChangeKind.REPLACE and change.unit == "router":
            events("router", "replacing (its clients see a short outage)")
            relaunch(state, store, nodes, unit_specs, events, ready_timeout, router_secrets=True)
            wait_ready(unit_specs, state, nodes, 60.0, events, path="/readiness")
        elif change.kind is ChangeKind.REPLACE:
            replace_engine(state, store, nodes, router, change.unit, unit_specs, events, ready_timeout, journal)
        elif change.kind is ChangeKind.SWITCH:
            assert change.was is not None
            spec = specs[change.unit]
            if change.keeps:  # what `status` shows until its next restart (its supervisor restarts it as planned)
                pid = switch.serving_pid(state, nodes, change.was)
                args = {flag: (mine, theirs) for flag, (mine, theirs) in change.keeps.items()}
                spec = replace(spec, kept_args=KeptArgs(pid=pid, args=MappingProxyType(args)))
            switch.cordon_ahead(state, router, journal, "apply", ahead, events)
            ahead = []  # (the first switch's only)
            switch.switch_engine(step, change.was, engines[change.unit], spec)
            continue  # the switch wrote the state's plan
        else:
            _remove(state, store, nodes, router, journal, change, old_engines[change.unit].url, events)
        state.plan = _merged_plan(state, plan, change)
        if state.journal is not None:  # an add: done once the plan names it
            journal.end()
        else:
            store.save(state)


def _check_switches(
    state: ClusterState,
    store: StateStore,
    changes: ApplyPlan,
    engines: dict[str, EngineSpec],
    old_engines: dict[str, EngineSpec],
) -> None:
    """Refuse, before any step, an apply whose switches cannot be made: an engine to switch that
    does not answer (dead, or being restarted by its supervisor), or a step after which a PD fleet
    would have no engine of a role (steps run one by one: the fleet serves between them)."""
    dead = [
        c.was
        for c in changes.changes
        if c.kind is ChangeKind.SWITCH and c.was and engine_role(state, store, old_engines[c.was].url) is None
    ]
    if dead:
        raise LifecycleError(
            f"{', '.join(dead)} does not answer: a switch needs the engine running, and nothing was changed; once "
            f"its supervisor has brought it back (`pdctl status {state.name}`), or after `pdctl restart`, apply again"
        )
    counts = Counter(e.role.value for e in old_engines.values())
    if not counts[Role.PREFILL.value] or not counts[Role.DECODE.value]:
        return  # not a PD fleet (or not one yet): nothing to keep
    for change in changes.changes:
        if change.kind is ChangeKind.ADD:
            counts[engines[change.unit].role.value] += 1
        elif change.kind is ChangeKind.REMOVE:
            counts[old_engines[change.unit].role.value] -= 1
        elif change.kind is ChangeKind.SWITCH and change.was:
            counts[old_engines[change.was].role.value] -= 1
            counts[engines[change.unit].role.value] += 1
        empty = [r for r in (Role.PREFILL.value, Role.DECODE.value) if counts[r] <= 0]
        if empty:
            raise LifecycleError(
                f"the step '{change.kind} {change.was or change.unit}' would leave the fleet with no {empty[0]} "
                "(steps run one at a time and the fleet serves between them; a PD fleet serves nothing without "
                f"a {empty[0]}); nothing was changed: apply a file with one more {empty[0]} first"
            )


def _add(
    state: ClusterState,
    store: StateStore,
    nodes: NodeSet,
    router: RouterControl,
    journal: Journal,
    change: Change,
    specs: list[LaunchSpec],
    engine: EngineSpec,
    events: Events,
    ready_timeout: float,
) -> None:
    """Start a new engine and register it with the router; one that does not join (it fails, the
    router refuses it, Ctrl-C) is stopped and unregistered again: nothing runs that the plan lacks."""
    _preflight(nodes, specs)
    journal.begin(change.unit, ChangeKind.ADD, engine.url, change.processes)
    try:
        events(change.unit, "starting")
        launch(specs, state, store, nodes, {}, events)
        journal.phase(StepPhase.STARTED)
        entry = next(s for s in specs if s.entrypoint)
        wait_ready([entry], state, nodes, ready_timeout, events, watch=[s for s in specs if not s.entrypoint])
        router.add(engine.url or "", engine.role, engine.prefill_bootstrap_port)
        wait_routable(router, change.unit, engine.url or "", ready_timeout, events)
    except BaseException:
        with interrupts_deferred():
            events(change.unit, "did not join: stopping it again")
            started = [state.processes[p] for p in change.processes if p in state.processes]
            try:
                stop_records(state, nodes, started, events=events)
                if engine.url:
                    router.remove(engine.url)
            except LifecycleError as exc:  # left in the journal: the next apply or down stops it
                events(change.unit, f"could not stop it: {exc}")
                store.save(state)
                raise
            journal.end()
        raise
    # the journal ends once the plan names it (_apply): a crash between the two leaves it to recover


def _remove(
    state: ClusterState,
    store: StateStore,
    nodes: NodeSet,
    router: RouterControl,
    journal: Journal,
    change: Change,
    url: str,
    events: Events,
) -> None:
    """Drain an engine (stopped here, it is taken back), then stop it and unregister it whole."""
    journal.begin(change.unit, ChangeKind.REMOVE, url, change.processes)
    try:  # (a Ctrl-C from here on, even during the line below, is undone at once)
        events(change.unit, "out of rotation; waiting for its requests to finish")
        router.cordon(url, True)
    except BaseException:
        with interrupts_deferred():
            with contextlib.suppress(LifecycleError):
                router.cordon(url, False)
            journal.end()
        raise
    journal.phase(StepPhase.CORDONED)
    with interrupts_deferred():  # from here the removal goes through: a half-removed engine serves nobody
        stop_records(state, nodes, [state.processes[p] for p in change.processes if p in state.processes],
                     events=events)  # fmt: skip
        router.remove(url)
        drop_unit(state, change.unit)
        journal.end()


def _merged_plan(state: ClusterState, plan: Plan, change: Change) -> Plan:
    """The state's plan once ``change`` is done (engines and processes as they now run)."""
    planned = plan.process_map()
    processes = [p for p in state.plan.processes if p.id not in change.processes]
    if change.kind is not ChangeKind.REMOVE:
        processes += [planned[p] for p in change.processes if p in planned]
    engines = [e for e in state.plan.engines if e.id != change.unit]
    new_engines = plan.engine_map()
    if change.kind is not ChangeKind.REMOVE and change.unit in new_engines:
        engines.append(new_engines[change.unit])
    return replace(state.plan, processes=tuple(processes), engines=tuple(engines))


def _running_specs(state: ClusterState, plan: Plan, changed: set[str]) -> tuple[LaunchSpec, ...]:
    """The new plan's processes, except a trainer that kept running as it was, and a switched
    engine this apply did not change (it runs its own flags until its next restart)."""
    running = state.plan.process_map()
    out = []
    for spec in plan.processes:
        old = running.get(spec.id)
        kept_running = spec.role is Role.TRAINER or (
            old is not None and old.switched and (spec.engine_id or spec.id) not in changed
        )
        if kept_running and old is not None:
            out.append(old)
            continue
        record = state.processes.get(spec.id)
        if record is not None and record.log_path != spec.log_path:  # a switched engine keeps its log
            spec = replace(spec, log_path=record.log_path)
        if old is not None and old.kept_args:  # a switched engine's own args (`status` shows them while it runs)
            spec = replace(spec, kept_args=old.kept_args)
        out.append(spec)
    return tuple(out)


def unclaimed_logs(state: ClusterState, specs: list[LaunchSpec]) -> list[LaunchSpec]:
    """``specs`` with a log of their own: an engine that switched role keeps its first id's log and
    supervisor story (``logs/prefill-1.log`` for what is now decode-2), so a new prefill-1 writes
    ``logs/prefill-1.2.log`` rather than take them over."""
    held = {rec.log_path for rec in state.processes.values()}
    out = []
    for spec in specs:
        path, n = spec.log_path, 1
        while path in held and state.processes.get(spec.id, None) is None:
            n += 1
            path = spec.log_path.removesuffix(".log") + f".{n}.log"
        out.append(replace(spec, log_path=path) if path != spec.log_path else spec)
    return out


def _run_dir(plan: Plan, node: str) -> str:
    return next((s.cwd for s in plan.processes if s.node == node), "")


def _preflight(nodes: NodeSet, specs: list[LaunchSpec]) -> None:
    """The ports new processes will bind are free on their nodes (naming who holds one)."""
    by_node: dict[str, list[int]] = {}
    for spec in specs:
        by_node.setdefault(spec.node, []).extend(spec.owned_ports())
    results = nodes.each(by_node, lambda ex: agent_api.preflight(ex, sorted(by_node[ex.node.name]), check_gpus=False))
    problems = []
    for node, res in results.items():
        if isinstance(res, RemoteError):
            problems.append(str(res))
            continue
        problems += [f"node {node}: port {b['port']} is in use by pid {b.get('pid')}" for b in res["busy_ports"]]
    if problems:
        raise LifecycleError("cannot add engines:\n  " + "\n  ".join(problems))
