"""make_plan(topology) -> Plan: pure and deterministic (no I/O, same YAML -> same plan).

Order of everything (GPUs, ports, ids) is declaration order: prefill groups, decode
groups, regular groups, then the router, then the trainer. Invariants are checked at the
end; a violated one raises PlanError naming it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from pdctl.colocate.env import DATA_PLANE_ENV, DataPlaneSpec, EngineRanks
from pdctl.errors import Issue, PlanError, TopologyError
from pdctl.node.peer_weights import PeerPlan, SeedSide
from pdctl.plan.argv import compact_json, engine_argv, router_argv, trainer_argv
from pdctl.plan.gpus import EnginePlacement, GpuLayout, Slices, place_gpus
from pdctl.plan.model import EngineSpec, LaunchSpec, MpsDaemon, Plan, WeightGroup, url_host
from pdctl.plan.ports import PortCursors, PortOverflowError, dist_init_block_size
from pdctl.refit import RefitMode
from pdctl.roles import Role
from pdctl.topology.model import Node, ServerGroup, Topology
from pdctl.weights.env import API_KEY_ENV_ENV, READY_TIMEOUT_ENV, ROUTER_URL_ENV, WEIGHT_GROUP_ENV

WEIGHT_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0", "TORCHELASTIC_USE_AGENT_STORE": "False"}


def run_dir(node: Node, name: str) -> str:
    return f"{node.workdir.rstrip('/')}/{name}"


def make_plan(
    top: Topology,
    keep_ports: Mapping[str, tuple[str, int, int]] | None = None,
    keep_gpus: Mapping[str, Slices] | None = None,
) -> Plan:
    """Plan every process of ``top``; ``keep_ports`` (``pdctl apply``, see PortCursors) and
    ``keep_gpus`` (see place_gpus) keep a running cluster's processes on their ports and GPUs.

    Raises:
        TopologyError: GPUs or ports cannot be placed (issues name groups and nodes).
        PlanError: an internal invariant failed.
    """
    layout, issues = place_gpus(top, keep_gpus)
    if layout is None:
        raise TopologyError("<topology>", issues)
    try:
        plan = _build(top, layout, keep_ports)
    except PortOverflowError as exc:
        issue = Issue("ports.base", str(exc), hint="lower ports.base or spread engines over more nodes")
        raise TopologyError("<topology>", [issue]) from exc
    check_invariants(plan, colocate=top.placement.colocate)
    return plan


def _build(top: Topology, layout: GpuLayout, keep_ports: Mapping[str, tuple[str, int, int]] | None) -> Plan:
    cursors = PortCursors([n.name for n in top.nodes], top.port_base, keep_ports)
    router_node = top.router_node
    if top.router.port is not None:
        cursors.reserve(router_node.name, top.router.port)
    processes: list[LaunchSpec] = []
    engines: list[EngineSpec] = []
    for placement in layout.engines:
        procs, engine = _plan_engine(top, placement, cursors)
        processes += procs
        engines.append(engine)
    engines = _assign_rank_offsets(top, engines)

    # Router.
    router_id = "router"
    r_port = top.router.port if top.router.port is not None else cursors.take(router_node.name, key="router:http")
    metrics = cursors.take(router_node.name, key="router:metrics")
    argv = router_argv(
        top,
        router_node,
        port=r_port,
        metrics_port=metrics,
        prefill=[(e.url, e.bootstrap_port) for e in engines if e.role is Role.PREFILL],
        decode=[e.url for e in engines if e.role is Role.DECODE],
        regular=[e.url for e in engines if e.role is Role.REGULAR],
    )
    router_host = router_node.host if top.router.host in ("0.0.0.0", "::") else top.router.host
    processes.append(
        _spec(
            top,
            router_node,
            router_id,
            Role.ROUTER,
            argv,
            dict(router_node.env),
            {"http": r_port, "metrics": metrics},
            host=router_host,
            entrypoint=True,
            health_path="/health",
            restart=top.router.restart,
        )
    )
    router_url = f"http://{url_host(router_host)}:{r_port}"

    weight_group = None
    data_plane = None
    if top.trainer is not None:
        trainer_procs, weight_group = _plan_trainer(top, layout, cursors, engines, router_url)
        data_plane = _plan_data_plane(top, layout, cursors, engines)
        if data_plane is not None:
            trainer_procs = [_trainer_with_data_plane(p, data_plane) for p in trainer_procs]
            processes = [_with_data_plane(p, data_plane) if p.engine_id else p for p in processes]
        processes += trainer_procs
    if top.weights is None or top.weights.from_peer:
        processes = _plan_peer_weights(top, cursors, engines, processes)
    warnings = cursors.warnings()
    return Plan(
        name=top.name,
        engine=top.engine,
        processes=tuple(processes),
        engines=tuple(engines),
        router_id=router_id,
        weight_group=weight_group,
        warnings=tuple(warnings),
        api_key_env=top.router.api_key_env,
        mps=_mps_daemons(top, processes),
        trainer_first=top.placement.colocate and top.trainer is not None,
        trainer_startup_secs=top.trainer.startup_secs if top.trainer is not None else 10.0,
        refit=top.weights.refit.value if top.weights is not None else RefitMode.DRAIN.value,
        max_staleness=top.weights.max_staleness if top.weights is not None else None,
        data_plane=data_plane,
        engine_auth=top.engine_auth.value,
        planner=top.planner.to_dict() if top.planner is not None else None,
    )


def _plan_peer_weights(
    top: Topology, cursors: PortCursors, engines: list[EngineSpec], processes: list[LaunchSpec]
) -> list[LaunchSpec]:
    """Each engine that can seed and receive SGLang's engine-to-engine transfer (one node, no DP,
    no PP: SGLang's seed routes need one DP rank and pair TP rank to TP rank) gets a relay port
    and one group port per TP rank on its node, taken after every other port so that no other
    port moves, and the list of its peers: the others of its TP size (pdctl.node.peer_weights)."""
    groups = {g.name: g for g in top.groups}
    by_id = {p.id: p for p in processes}
    sides: dict[str, SeedSide] = {}
    for engine in engines:
        group = groups[engine.group]
        head = by_id[engine.process_ids[0]]
        if len(engine.process_ids) != 1 or group.dp > 1 or group.attn_dp > 1 or group.pp > 1:
            continue
        if group.arg("speculative-algorithm"):  # its draft model would load remote_instance too
            continue
        relay = cursors.take(head.node, key=f"{head.id}:seed_relay")
        ports = tuple(cursors.take(head.node, key=f"{head.id}:seed.{r}") for r in range(engine.tp))
        sides[engine.id] = SeedSide(engine.id, engine.url, head.host, relay, ports)
    by_engine = {e.id: e for e in engines}
    layouts = {eid: _layout(by_engine[eid], groups) for eid in sides}
    same: dict[tuple, list[SeedSide]] = {}
    for eid, seed in sides.items():
        same.setdefault(layouts[eid], []).append(seed)
    position = {s.engine_id: i for members in same.values() for i, s in enumerate(members)}
    hosts: dict[tuple, dict[str, list[SeedSide]]] = {key: _by_host(members) for key, members in same.items()}
    out = []
    for spec in processes:
        side = sides.get(spec.engine_id or "") if spec.entrypoint else None
        if side is None:
            out.append(spec)
            continue
        key = layouts[side.engine_id]
        peers = _nearest_peers(side, same[key], position, hosts[key])
        owned = {**spec.ports, "seed_relay": side.relay_port, **{f"seed.{r}": p for r, p in enumerate(side.ports)}}
        plan = PeerPlan(side, peers, boot_version=_arg_value(spec.argv, "--weight-version") or "default")
        out.append(replace(spec, ports=MappingProxyType(owned), peer_weights=MappingProxyType(plan.to_dict())))
    return out


_WEIGHT_LAYOUT_ARGS = ("quantization", "load-format", "model-loader-extra-config")
"""Group args that change the tensors an engine holds (dtype is the model's, one per cluster): peers
must agree on them as on tp (the broadcast pairs parameters one by one and would hang on a size
that differs)."""


PEERS_PER_ENGINE = 8
"""How many peers of its layout an engine lists (its supervisor asks them all at once for their
version, and a busy one again once it is free): enough to find a seed, and a plan whose size grows
with the engines, not with their square (every engine listed every other of its layout: 184,320
entries for 576 engines)."""


def _nearest_peers(side: SeedSide, layout: list[SeedSide], position: Mapping[str, int],
                   by_host: Mapping[str, list[SeedSide]]) -> tuple[SeedSide, ...]:  # fmt: skip
    """Up to ``PEERS_PER_ENGINE`` others of ``side``'s layout: those on its host first (the
    transfer stays on the node), then the next ones in the plan's order after it, wrapping (so
    that engines that restart together ask different seeds first). ``position``: each engine's
    index in ``layout``; ``by_host``: the layout's engines by host."""
    local = [s for s in by_host[side.host] if s.engine_id != side.engine_id][:PEERS_PER_ENGINE]
    out = list(local)
    at, n = position[side.engine_id], len(layout)
    for step in range(1, n):
        if len(out) >= PEERS_PER_ENGINE:
            break
        other = layout[(at + step) % n]
        if other.host != side.host:
            out.append(other)
    return tuple(out)


