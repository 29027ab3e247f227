"""``restart``: a rolling restart of a running cluster's engines (and the router when named), one
engine at a time, so that a role never drops to zero capacity.

Per engine: the router cordons it (no new requests) and answers once the requests it runs have
finished; its processes are stopped (SIGTERM to their groups, supervisors included) and started
again from the plan, under new supervisors; once healthy the router takes it back, and the next
engine goes only when the router routes to this one again. An engine that comes back on another
weight version than the fleet's is held out by the router's version rule (pdctl.router.
fleet_weights): after a load from disk the router loads it; after a trainer's push it waits for
the next push, and the restart stops there, since going on would take the role's capacity away.
"""

from __future__ import annotations

import time

from pdctl.cluster.down import stop_records
from pdctl.cluster.graph_capture import captures_at_start, flip_there_and_back
from pdctl.cluster.journal import ChangeKind, Journal, StepPhase, entry_of, interrupts_deferred
from pdctl.cluster.keys import load_keys
from pdctl.cluster.nodes import Events, NodeSet, quiet
from pdctl.cluster.router_control import DRAIN_TIMEOUT_SECS, RouterControl, secret_env
from pdctl.cluster.state import ClusterState, Phase, StateStore
from pdctl.cluster.up import launch, wait_ready
from pdctl.errors import LifecycleError
from pdctl.plan import LaunchSpec
from pdctl.roles import Role
from pdctl.weights.client import JsonClient

BACK_TIMEOUT_SECS = 900.0


def restart(
    name: str,
    targets: list[str] | None = None,
    *,
    store: StateStore | None = None,
    nodes: NodeSet | None = None,
    events: Events = quiet,
    ready_timeout_secs: float = BACK_TIMEOUT_SECS,
) -> list[str]:
    """Restart ``targets`` (engine ids, process ids, or ``router``; default every engine) of
    cluster ``name``, one engine at a time. Returns what was restarted, in order.

    Raises:
        LifecycleError: an unknown target, the trainer, a cluster that is not up, an engine that
            did not come back (the engines after it are left as they were).
    """
    store = store or StateStore()
    with store.locked(name):
        state = store.load(name)
        if state is None:
            raise LifecycleError(f"no cluster {name!r} in {store.root}")
        if state.status != Phase.UP:
            raise LifecycleError(f"cluster {name!r} is {state.status}; restart works on a cluster that is up")
        units = _units(state, targets)
        if nodes is None:
            with NodeSet(state.node_objects().values()) as owned:
                return _restart(state, store, owned, units, events, ready_timeout_secs)
        return _restart(state, store, nodes, units, events, ready_timeout_secs)


def _units(state: ClusterState, targets: list[str] | None) -> list[tuple[str, list[LaunchSpec]]]:
    """What to restart, in plan order: (engine id or ``router``, its processes)."""
    specs = state.plan.processes
    engines: dict[str, list[LaunchSpec]] = {}
    for spec in specs:
        if spec.engine_id is not None:
            engines.setdefault(spec.engine_id, []).append(spec)
    router = [s for s in specs if s.role is Role.ROUTER]
    if not targets:
        return list(engines.items())
    units: list[tuple[str, list[LaunchSpec]]] = []
    for target in dict.fromkeys(targets):
        owner = next((s.engine_id or s.id for s in specs if target in (s.id, s.engine_id)), None)
        if target == "router" or (router and owner == router[0].id):
            units.append(("router", router))
        elif owner in engines:
            units.append((owner, engines[owner]))
        elif any(s.id == target and s.role is Role.TRAINER for s in specs):
            raise LifecycleError(f"{target} is a trainer rank: it cannot rejoin its torchrun job; restart the cluster")
        else:
            known = ", ".join([*engines, "router"])
            raise LifecycleError(f"no engine or process {target!r} in cluster {state.name!r}; engines: {known}")
    return list({unit: specs for unit, specs in units}.items())  # each once, first place kept


