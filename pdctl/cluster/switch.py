"""Role switch: a running engine turns prefill <-> decode without a restart (SGLang's
``/pd_role_switch``, ``--enable-pd-role-switch``; its process, GPUs and ports stay).

An engine of a ``role_switch`` group is planned with a bootstrap port in either role, so a switch
changes no port: the router cordons it and answers once its requests have finished (SGLang
switches only an idle engine), the engine switches, its supervisor learns the command it restarts
with from now on (``pdctl.node.agent retarget``: a crash must bring it back in its new role), the
router re-types it (a new prefill's bootstrap port), and it takes its new id in the state (the
``switch_group``'s next free index for ``pdctl switch``; the edited file's id for ``pdctl
apply``), keeping its pid and its log. An engine that refuses (busy, its backend cannot switch)
is uncordoned and serves on as before; the error says why.

``pdctl apply`` finds switches itself (``pair_switches``): an engine that leaves the file and one
of the other role that enters it, both allowing switching, with the same tp, whose planned
command is the running one's but for its role once planned on the running one's GPUs and ports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

from pdctl.cluster.journal import ChangeKind, Journal, StepPhase, entry_of, interrupts_deferred
from pdctl.cluster.keys import load_keys
from pdctl.cluster.nodes import Events, NodeSet, quiet
from pdctl.cluster.restart import (
    BACK_TIMEOUT_SECS,
    engine_role,
    lift_cordons_ahead,
    recover,
    wait_routable,
)
from pdctl.cluster.role_call import ask_switch, wait_let_go
from pdctl.cluster.router_control import RouterControl
from pdctl.cluster.state import ClusterState, Phase, StateStore
from pdctl.cluster.step import StepContext
from pdctl.cluster.up import spawn_entry
from pdctl.errors import LifecycleError, RemoteError
from pdctl.plan import EngineSpec, LaunchSpec
from pdctl.plan.gpus import Slices
from pdctl.remote import agent_api
from pdctl.roles import Role
from pdctl.weights.client import CallFailure

MODE_FLAG = "--disaggregation-mode"
PD_ROLES = (Role.PREFILL, Role.DECODE)


# -- planning ---------------------------------------------------------------------------------------
def keep_gpus(state: ClusterState) -> dict[str, Slices]:
    """The GPUs of the running engines (by engine id) and trainer, for the planner."""
    per_unit: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {}
    for spec in state.plan.processes:
        if not spec.gpu_ids:
            continue
        unit = spec.engine_id or ("trainer" if spec.role is Role.TRAINER else None)
        if unit is not None:
            per_unit.setdefault(unit, []).append((spec.node_rank, spec.node, spec.gpu_ids))
    return {unit: tuple((node, ids) for _, node, ids in sorted(parts)) for unit, parts in per_unit.items()}


def switched_spec(spec: LaunchSpec, new_id: str, role: Role) -> LaunchSpec:
    """The running process ``spec`` as it runs after switching to ``role`` under ``new_id``: its
    command says the new role; its ports, GPUs and log stay."""
    argv = list(spec.argv)
    at = argv.index(MODE_FLAG)
    argv[at + 1] = role.value
    return replace(spec, id=new_id, engine_id=new_id, role=role, argv=tuple(argv))


def candidates(state: ClusterState, removed: list[str], added: Mapping[str, EngineSpec]) -> list[tuple[str, str]]:
    """Pairs (running engine that leaves, engine of the other role that enters) that a switch
    may make: both allow switching, same tp, one process each; in id order."""
    running = state.plan.engine_map()
    pairs, taken = [], set()
    for old_id in sorted(removed):
        old = running.get(old_id)
        if not old or not old.role_switch or len(old.process_ids) != 1:
            continue
        for new_id in sorted(added):
            new = added[new_id]
            if (
                new_id not in taken
                and new.role_switch
                and {new.role, old.role} == set(PD_ROLES)
                and new.tp == old.tp
                and len(new.process_ids) == 1
            ):
                pairs.append((old_id, new_id))
                taken.add(new_id)
                break
    return pairs


def aliases(
    state: ClusterState, pairs: list[tuple[str, str]], ports: Mapping[str, tuple[str, int, int]]
) -> tuple[dict[str, tuple[str, int, int]], dict[str, Slices]]:
    """The running ports and GPUs with each pair's new engine given its old one's."""
    ports = dict(ports)
    gpus = keep_gpus(state)
    for old_id, new_id in pairs:
        for key, value in list(ports.items()):
            process, _, name = key.partition(":")
            if process == old_id:
                ports[f"{new_id}:{name}"] = value
        if old_id in gpus:
            gpus[new_id] = gpus[old_id]
    return ports, gpus


HARD_ARGS = frozenset(
    {
        "--model-path", "--tokenizer-path", "--revision", "--trust-remote-code", "--dtype", "--kv-cache-dtype",
        "--quantization", "--load-format", "--model-loader-extra-config", "--tp-size", "--tensor-parallel-size",
        "--pp-size", "--pipeline-parallel-size", "--dp-size", "--data-parallel-size", "--ep-size",
        "--expert-parallel-size", "--enable-dp-attention", "--speculative-algorithm", "--speculative-draft-model-path",
        "--nnodes", "--node-rank", "--dist-init-addr", "--enable-pd-role-switch",
    }
)  # fmt: skip
"""Flags a switched process must share with the group it joins: they change the tensors it holds,
its parallelism or its placement. The others (memory fractions, chunk and batch sizes, schedules...)
it keeps from its old group until its next restart, as SGLang keeps a process's args across a switch."""