def _by_host(sides: list[SeedSide]) -> dict[str, list[SeedSide]]:
    out: dict[str, list[SeedSide]] = {}
    for side in sides:
        out.setdefault(side.host, []).append(side)
    return out


def _layout(engine: EngineSpec, groups: Mapping[str, ServerGroup]) -> tuple:
    group = groups[engine.group]
    return (engine.tp, *(str(group.arg(k)) for k in _WEIGHT_LAYOUT_ARGS))


def _arg_value(argv: tuple[str, ...], flag: str) -> str | None:
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def _plan_data_plane(
    top: Topology, layout: GpuLayout, cursors: PortCursors, engines: list[EngineSpec]
) -> DataPlaneSpec | None:
    """The union world: trainer ranks 0..N-1, then every engine's TP ranks in engine order (so the
    engine GPU trainer rank i shares is union rank N + i); rank 0 hosts the store on a port of
    the trainer's head node."""
    config = top.placement.data_plane
    if config is None or not top.placement.colocate:
        return None
    head = top.node(layout.trainer[0][0])
    port = cursors.take(head.name, key=f"trainer.{head.name}:data_plane")
    trainer_ranks = sum(len(gpus) for _, gpus in layout.trainer)
    ranks, first = [], trainer_ranks
    for engine in engines:
        ranks.append(EngineRanks(id=engine.id, tp=engine.gpus, first_rank=first))
        first += engine.gpus
    backend = top.data_plane_backend
    assert backend is not None  # (None only without a data plane)
    return DataPlaneSpec(
        master_address=url_host(head.host).strip("[]"),
        master_port=port,
        trainer_ranks=trainer_ranks,
        engines=tuple(ranks),
        backend=backend.value,
        batch_size=config.batch_size,
        aux_layers=config.aux_layers,
        dtype=config.dtype,
        timeout_secs=config.timeout_secs,
        join_timeout_secs=config.join_timeout_secs,
    )