def _restart(
    state: ClusterState,
    store: StateStore,
    nodes: NodeSet,
    units: list[tuple[str, list[LaunchSpec]]],
    events: Events,
    ready_timeout: float,
) -> list[str]:
    router = RouterControl.of(state, store)
    journal = Journal(state, store, "restart")
    recover(state, store, nodes, router, events, ready_timeout)
    done = []
    for unit, specs in units:
        if unit == "router":
            relaunch(state, store, nodes, specs, events, ready_timeout, router_secrets=True)
            wait_ready(specs, state, nodes, 60.0, events, path="/readiness")
        else:
            replace_engine(state, store, nodes, router, unit, specs, events, ready_timeout, journal)
        done.append(unit)
    return done


def relaunch(
    state: ClusterState,
    store: StateStore,
    nodes: NodeSet,
    specs: list[LaunchSpec],
    events: Events,
    ready_timeout: float,
    *,
    router_secrets: bool = False,
) -> None:
    """Stop ``specs``' processes and start them again from the plan; wait until healthy."""
    stop_records(state, nodes, [state.processes[s.id] for s in specs if s.id in state.processes], events=events)
    store.save(state)
    secrets = secret_env(state.plan.api_key_env) if router_secrets else {}
    launch(specs, state, store, nodes, secrets, events)
    _wait_started(state, nodes, specs, events, ready_timeout)


def _wait_started(
    state: ClusterState, nodes: NodeSet, specs: list[LaunchSpec], events: Events, ready_timeout: float
) -> None:
    entrypoints = [s for s in specs if s.entrypoint and s.role is not Role.ROUTER]
    others = [s for s in specs if not s.entrypoint]
    if entrypoints:
        wait_ready(entrypoints, state, nodes, ready_timeout, events, watch=others)


def replace_engine(
    state: ClusterState,
    store: StateStore,
    nodes: NodeSet,
    router: RouterControl,
    engine_id: str,
    specs: list[LaunchSpec],
    events: Events,
    ready_timeout: float,
    journal: Journal,
) -> None:
    """Engine ``engine_id`` out of rotation (its requests finish), its running processes stopped,
    ``specs`` (its processes as planned now) started, and back in rotation once the router
    routes to it again; each phase in the journal. Stopped before its processes were (Ctrl-C, an
    error), it is taken back into rotation; stopped after, it is left in the journal for
    ``status`` to report and the next ``restart`` or ``apply`` to finish."""
    entry = next(s for s in specs if s.entrypoint)
    url = entry.url or ""
    # Its address as the router knows it: moved to a node with another address (apply), the old
    # worker goes and the new one is registered.
    old_url = next((e.url for e in state.plan.engines if e.id == engine_id), None) or url
    journal.begin(engine_id, ChangeKind.REPLACE, old_url, tuple(s.id for s in specs))
    try:
        events(engine_id, "out of rotation; waiting for its requests to finish")
        drained = router.cordon(old_url, True)
        journal.phase(StepPhase.CORDONED)
        if not drained.get("drained", False):
            events(engine_id, f"{drained.get('load')} request(s) still running after {DRAIN_TIMEOUT_SECS:.0f}s")
        running = [rec for rec in state.processes.values() if rec.engine_id == engine_id]
        # Stopped and recorded whole: a Ctrl-C in the middle would leave an engine half stopped with
        # the journal saying it still runs, and the undo would lift its cordon (seen: DOWN, no step named).
        with interrupts_deferred():
            stop_records(state, nodes, running, events=events)
            journal.phase(StepPhase.STOPPED)
        launch(specs, state, store, nodes, {}, events)
        journal.phase(StepPhase.STARTED)
        _wait_started(state, nodes, specs, events, ready_timeout)
        if captures_at_start(state, engine_id):  # (a new process: its decode graphs are not captured)
            _capture(state, store, journal, engine_id, url, events)
        _back_in_rotation(router, old_url, entry)
        wait_routable(router, engine_id, url, ready_timeout, events)
        journal.end()
    except BaseException:
        with interrupts_deferred():
            _unwind_replace(journal, router, entry, events)
        raise