def flags_of(argv: list[str]) -> dict[str, str | None]:
    """An engine command's ``--flag [value]`` words after its module (later words win)."""
    out: dict[str, str | None] = {}
    words = list(argv)
    i = next((j for j, w in enumerate(words) if w.startswith("--")), len(words))
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            i += 1
            continue
        if "=" in word:
            flag, value = word.split("=", 1)
            out[flag] = value
            i += 1
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            out[word] = words[i + 1]
            i += 2
        else:
            out[word] = None
            i += 1
    return out


def kept_args(running: list[str], planned: list[str]) -> tuple[dict[str, list[str | None]], list[str]]:
    """What a switch of ``running`` (its command, the mode flag set to the new role) into ``planned``
    keeps from its old group: ``{flag: [running value, planned value]}`` for the soft flags that
    differ; and the hard flags that differ (the switch is impossible when there is one)."""
    mine, theirs = flags_of(running), flags_of(planned)
    soft: dict[str, list[str | None]] = {}
    hard: list[str] = []
    for flag in sorted(set(mine) | set(theirs)):
        if flag == MODE_FLAG or mine.get(flag) == theirs.get(flag):
            continue
        if flag in HARD_ARGS:
            hard.append(f"{flag} {mine.get(flag)!r} vs {theirs.get(flag)!r}")
        else:
            soft[flag] = [mine.get(flag), theirs.get(flag)]
    return soft, hard


def confirmed(
    state: ClusterState, pairs: list[tuple[str, str]], planned: Mapping[str, LaunchSpec]
) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """The pairs whose new engine, planned on the old one's GPUs and ports, the old one can become
    by a switch: the same place (node, GPUs, ports, environment, directory) and the same hard flags
    (``HARD_ARGS``); soft flags may differ (it keeps its own until its next restart). Also why each
    pair that cannot is not a switch (old engine id -> why: it is then added and removed)."""
    running = state.plan.process_map()
    out, why = [], {}
    for old_id, new_id in pairs:
        old, new = running.get(old_id), planned.get(new_id)
        if old is None or new is None or MODE_FLAG not in old.argv:
            continue
        derived = switched_spec(old, new_id, new.role)
        place = ("env", "node", "host", "gpu_ids", "ports", "cwd")
        moved = [k for k in place if getattr(derived, k) != getattr(new, k)]
        _, hard = kept_args(list(derived.argv), list(new.argv))
        if moved or hard:
            reasons = [f"its {k} differs" for k in moved]
            reasons += [f"{h} (a flag that changes its tensors or parallelism)" for h in hard]
            why[old_id] = f"it cannot become {new_id} by a switch: " + "; ".join(reasons)
            continue
        out.append((old_id, new_id))
    return out, why


def serving_pid(state: ClusterState, nodes: NodeSet, process_id: str) -> int | None:
    """The pid of the process that serves for recorded process ``process_id`` now: its supervisor's
    child (what a restart replaces), else the recorded one."""
    record = state.processes.get(process_id)
    if record is None:
        return None
    query: dict[str, Any] = {"id": record.id, "pid": record.pid, "create_time": record.create_time}
    if record.exit_file:
        query["exit_file"] = record.exit_file
    reply = nodes.each([record.node], lambda ex: agent_api.status(ex, [query]))[record.node]
    if isinstance(reply, RemoteError):
        return None
    entry = reply["processes"].get(record.id) or {}
    return int(entry.get("child_pid") or record.pid)