def _trainer_with_data_plane(spec: LaunchSpec, data_plane: DataPlaneSpec) -> LaunchSpec:
    """The trainer's node rank 0 hosts the union world's store (its ``data_plane`` port)."""
    if spec.node_rank == 0:
        spec = replace(spec, ports=MappingProxyType({**spec.ports, "data_plane": data_plane.master_port}))
    return _with_data_plane(spec, data_plane)


def _with_data_plane(spec: LaunchSpec, data_plane: DataPlaneSpec) -> LaunchSpec:
    return replace(spec, env=MappingProxyType({**spec.env, DATA_PLANE_ENV: data_plane.to_json()}))


def _mps_daemons(top: Topology, processes: list[LaunchSpec]) -> tuple[MpsDaemon, ...]:
    if not top.placement.uses_mps:
        return ()
    nodes = dict.fromkeys(p.node for p in processes if p.gpu_ids)
    out = []
    for name in nodes:
        env = _mps_env(top.node(name), top.name)
        out.append(MpsDaemon(node=name, pipe_dir=env["CUDA_MPS_PIPE_DIRECTORY"], log_dir=env["CUDA_MPS_LOG_DIRECTORY"]))
    return tuple(out)


def _switch_group(top: Topology, group: ServerGroup) -> str | None:
    """The group of the other PD role that an engine of ``group`` joins when it switches role
    (``pdctl switch``): the first one that allows switching, with the same tp."""
    if not group.role_switch:
        return None
    other = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL}.get(group.role)
    return next((g.name for g in top.groups if g.role is other and g.role_switch and g.tp == group.tp), None)