def _capture(
    state: ClusterState, store: StateStore, journal: Journal, engine_id: str, url: str, events: Events
) -> None:
    """The restarted prefill's decode graph capture, out of rotation, as ``up``'s
    (pdctl.cluster.graph_capture); whole once begun (a Ctrl-C that cut it between its two flips
    would leave a decode the state takes for a prefill). One that switched to decode and would
    not switch back stays out of rotation (the journal ended, so the undo lifts no cordon)."""
    engine = next(e for e in state.plan.engines if e.id == engine_id)
    events(engine_id, "capturing its decode CUDA graphs: it flips to decode and back")
    with interrupts_deferred():
        try:
            why = flip_there_and_back(state, store, engine, url)
        except LifecycleError as exc:
            journal.end()
            raise LifecycleError(
                f"{exc}; it stays out of rotation: `pdctl restart {state.name} {engine_id}` starts it anew"
            ) from exc
    events(engine_id, f"not captured: {why}; its first switch to decode captures" if why else "captured")


def _back_in_rotation(router: RouterControl, old_url: str, entry: LaunchSpec) -> None:
    """Lift the cordon; an engine whose address changed is registered anew instead."""
    url = entry.url or ""
    if old_url == url:
        router.cordon(url, False)
        return
    router.remove(old_url)
    router.add(url, entry.role, entry.ports.get("bootstrap") if entry.role is Role.PREFILL else None)


def _unwind_replace(journal: Journal, router: RouterControl, entry_spec: LaunchSpec, events: Events) -> None:
    """A replace that stopped: take the engine back into rotation while its processes run (the
    router's health checks and version rule still decide); leave the journal when they do not."""
    entry = entry_of(journal.state)
    if entry is None:
        return
    # What runs decides, not the phase written last: a launch that Ctrl-C reached finished first.
    running = all(p in journal.state.processes for p in entry.processes)
    if entry.phase is StepPhase.STOPPED and not running:
        events(entry.unit, "left stopped: the next `pdctl restart` or `apply` starts it again")
        return
    try:
        if entry.phase in (StepPhase.STOPPED, StepPhase.STARTED) and running:
            _back_in_rotation(router, entry.url or "", entry_spec)
        else:
            router.cordon(entry.url or "", False)
    except LifecycleError as exc:
        events(entry.unit, f"still out of rotation: {exc}")
        return
    journal.end()


def lift_cordons_ahead(state: ClusterState, store: StateStore, router: RouterControl, events: Events) -> None:
    """Take back into rotation the engines a move of switches cordoned ahead and never switched
    (``state.cordoned_ahead``: the move was stopped, or killed), then forget them. One the router
    no longer lists is left out (its step, in the journal, settles it); a router that does not
    answer (or refuses) raises ``LifecycleError`` and the record stays."""
    ahead = state.cordoned_ahead
    if ahead is None:
        return
    for engine_id, url in ahead["engines"].items():
        events(engine_id, f"back in rotation: `pdctl {ahead['command']}` cordoned it ahead of a switch it never made")
        router.uncordon_listed(url)
    Journal(state, store, str(ahead["command"])).forget_ahead()