# -- doing ------------------------------------------------------------------------------------------
def switch_engine(step: StepContext, old_id: str, engine: EngineSpec, process: LaunchSpec) -> None:
    """Switch running engine ``old_id`` into ``engine`` (its id, role, group; ``process`` its plan
    entry). Raises LifecycleError when the engine refuses (it serves on as it was)."""
    state, store, router, journal, events = step.state, step.store, step.router, step.journal, step.events
    record = state.processes.get(old_id)
    if record is None or not record.url:
        raise LifecycleError(f"{old_id} is not running: nothing to switch")
    url = record.url
    role, new_id = engine.role, engine.id
    was = record.role
    if was in PD_ROLES and not any(e.role is was and e.id != old_id for e in state.plan.engines):
        raise LifecycleError(
            f"{old_id} is the fleet's only {was}: as a {role} it would leave the fleet with no {was}, and a PD fleet "
            f"serves nothing without one; add a {was} first (`pdctl apply` a file with one more), then switch"
        )
    live = engine_role(state, store, url)
    if live is None and entry_of(state) is None:  # (a switch left half done asks again below, in the step)
        raise LifecycleError(
            f"{old_id} does not answer at {url}: a switch needs it running, and nothing was changed. Once its "
            f"supervisor has brought it back (`pdctl status {state.name}`), or after `pdctl restart {state.name} "
            f"{old_id}`, run this again"
        )
    already = live is role  # a switch that stopped half way (pdctl killed)
    try:
        journal.begin(old_id, ChangeKind.SWITCH, url, (old_id,))
        events(old_id, f"switching to {role} as {new_id}: out of rotation; waiting for its requests to finish")
        router.cordon(url, True, reason=f"pdctl {journal.command}: switching to {role}", handoff=True)
        journal.phase(StepPhase.CORDONED)
        handed = router.handed_off.pop(url, 0)
        if handed:
            events(old_id, f"{handed} request(s) queued at it went to other pairs; waiting for it to let go of them")
            wait_let_go(state, store, url)
    except BaseException:  # (Ctrl-C during the drain) nothing changed: it serves on
        with interrupts_deferred():
            with contextlib.suppress(LifecycleError):
                router.cordon(url, False)
            journal.end()
        raise
    # From the call on it goes through whole: a Ctrl-C that cut the call short could leave an engine
    # switched that the router, its supervisor and the state still take for the old role.
    with interrupts_deferred():
        if already:
            events(old_id, f"it runs as a {role} already: finishing the switch")
        else:
            events(old_id, f"idle: asking it to switch to {role}")
            answer = ask_switch(state, store, url, role, engine.tp)
            if isinstance(answer, CallFailure):
                _not_switched(state, store, router, journal, old_id, url, role, was, answer)
        # its log and story stay where they are; "switched": it runs what it ran before but its role
        process = replace(process, log_path=record.log_path, switched=True)
        keys = load_keys(store, state.name)
        entry = spawn_entry(process, state, keys, {}, key_file=keys is not None and not keys.engine.startswith("-"))
        entry.update(log_path=record.log_path, exit_file=record.exit_file)  # its story stays where it is
        reply = (
            step.nodes.each([record.node], lambda ex: agent_api.retarget(ex, entry))[record.node]
            if record.exit_file
            else None
        )
        if isinstance(reply, RemoteError):
            events(old_id, f"its supervisor did not learn its new command ({reply}): a crash brings it back as {was}")
        router.remove(url)
        router.add(url, role, engine.bootstrap_port if role is Role.PREFILL else None)
        del state.processes[old_id]
        state.processes[new_id] = replace(record, id=new_id, role=role, engine_id=new_id)
        state.plan = state.plan.with_unit(engine, (process,), replacing=old_id)
        journal.end()
    events(new_id, f"switched from {old_id}: same process, GPUs and ports")
    wait_routable(router, new_id, url, step.ready_timeout, events)