def _plan_engine(
    top: Topology, placement: EnginePlacement, cursors: PortCursors
) -> tuple[list[LaunchSpec], EngineSpec]:
    group = placement.group
    engine_id = placement.engine_id
    nnodes = len(placement.slices)
    head = top.node(placement.slices[0][0])
    # Head node first: http, nccl, bootstrap (prefill), dist-init block; then the other nodes.
    head_id = engine_id if nnodes == 1 else f"{engine_id}.{head.name}"
    node_ports = [(cursors.take(head.name, key=f"{head_id}:http"), cursors.take(head.name, key=f"{head_id}:nccl"))]
    # An engine that may switch PD role keeps a bootstrap port in either role (a decode turned
    # prefill serves its KV there), so that a switch changes no port.
    serves_kv = group.role is Role.PREFILL or group.role_switch
    bootstrap = cursors.take(head.name, key=f"{head_id}:bootstrap") if serves_kv else None
    dist_addr = None
    block = 0
    dist_port = None
    if nnodes > 1 or group.needs_dist_init:
        block = dist_init_block_size(max(group.dp, group.attn_dp))
        dist_port = cursors.take(head.name, block, key=f"{head_id}:dist_init")
        dist_addr = f"{url_host(head.host)}:{dist_port}"
    for node_name, _ in placement.slices[1:]:
        pid = f"{engine_id}.{node_name}"
        node_ports.append((cursors.take(node_name, key=f"{pid}:http"), cursors.take(node_name, key=f"{pid}:nccl")))
    procs: list[LaunchSpec] = []
    url = ""
    for rank, (node_name, gpu_ids) in enumerate(placement.slices):
        node = top.node(node_name)
        http, nccl = node_ports[rank]
        argv = engine_argv(
            top,
            group,
            node,
            gpu_ids=gpu_ids,
            http_port=http,
            nccl_port=nccl,
            bootstrap_port=bootstrap,
            dist_init_addr=dist_addr,
            nnodes=nnodes,
            node_rank=rank,
            engine_id=engine_id,
        )
        ports = {"http": http, "nccl": nccl}
        if rank == 0:
            if bootstrap is not None:
                ports["bootstrap"] = bootstrap
            if dist_port is not None:
                ports["dist_init"] = dist_port
        pid = engine_id if nnodes == 1 else f"{engine_id}.{node.name}"
        spec = _spec(
            top,
            node,
            pid,
            group.role,
            argv,
            {**node.env, **group.env},
            ports,
            gpu_ids=gpu_ids,
            dist_init_block=block if rank == 0 else 0,
            engine_id=engine_id,
            node_rank=rank,
            entrypoint=rank == 0,
            health_path="/health" if rank == 0 else None,
            restart=group.restart,
            liveness_secs=group.liveness_timeout_secs if rank == 0 else None,
        )
        if rank == 0:
            url = spec.url or ""
        procs.append(spec)
    engine = EngineSpec(
        id=engine_id,
        group=group.name,
        role=group.role,
        tp=group.tp,
        gpus=group.gpus_per_engine,
        process_ids=tuple(p.id for p in procs),
        url=url,
        bootstrap_port=bootstrap,
        role_switch=group.role_switch,
        switch_group=_switch_group(top, group),
    )
    return procs, engine