def recover(
    state: ClusterState,
    store: StateStore,
    nodes: NodeSet,
    router: RouterControl,
    events: Events,
    ready_timeout: float,
) -> None:
    """Finish, or undo, the step an interrupted ``restart``, ``apply`` or ``switch`` left in the
    journal, before anything else: a replaced engine is started again (if it was stopped) and taken
    back into rotation; an added one that never joined is stopped and unregistered; a removal is
    finished; a switch that stopped before the engine switched is undone (uncordoned). Engines a
    move cordoned ahead of their own switch (``state.cordoned_ahead``) are taken back first."""
    lift_cordons_ahead(state, store, router, events)
    entry = entry_of(state)
    if entry is None:
        return
    journal = Journal(state, store, entry.command)
    events(entry.unit, f"finishing what was left: {entry.describe()}")
    specs = [spec for spec in state.plan.processes if spec.id in entry.processes]
    mine = [rec for rec in state.processes.values() if rec.id in entry.processes or rec.engine_id == entry.unit]
    if entry.kind is ChangeKind.SWITCH:
        record = state.processes.get(entry.unit)
        live = engine_role(state, store, entry.url) if entry.url else None
        if record is not None and live is not None and live is not record.role:
            raise LifecycleError(
                f"{entry.describe()}; {entry.unit} runs as a {live} already: "
                f"`pdctl switch {state.name} {entry.unit} {live}` finishes the switch"
            )
        if entry.url and record is not None:  # it did not switch: it serves on as it was
            try:
                router.cordon(entry.url, False)
            except LifecycleError:
                if router.worker(entry.url) is not None:
                    raise
                bootstrap = record.ports.get("bootstrap") if record.role is Role.PREFILL else None
                router.add(entry.url, record.role, bootstrap)  # stopped between its removal and re-adding
    elif entry.kind is ChangeKind.REPLACE:
        stopped = [s for s in specs if s.id not in state.processes]
        if stopped:
            launch(stopped, state, store, nodes, {}, events)
            _wait_started(state, nodes, specs, events, ready_timeout)
        if entry.url:
            router.cordon(entry.url, False)
            wait_routable(router, entry.unit, entry.url, ready_timeout, events)
    else:  # an add that never finished, or a removal: the engine goes
        planned = any(e.id == entry.unit for e in state.plan.engines)
        if entry.kind is ChangeKind.ADD and planned:
            journal.end()  # it had joined: nothing to undo
            return
        stop_records(state, nodes, mine, events=events)
        if entry.url:
            router.remove(entry.url)
        if entry.kind is ChangeKind.REMOVE:
            drop_unit(state, entry.unit)
    journal.end()


def engine_role(state: ClusterState, store: StateStore, url: str) -> Role | None:
    """A PD engine's role as it says it now (``/model_info``: its live role; a role switch changes
    it); None when it does not answer or say."""
    keys = load_keys(store, state.name)
    info = JsonClient(api_key=keys.engine if keys else None, timeout_secs=30).get(url + "/model_info")
    mode = info.get("disaggregation_mode") if isinstance(info, dict) else None
    return Role(mode) if mode in (Role.PREFILL.value, Role.DECODE.value) else None


def drop_unit(state: ClusterState, unit: str) -> None:
    """The state's plan without engine ``unit`` and its processes."""
    state.plan = state.plan.without_unit(unit)


UNDER_WAY = ("from a peer engine", "; loading ", "until the weight update under way ends")
"""How the router's reason for keeping an engine out says that something is bringing it back
(pdctl.router.fleet_weights): its supervisor takes the fleet's weights from a peer, the router
loads the fleet's checkpoint into it, an update under way decides."""


def wait_routable(router: RouterControl, unit: str, url: str, timeout: float, events: Events) -> None:
    """Wait until the router routes to ``url`` again: healthy, not quarantined, not cordoned. An
    engine that is up but kept out for its weights with nothing under way to bring it back (only
    a weight update can) is said at once, not waited for."""
    deadline = time.monotonic() + timeout
    # The router's view of the new process, not what it last saw of the old one: its check only.
    # A round of every worker would wait out the slowest (a decode whose prealloc is full of
    # requests waiting for their KV answers SGLang's /health late, or 503 after 20 s), and count
    # one failed check against each slow one per switch or restart.
    router.refresh(url)
    told = ""
    while True:
        worker = router.worker(url)
        if worker and worker["is_healthy"] and not worker["quarantined"] and not worker["cordoned"]:
            events(unit, f"back in rotation (weights {worker.get('weight_version')})")
            return
        quarantined = (worker or {}).get("quarantined") or ""
        if quarantined and (worker or {}).get("is_healthy"):
            if not any(sign in quarantined for sign in UNDER_WAY):
                raise LifecycleError(
                    f"{unit} is up but stays out of rotation: {quarantined}. Only a weight update (a push, a load, "
                    "or a peer that holds the fleet's version) brings it back; the other engines were left as they "
                    "are, so that the role keeps its capacity"
                )
            if quarantined != told:
                told = quarantined
                events(unit, f"up; out of rotation until its weights are the fleet's: {quarantined.split('; ')[-1]}")
        if time.monotonic() > deadline:
            raise LifecycleError(
                f"{unit} restarted but the router has not taken it back after {timeout:.0f}s: {worker}"
            )
        time.sleep(0.2)
        if worker and not worker["is_healthy"]:
            router.refresh(url)  # its next check now: healthy after the router's success threshold of them