def _not_switched(
    state: ClusterState,
    store: StateStore,
    router: RouterControl,
    journal: Journal,
    old_id: str,
    url: str,
    role: Role,
    was: Role,
    answer: CallFailure,
) -> None:
    """The switch call failed: raise what to do, leaving the engine as safe as SGLang says it is.
    Refused (busy, say: SGLang's ``safe_to_restore``): uncordoned, it serves on. Refused as not safe
    to serve ("restart required", another switch under way): it stays out of rotation. Its answer
    lost (a timeout while it captures decode graphs, say): unless it says it switched (then the
    switch goes on), it stays out and the journal keeps the step for the next command."""
    if answer.transport:
        if engine_role(state, store, url) is role:
            return
        raise LifecycleError(
            f"{old_id}: the answer to its switch to {role} was lost ({answer}) and it does not say it switched; "
            "it stays out of rotation; the next `pdctl apply`, `switch` or `restart` settles it by asking it its role"
        )
    text = str(answer)
    if "restart required" in text or "already in progress" in text:
        journal.end()
        raise LifecycleError(
            f"{old_id} did not switch to {role}: {answer}; SGLang says it is not safe to serve, so it stays out of "
            f"rotation: `pdctl restart {state.name} {old_id}` brings it back as a {was}"
        )
    router.cordon(url, False)
    journal.end()
    raise LifecycleError(f"{old_id} did not switch to {role}: {answer}; it serves on as {was}")


def switch(
    name: str,
    engine_id: str,
    role: Role | str,
    *,
    store: StateStore | None = None,
    nodes: NodeSet | None = None,
    events: Events = quiet,
    ready_timeout_secs: float = BACK_TIMEOUT_SECS,
) -> str:
    """``pdctl switch``: engine ``engine_id`` of cluster ``name`` turns ``role``; returns its new id.

    Raises:
        LifecycleError: no such cluster or engine, an engine that may not switch, or one that refused.
    """
    made = switch_all(
        name, [engine_id], role, store=store, nodes=nodes, events=events, ready_timeout_secs=ready_timeout_secs
    )
    return made[0][1]


def switch_all(
    name: str,
    engine_ids: list[str],
    role: Role | str,
    *,
    store: StateStore | None = None,
    nodes: NodeSet | None = None,
    events: Events = quiet,
    ready_timeout_secs: float = BACK_TIMEOUT_SECS,
    command: str = "switch",
    on_switched: Callable[[str, str], None] | None = None,
) -> list[tuple[str, str]]:
    """Engines ``engine_ids`` of cluster ``name`` turn ``role``, in that order, under one hold of the
    cluster's lock; returns (old id, new id) of each, and tells ``on_switched`` of each as it is made.

    A move of several drains them side by side: all but the first are cordoned ahead (recorded in
    ``state.cordoned_ahead`` before the router is asked), so each one's own drain, when its turn
    comes, waits only for what is left; a drain waits for the requests the engine holds, and a
    decode's wait for KV from a backlogged prefill took 12-19 s each, one after the other. One
    refused, or a stop, ends the move there: those switched stay switched, those cordoned ahead
    are taken back at once (a kill leaves them recorded for the next command or the planner).

    Raises:
        LifecycleError: no such cluster or engine, an engine that may not switch, or one that refused
            (those before it are switched).
    """
    role = Role(role)
    if role not in PD_ROLES:
        raise LifecycleError(f"an engine switches to prefill or decode, not {role}")
    store = store or StateStore()
    with store.locked(name):
        state = store.load(name)
        if state is None:
            raise LifecycleError(f"no cluster {name!r} in {store.root}")
        if state.status != Phase.UP:
            raise LifecycleError(f"cluster {name!r} is {state.status}; switch works on a cluster that is up")
        if len(set(engine_ids)) != len(engine_ids):
            raise LifecycleError(f"a move names an engine twice: {', '.join(engine_ids)}")
        for engine_id in engine_ids:
            _switchable(state, name, engine_id, role)
        with contextlib.ExitStack() as stack:
            if nodes is None:
                nodes = stack.enter_context(NodeSet(state.node_objects().values()))
            router = RouterControl.of(state, store)
            journal = Journal(state, store, "switch")  # (a step left: `pdctl switch` finishes it, by hand too)
            step = StepContext(state, store, nodes, router, journal, events, ready_timeout_secs)
            lift_cordons_ahead(state, store, router, events)  # a move killed half way
            left = entry_of(state)
            if left is not None and not (left.kind is ChangeKind.SWITCH and left.unit == engine_ids[0]):
                recover(state, store, nodes, router, events, ready_timeout_secs)  # another step left half done
            made: list[tuple[str, str]] = []
            with cordons_lifted_on_failure(state, store, router, events):
                cordon_ahead(state, router, journal, command, engine_ids[1:], events)
                for engine_id in engine_ids:
                    new_engine, new_process = _switched(state, engine_id, role)
                    switch_engine(step, engine_id, new_engine, new_process)
                    made.append((engine_id, new_engine.id))
                    if on_switched is not None:
                        on_switched(engine_id, new_engine.id)
    return made