def _spec(
    top: Topology,
    node: Node,
    pid: str,
    role: Role,
    argv: tuple[str, ...],
    env: dict[str, str],
    ports: dict[str, int],
    *,
    host: str | None = None,
    **extra: Any,
) -> LaunchSpec:
    """One process in its node's run directory, logging to ``logs/PID.log``; GPU processes of a
    colocated topology also get the MPS pipe and log directories, and their role's
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` where the topology sets one."""
    if top.placement.uses_mps and role is not Role.ROUTER:
        env = {**env, **_mps_env(node, top.name)}
    percentage = top.placement.thread_percentage.get(role.value) if top.placement.colocate else None
    if percentage is not None:
        env = {**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percentage)}
    rdir = run_dir(node, top.name)
    return LaunchSpec(
        id=pid,
        role=role,
        node=node.name,
        host=host or node.host,
        argv=argv,
        env=MappingProxyType(env),
        cwd=rdir,
        log_path=f"{rdir}/logs/{pid}.log",
        ports=MappingProxyType(ports),
        **extra,
    )


def _mps_env(node: Node, name: str) -> dict[str, str]:
    base = f"{run_dir(node, name)}/mps"
    return {"CUDA_MPS_PIPE_DIRECTORY": f"{base}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{base}/log"}


def _assign_rank_offsets(top: Topology, engines: list[EngineSpec]) -> list[EngineSpec]:
    """Engine i gets rank_offset = 1 + GPUs of the engines before it (trainer rank 0 is 0)."""
    if top.trainer is None or top.weights is None:
        return engines
    out = []
    offset = 1
    for engine in engines:
        out.append(replace(engine, rank_offset=offset))
        offset += engine.gpus
    return out


def _plan_trainer(
    top: Topology, layout: GpuLayout, cursors: PortCursors, engines: list[EngineSpec], router_url: str
) -> tuple[list[LaunchSpec], WeightGroup | None]:
    assert top.trainer is not None
    head = top.node(layout.trainer[0][0])
    master_port = cursors.take(head.name, key=f"trainer.{head.name}:master")
    weight_group = None
    if top.weights is not None:
        wg_port = cursors.take(head.name, key=f"trainer.{head.name}:weight_group")
        weight_group = WeightGroup(
            master_address=url_host(head.host).strip("[]"),
            master_port=wg_port,
            world_size=1 + sum(e.gpus for e in engines),
            group_name=top.weights.group_name,
            backend=top.weights.backend,
            bucket_mb=top.weights.bucket_mb,
            refit=top.weights.refit.value,
            max_staleness=top.weights.max_staleness,
        )
    shared_env = {
        "PDCTL_CLUSTER": top.name,
        ROUTER_URL_ENV: router_url,
        "PDCTL_ENGINES": compact_json([{"id": e.id, "url": e.url, "role": e.role.value} for e in engines]),
    }
    if top.router.api_key_env:  # the name; `up` puts the key itself in the trainer's env at launch
        shared_env[API_KEY_ENV_ENV] = top.router.api_key_env
    if weight_group is not None:
        # Read back by WeightSync.from_env as pdctl.weights.env.WeightGroupEnv.
        shared_env[WEIGHT_GROUP_ENV] = compact_json(weight_group.to_dict(tuple(engines)))
        shared_env.update(WEIGHT_ENV)
    if top.placement.colocate and top.placement.train_frac:
        shared_env["PDCTL_TRAIN_FRAC"] = f"{top.placement.train_frac:g}"
    if top.placement.colocate:  # the trainer starts first: WeightSync.connect waits for the engines
        shared_env[READY_TIMEOUT_ENV] = "900"
    procs = []
    nnodes = len(layout.trainer)
    for rank, (node_name, gpu_ids) in enumerate(layout.trainer):
        node = top.node(node_name)
        argv = trainer_argv(
            top,
            node,
            nnodes=nnodes,
            node_rank=rank,
            nproc=len(gpu_ids),
            master_addr=url_host(head.host).strip("[]"),
            master_port=master_port,
        )
        env = {**node.env, **shared_env, **top.trainer.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))}
        ports = {"master": master_port} if rank == 0 else {}
        if rank == 0 and weight_group is not None:
            ports["weight_group"] = weight_group.master_port
        procs.append(
            _spec(
                top,
                node,
                f"trainer.{node.name}",
                Role.TRAINER,
                argv,
                env,
                ports,
                gpu_ids=gpu_ids,
                node_rank=rank,
                restart=top.trainer.restart,
            )
        )
    return procs, weight_group


def check_invariants(plan: Plan, *, colocate: bool) -> None:
    """Raise PlanError naming the first invariant that does not hold.

    - no GPU used twice on a node (colocate: at most one engine and one trainer rank);
    - no port used twice on a node;
    - every engine has exactly one entrypoint process;
    - weight-group ranks 1..world_size-1 cover every engine GPU exactly once;
    - colocate: trainer rank i runs on the GPU of engine GPU i (engine order, TP rank order).
    """
    by_id = {p.id: p for p in plan.processes}
    gpu_users: dict[tuple[str, int], list[str]] = defaultdict(list)
    port_users: dict[tuple[str, int], list[str]] = defaultdict(list)
    for proc in plan.processes:
        for gpu in proc.gpu_ids:
            gpu_users[(proc.node, gpu)].append(proc.id)
        for port in proc.owned_ports():
            port_users[(proc.node, port)].append(proc.id)
    for (node, gpu), users in gpu_users.items():
        if len(users) == 1:
            continue
        roles = Counter(by_id[u].role is Role.TRAINER for u in users)
        if not (colocate and roles[True] <= 1 and roles[False] <= 1):
            raise PlanError(f"invariant 'no GPU twice' broken: node {node} GPU {gpu} used by {', '.join(users)}")
    for (node, port), users in port_users.items():
        if len(users) > 1:
            raise PlanError(f"invariant 'no port twice' broken: node {node} port {port} used by {', '.join(users)}")
    for engine in plan.engines:
        entry = [p for p in engine.process_ids if by_id[p].entrypoint]
        if len(entry) != 1:
            raise PlanError(f"invariant 'one entrypoint per engine' broken: {engine.id} has {len(entry)}")
    if plan.weight_group is not None:
        ranks: list[int] = []
        for engine in plan.engines:
            if engine.rank_offset is None:
                raise PlanError(f"invariant 'weight ranks cover engines' broken: {engine.id} has no rank")
            ranks.extend(range(engine.rank_offset, engine.rank_offset + engine.gpus))
        if sorted(ranks) != list(range(1, plan.weight_group.world_size)):
            raise PlanError("invariant 'weight ranks cover every engine GPU exactly once' broken")
    trainers = sorted((p for p in plan.processes if p.role is Role.TRAINER), key=lambda p: p.node_rank)
    if colocate and trainers:
        engine_gpus = [(by_id[pid].node, g) for e in plan.engines for pid in e.process_ids for g in by_id[pid].gpu_ids]
        trainer_gpus = [(p.node, g) for p in trainers for g in p.gpu_ids]
        if engine_gpus != trainer_gpus:
            raise PlanError(
                "invariant 'trainer rank i shares engine GPU i' broken: "
                f"engines {engine_gpus[:8]}..., trainer {trainer_gpus[:8]}..."
            )