def left_behind(state: ClusterState) -> bool:
    """Whether a switch (or a move's cordons ahead) was left half done in ``state``."""
    entry = entry_of(state)
    return state.cordoned_ahead is not None or (entry is not None and entry.kind is ChangeKind.SWITCH)


def settle_half_done(
    name: str, *, store: StateStore | None = None, events: Events = quiet, ready_timeout_secs: float = BACK_TIMEOUT_SECS
) -> None:
    """Settle what a switch or a move killed half way left (``left_behind``): the engines it cordoned
    ahead go back into rotation, and its journal step is finished or undone (``recover``). Under the
    cluster's lock no other command runs (one that does makes this raise ``LifecycleError``: try
    again later), so what is recorded is stale. The planner calls it while it finds one."""
    store = store or StateStore()
    with store.locked(name):
        state = store.load(name)
        if state is None or state.status != Phase.UP or not left_behind(state):
            return
        with NodeSet(state.node_objects().values()) as nodes:
            recover(state, store, nodes, RouterControl.of(state, store), events, ready_timeout_secs)


def _switchable(state: ClusterState, name: str, engine_id: str, role: Role) -> None:
    """Raise LifecycleError unless engine ``engine_id`` may switch to ``role``."""
    engines = state.plan.engine_map()
    engine = engines.get(engine_id)
    if engine is None:
        raise LifecycleError(f"no engine {engine_id!r} in cluster {name!r} (engines: {', '.join(sorted(engines))})")
    if engine.role is role:
        raise LifecycleError(f"{engine_id} is a {role} already")
    if not engine.role_switch or not engine.switch_group:
        raise LifecycleError(
            f"{engine_id} may not switch roles: its group needs role_switch: true, beside a group of the "
            "other role with role_switch and the same tp (then `pdctl apply` the file, which restarts it)"
        )


def _switched(state: ClusterState, engine_id: str, role: Role) -> tuple[EngineSpec, LaunchSpec]:
    """Engine ``engine_id`` as it will run in ``role``: under its switch group's next free id."""
    engines = state.plan.engine_map()
    engine = engines[engine_id]
    group = engine.switch_group
    assert group is not None
    used = {e.split("-")[-1] for e in engines if e.rsplit("-", 1)[0] == group}
    new_id = next(f"{group}-{i}" for i in range(len(engines) + 1) if str(i) not in used)
    new_process = switched_spec(state.plan.process(engine_id), new_id, role)
    new_engine = replace(engine, id=new_id, group=group, role=role, process_ids=(new_id,), switch_group=engine.group)
    return new_engine, new_process


@contextlib.contextmanager
def cordons_lifted_on_failure(
    state: ClusterState, store: StateStore, router: RouterControl, events: Events
) -> Iterator[None]:
    """A move's block: refused or stopped (any exception), the engines it cordoned ahead and never
    reached are taken back into rotation at once, whole, before the exception goes on; a router
    that does not answer keeps them recorded, for the next command (not this error)."""
    try:
        yield
    except BaseException:
        with interrupts_deferred(), contextlib.suppress(LifecycleError):
            lift_cordons_ahead(state, store, router, events)
        raise


def cordon_ahead(
    state: ClusterState, router: RouterControl, journal: Journal, command: str, engine_ids: list[str], events: Events
) -> None:
    """Cordon ``engine_ids`` without waiting for their drains, recorded first (as ``command``'s)."""
    urls = {e: url for e in engine_ids if e in state.processes and (url := state.processes[e].url)}
    if not urls:
        return
    journal.cordon_ahead(urls, command)
    for engine_id, url in urls.items():
        events(engine_id, "out of rotation ahead of its switch: its requests finish while the one before it switches")
        router.cordon(url, True, wait=False, reason=f"pdctl {command}: ahead of its switch", handoff=True)
