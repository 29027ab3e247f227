"""Layer (c) of validation: rules across objects, one private function per section.

Each returns Issues with dotted paths (positions are attached by load.py). All issues are
collected; nothing stops at the first. GPU and port feasibility reuse the planner's own
placement, so what validates is exactly what plans.
"""

from __future__ import annotations

from collections import Counter

from pdctl.errors import Issue
from pdctl.role_planner.config import Objective, PlannerMode
from pdctl.roles import Role
from pdctl.sglang import check_extra_args
from pdctl.topology.model import DataPlaneBackend, EngineAuth, ServerGroup, Topology

COLOCATE_HEADROOM = 0.10  # TorchSpec's _HEADROOM_FRAC: CUDA context, NCCL buffers, fragmentation


def validate(top: Topology) -> list[Issue]:
    """Every semantic issue in ``top`` itself (whether it fits its nodes is the planner's to say)."""
    issues: list[Issue] = []
    checks = (_nodes, _node_refs, _groups, _pd_pairing, _role_switch, _extra_args, _weights, _trainer, _colocate)
    for check in (*checks, _router, _router_settings, _engine_auth, _planner):
        issues += check(top)
    return issues


def _nodes(top: Topology) -> list[Issue]:
    out = []
    for field in ("name", "host"):
        counts = Counter(getattr(n, field) for n in top.nodes)
        for i, node in enumerate(top.nodes):
            value = getattr(node, field)
            if counts[value] > 1 and [getattr(n, field) for n in top.nodes].index(value) != i:
                out.append(Issue(f"nodes[{i}].{field}", f"duplicate node {field} {value!r}", hint="each node once"))
    local = [i for i, n in enumerate(top.nodes) if n.is_local]
    if local and len(local) < len(top.nodes):
        name = top.nodes[local[0]].name
        out.append(
            Issue(
                f"nodes[{local[0]}].host",
                f"node {name} is a loopback address but other nodes are remote, so they could not reach it",
                hint="use this machine's network address",
            )
        )
    if top.engine == "sglang":
        for i, node in enumerate(top.nodes):
            if node.gpus == 0 and _node_used(top, node.name):
                out.append(Issue(f"nodes[{i}].gpus", f"node {node.name} has 0 GPUs but runs GPU work"))
    return out


def _node_used(top: Topology, name: str) -> bool:
    pinned = [n for g in top.groups for n in (g.nodes or ())]
    return name in pinned or any(g.nodes is None for g in top.groups)


def _node_refs(top: Topology) -> list[Issue]:
    names = {n.name for n in top.nodes}
    known = ", ".join(n.name for n in top.nodes)
    out = []
    for group in top.groups:
        for i, ref in enumerate(group.nodes or ()):
            if ref not in names:
                out.append(Issue(f"{group.path}.nodes[{i}]", f"unknown node {ref!r}", hint=f"nodes: {known}"))
    if top.trainer and top.trainer.nodes:
        for i, ref in enumerate(top.trainer.nodes):
            if ref not in names:
                out.append(Issue(f"trainer.nodes[{i}]", f"unknown node {ref!r}", hint=f"nodes: {known}"))
        dup = [n for n, c in Counter(top.trainer.nodes).items() if c > 1]
        if dup:
            out.append(Issue("trainer.nodes", f"node {dup[0]!r} listed twice", hint="one torchrun per node"))
    if top.router.node and top.router.node not in names:
        out.append(Issue("router.node", f"unknown node {top.router.node!r}", hint=f"nodes: {known}"))
    return out


def _groups(top: Topology) -> list[Issue]:
    out = []
    names = Counter(g.name for g in top.groups)
    for group in top.groups:
        if names[group.name] > 1:
            out.append(Issue(f"{group.path}.name", f"duplicate group name {group.name!r}", hint="name each group"))
        if group.tp % group.attn_dp:
            out.append(
                Issue(
                    f"{group.path}.attn_dp",
                    f"attn_dp {group.attn_dp} must divide tp {group.tp}",
                    hint="attention DP splits the tp GPUs",
                )
            )
        if group.role is Role.REGULAR and group.transfer_backend:
            out.append(Issue(f"{group.path}.transfer_backend", "regular (non-PD) engines move no KV"))
        if top.engine == "sglang" and group.transfer_backend == "fake":
            out.append(
                Issue(
                    f"{group.path}.transfer_backend",
                    "the fake backend moves no KV; outputs will be wrong",
                    severity="warning",
                )
            )
    if not top.groups:
        out.append(Issue("", "no engines: add prefill and decode (or regular) groups, or an allocation"))
    return out


def _pd_pairing(top: Topology) -> list[Issue]:
    roles = {g.role for g in top.groups}
    out = []
    if Role.PREFILL in roles and Role.DECODE not in roles:
        out.append(Issue("prefill", "prefill engines without decode engines", hint="add a decode group"))
    if Role.DECODE in roles and Role.PREFILL not in roles:
        out.append(Issue("decode", "decode engines without prefill engines", hint="add a prefill group"))
    if Role.REGULAR in roles and (Role.PREFILL in roles or Role.DECODE in roles):
        out.append(
            Issue(
                "regular",
                "regular engines cannot share a router with PD engines",
                hint="run PD (prefill + decode) or regular engines, not both",
            )
        )
    return out


ROLE_SWITCH_REFUSES = {
    "speculative-algorithm": "speculative decoding",
    "ep-size": "expert parallelism",
    "moe-a2a-backend": "MoE all-to-all",
    "dcp-size": "decode context parallelism",
}
"""Flags SGLang 0.5.23 refuses beside --enable-pd-role-switch (arg_groups/pd_disaggregation_hook.py:
their role-specific state is not rebuilt on a flip), and what each is."""


def _role_switch(top: Topology) -> list[Issue]:
    """``role_switch`` groups: prefill or decode, pure TP on one node (pp 1 is SGLang's rule; dp and
    attn_dp 1 and one node are pdctl's, which switches one process whole), none of the features
    SGLang refuses with the flag, and a group of the other role to switch to."""
    out = []
    switchable = [g for g in top.groups if g.role_switch]
    for group in switchable:
        path = f"{group.path}.role_switch"
        if group.role not in (Role.PREFILL, Role.DECODE):
            out.append(Issue(path, f"{group.name}: only prefill and decode engines switch roles"))
            continue
        for key in ("pp", "dp", "attn_dp"):
            if getattr(group, key) != 1:
                out.append(Issue(f"{group.path}.{key}", f"{group.name}: a role switch needs pure TP ({key} 1)"))
        biggest = max((n.gpus for n in top.nodes if not group.nodes or n.name in group.nodes), default=0)
        if group.gpus_per_engine > biggest > 0:
            out.append(Issue(f"{group.path}.tp", f"{group.name}: a role switch needs each engine on one node"))
        if group.transfer_backend not in (None, "mooncake", "mori"):
            out.append(
                Issue(
                    f"{group.path}.transfer_backend",
                    f"{group.name}: transfer backend {group.transfer_backend!r} does not support a runtime role switch",
                    hint="use mooncake (the default) or mori",
                )
            )
        for flag, what in ROLE_SWITCH_REFUSES.items():
            value = group.arg(flag)
            if value is not None and value not in (False, 1, "none") and not (flag == "ep-size" and value == 1):
                out.append(
                    Issue(
                        f"{group.path}.args.{flag}",
                        f"{group.name}: SGLang refuses {what} (--{flag}) with --enable-pd-role-switch",
                        hint="remove it, or role_switch",
                    )
                )
        out += _role_switch_settings(group)
        others = [g for g in switchable if g.role is not group.role and g.role in (Role.PREFILL, Role.DECODE)]
        if group.role in (Role.PREFILL, Role.DECODE) and not any(g.tp == group.tp for g in others):
            other = "decode" if group.role is Role.PREFILL else "prefill"
            out.append(
                Issue(
                    path,
                    f"{group.name}: no {other} group with role_switch and tp {group.tp} to switch its engines to",
                    hint=f"set role_switch on a {other} group of the same tp",
                )
            )
    return out


def _role_switch_settings(group: ServerGroup) -> list[Issue]:
    """The other settings SGLang 0.5.23 refuses beside ``--enable-pd-role-switch``
    (arg_groups/pd_disaggregation_hook.py, disaggregation/role_switch.py): a decode that allocates
    only once the prefill completes, a decode host receive threshold below 1, and the staging
    buffer (its environment variable, refused at the switch itself)."""
    out = []
    policy = group.arg("disaggregation-decode-allocation-policy")
    if policy == "prefill_complete":
        out.append(Issue(f"{group.path}.args.disaggregation-decode-allocation-policy",
                         f"{group.name}: SGLang refuses runtime PD role switching with prefill_complete allocation",
                         hint="remove it, or role_switch"))  # fmt: skip
    threshold = group.arg("disaggregation-decode-host-receive-threshold")
    try:
        below_one = threshold is not None and float(threshold) < 1
    except (TypeError, ValueError):
        below_one = False
    if below_one:
        out.append(Issue(f"{group.path}.args.disaggregation-decode-host-receive-threshold",
                         f"{group.name}: SGLang's decode host receive does not support role switching (below 1)",
                         hint="remove it, or role_switch"))  # fmt: skip
    staging = group.env.get("SGLANG_DISAGG_STAGING_BUFFER")
    if staging is not None and staging.strip().lower() not in ("", "0", "false", "no", "off"):
        out.append(Issue(f"{group.path}.env.SGLANG_DISAGG_STAGING_BUFFER",
                         f"{group.name}: SGLang refuses the staging buffer with a runtime role switch",
                         hint="remove it, or role_switch"))  # fmt: skip
    return out


def _extra_args(top: Topology) -> list[Issue]:
    out = []
    for group in top.groups:
        for key, message, hint in check_extra_args(group.args, allow_sim_flags=top.engine == "sim"):
            out.append(Issue(f"{group.path}.args.{key}", message, hint=hint))
    return out


def _weights(top: Topology) -> list[Issue]:
    if top.trainer is None or top.weights is None:
        return []
    out = []
    for group in top.groups:
        if group.dp > 1:
            out.append(
                Issue(
                    f"{group.path}.dp",
                    f"dp {group.dp}: SGLang refuses weight updates from distributed "
                    "on a data-parallel engine (dp_size must be 1)",
                    hint="use more replicas instead of dp, or attn_dp for attention DP",
                )
            )
        if group.pp > 1:
            out.append(
                Issue(
                    f"{group.path}.pp",
                    f"pp {group.pp}: the flat weight group assumes pp 1 (rank = rank_offset + tp_rank)",
                    hint="use pp 1 on engines that receive weights",
                )
            )
    if top.engine == "sim" and top.weights.backend == "nccl":
        out.append(Issue("weights.backend", "the sim engine runs on CPU and needs gloo", severity="warning"))
    return out


def _trainer(top: Topology) -> list[Issue]:
    trainer = top.trainer
    if trainer is None:
        return []
    out = []
    nodes = trainer.nodes or (top.nodes[-1].name,)
    for i, name in enumerate(nodes):
        try:
            node = top.node(name)
        except KeyError:
            continue
        if trainer.nproc_per_node and trainer.nproc_per_node > node.gpus and top.engine == "sglang":
            path = f"trainer.nodes[{i}]" if trainer.nodes else "trainer.nproc_per_node"
            out.append(Issue(path, f"nproc_per_node {trainer.nproc_per_node} > node {name}'s {node.gpus} GPUs"))
    return out


def _colocate(top: Topology) -> list[Issue]:
    """Colocate's own rules; the pairing of trainer ranks with engine GPUs per node is the
    planner's (plan/gpus.py), which sees where engines land."""
    p = top.placement
    out = []
    if not p.colocate:
        given = [
            k for k, v in (("train_frac", p.train_frac), ("infer_frac", p.infer_frac), ("mps", p.mps)) if v is not None
        ]
        if p.thread_percentage:
            given.append("mps_active_thread_percentage")
        if p.data_plane is not None:
            given.append("data_plane")
        if given:
            out.append(
                Issue(
                    "placement",
                    f"{', '.join(given)} only appl{'y' if len(given) > 1 else 'ies'} to mode colocate",
                    hint="set mode: colocate or remove them",
                )
            )
        return out
    if top.trainer is None:
        return [Issue("placement.mode", "colocate shares GPUs with a trainer; add a trainer section")]
    for key, value in (("train_frac", p.train_frac), ("infer_frac", p.infer_frac)):
        if value is not None and not 0 < value < 1:
            out.append(Issue(f"placement.{key}", f"{key} {value} is not a fraction of a GPU (0 < {key} < 1)"))
    roles = {g.role.value for g in top.groups} | {"trainer"}
    for role in p.thread_percentage:
        if role not in roles:
            out.append(Issue(f"placement.mps_active_thread_percentage.{role}", f"no {role} processes in this topology"))
    if out:
        return out
    if p.train_frac is None or p.infer_frac is None:
        out.append(Issue("placement", "colocate needs train_frac and infer_frac", hint="e.g. 0.45 and 0.45"))
    elif p.train_frac + p.infer_frac + COLOCATE_HEADROOM > 1 + 1e-9:
        out.append(
            Issue(
                "placement.infer_frac",
                f"train_frac {p.train_frac} + infer_frac {p.infer_frac} + {COLOCATE_HEADROOM} headroom > 1",
                hint="lower one of them",
            )
        )
    engine_gpus = sum(g.total_gpus for g in top.groups)
    nodes = top.trainer.nodes
    if top.trainer.nproc_per_node and nodes:
        world = top.trainer.nproc_per_node * len(nodes)
        if world != engine_gpus:
            out.append(
                Issue(
                    "trainer.nproc_per_node",
                    f"colocate pairs one trainer rank with one engine GPU: "
                    f"trainer world size {world} != engine count x TP = {engine_gpus}",
                )
            )
    return out + _data_plane(top)


def _data_plane(top: Topology) -> list[Issue]:
    """The data plane pairs engine TP rank i with trainer rank i: every engine GPU must compute
    prompts' hidden states in one forward of the whole batch."""
    dp = top.placement.data_plane
    if dp is None:
        return []
    out = []
    for group in top.groups:
        path = group.path
        if group.role is Role.DECODE:
            out.append(
                Issue(
                    path,
                    f"{group.name}: a decode engine computes no prompt hidden states, so its GPUs' trainer ranks "
                    "would get nothing from the data plane",
                    hint="serve with regular (or prefill) engines only",
                )
            )
        for key in ("dp", "pp", "attn_dp"):
            if getattr(group, key) != 1:
                out.append(Issue(f"{path}.{key}", f"{group.name}: the data plane needs {key} 1 (TP shards the batch)"))
        for flag, why in DATA_PLANE_CONFLICTS.items():
            if flag in group.args:
                out.append(Issue(f"{path}.args.{flag}", f"{group.name}: --{flag} {why}", hint="remove it"))
        if dp.batch_size % group.tp:
            out.append(
                Issue(
                    "placement.data_plane.batch_size",
                    f"batch_size {dp.batch_size} is not a multiple of {group.name}'s tp {group.tp}: "
                    "each TP rank sends an equal share of a step",
                )
            )
    path = "placement.data_plane.backend"
    if dp.backend is DataPlaneBackend.NCCL:
        why = (
            "NCCL refuses two ranks of one communicator on one GPU ('Duplicate GPU detected'), and each engine "
            "TP rank shares its GPU with its trainer rank"
        )
        out.append(Issue(path, why, hint="use cuda_ipc (one copy on the GPU), or leave backend out"))
    elif top.engine == "sim" and dp.backend is DataPlaneBackend.CUDA_IPC:
        out.append(Issue(path, "the sim runs on CPU: its data plane is gloo", hint="use gloo, or leave backend out"))
    return out


DATA_PLANE_CONFLICTS = {
    "forward-hooks": "is set by the data plane (its hooks are the engine's --forward-hooks)",
    "enable-mixed-chunk": "mixes decode rows into prefill batches, where the data plane cuts sequences",
    "enable-two-batch-overlap": "interleaves two micro-batches' forwards, which the data plane's hooks read as one",
    "speculative-algorithm": "runs a draft model whose forwards would reach the same hooks",
    "cuda-graph-backend-prefill": "replays prefills from CUDA graphs, which run no forward hooks (the plan sets "
    "--disable-prefill-cuda-graph)",
    "cuda-graph-config": "can put prefills in CUDA graphs, which run no forward hooks (the plan sets "
    "--disable-prefill-cuda-graph; the decode graphs' own flags, --cuda-graph-max-bs-decode and the like, are fine)",
}
"""SGLang flags that break what the data plane's hooks assume of a forward (one whole batch of
whole prompts, one model, run eagerly)."""


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _control_open_from(top: Topology) -> list[Issue]:
    """``router.control_open_from``: each entry a network; a warning that says what it opens."""
    import ipaddress

    out: list[Issue] = []
    nets = []
    for i, entry in enumerate(top.router.control_open_from):
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
        except ValueError as exc:
            out.append(Issue(f"router.control_open_from.{i}", f"{entry!r} is not a network: {exc}"))
    if nets and not out:
        wide = [str(n) for n in nets if n.num_addresses > 256]
        out.append(
            Issue(
                "router.control_open_from",
                f"calls without a key from {', '.join(map(str, nets))} may pause the fleet, change its weights and "
                "register workers (SGLang's control routes, for RL frameworks that send no key)"
                + (f"; {', '.join(wide)} spans more than 256 addresses" if wide else ""),
                severity="warning",
                hint="list only the trainer's addresses; every such call is audited in the router's log",
            )
        )
    return out


def _engine_auth(top: Topology) -> list[Issue]:
    """``engine_auth: none``: a warning that says what an engine without the key answers, and to whom."""
    if top.engine_auth is not EngineAuth.NONE:
        return []
    hosts = sorted({n.host for n in top.nodes})
    return [
        Issue(
            "engine_auth",
            f"engines on {', '.join(hosts)} answer every caller that reaches their ports with no key: generation, "
            "weight updates and groups, loads from disk, memory release, cache flush, pause and role switch",
            severity="warning",
            hint="only where the nodes' network is private to the cluster and its trainer (slime's external "
            "engines send no key); the router and pdctl's own calls still hold their keys",
        )
    ]


def _planner(top: Topology) -> list[Issue]:
    """``planner:``: it moves engines of role_switch groups, so it needs them (mode off needs
    nothing); its minimums must leave it something to move; the latency objective needs targets."""
    planner = top.planner
    if planner is None or planner.mode is PlannerMode.OFF:
        return []
    out = []
    roles = {g.role for g in top.groups if g.role_switch}
    if not {Role.PREFILL, Role.DECODE} <= roles:
        out.append(
            Issue(
                "planner",
                "the planner moves engines between prefill and decode groups with role_switch: true, and this "
                "topology has none of one role or the other",
                hint="set role_switch: true on a prefill and a decode group of the same tp, or planner.mode: off",
            )
        )
    engines = sum(g.replicas for g in top.groups if g.role in (Role.PREFILL, Role.DECODE))
    low_prefill, low_decode = planner.minimum(Role.PREFILL, engines), planner.minimum(Role.DECODE, engines)
    if low_prefill + low_decode > engines:
        out.append(
            Issue(
                "planner.min_prefill",
                f"min_prefill {low_prefill} + min_decode {low_decode} is more than the fleet's {engines} PD engines"
                + ("" if None not in (planner.min_prefill, planner.min_decode) else " (unset: a quarter of them)"),
                hint="lower the minimums",
            )
        )
    if planner.objective is Objective.LATENCY and (not planner.ttft_ms or not planner.itl_ms):
        out.append(
            Issue("planner.objective", "the latency objective needs ttft_ms and itl_ms", hint="set both targets")
        )
    return out


def _router(top: Topology) -> list[Issue]:
    r = top.router
    out: list[Issue] = [*_control_open_from(top)]
    if r.node and r.node not in {n.name for n in top.nodes}:
        return out  # reported by _node_refs
    if r.host not in LOOPBACK_HOSTS and not r.host.startswith("127.") and not r.api_key_env:
        if not r.allow_unauthenticated:
            out.append(
                Issue(
                    "router.host",
                    f"the router binds {r.host} with no client key: anyone who reaches it can send requests",
                    hint="set router.api_key_env (the variable holding the key), bind 127.0.0.1, or set "
                    "router.allow_unauthenticated: true on a network you trust",
                )
            )
        return out
    node = top.router_node
    if node.is_local or r.host not in ("127.0.0.1", "localhost"):
        return out
    trainer_elsewhere = top.trainer is not None and any(n != node.name for n in top.trainer.nodes or ())
    who = "clients on other machines (and the trainer on other nodes)" if trainer_elsewhere else "other machines"
    out.append(
        Issue(
            "router.host",
            f"the router binds 127.0.0.1 on remote node {node.name}; {who} cannot reach it",
            severity="warning",
            hint="set router.host to 0.0.0.0 or the node address (with router.api_key_env), or use an SSH tunnel",
        )
    )
    return out


def _router_settings(top: Topology) -> list[Issue]:
    """Each ``router.GROUP`` checked by the router's own setting class (the rules the router
    applies to its flags), reported at the setting that breaks one."""
    from pdctl.errors import RouterConfigError
    from pdctl.router.config import GROUPS, SETTINGS, STICKY_POLICIES

    out: list[Issue] = []
    for group, values in top.router.settings.items():
        try:
            GROUPS[group](**values)
        except RouterConfigError as exc:
            flag = str(exc).split(" ", 1)[0]  # its message names the flag first
            name = next((st.name for st in SETTINGS if st.group == group and st.flag == flag), "")
            rule = str(exc).split(": must be ", 1)[-1]
            path = f"router.{group}.{name}" if name else f"router.{group}"
            out.append(Issue(path, f"must be {rule} (pdctl router {flag})"))
    admission = top.router.settings.get("admission", {})
    room = admission.get("prefill_room") or admission.get("decode_room")
    policies = {top.router.policy, top.router.prefill_policy, top.router.decode_policy}
    sticky = sorted(p for p in policies if p in STICKY_POLICIES)
    if room and sticky:
        key = "prefill_room" if admission.get("prefill_room") else "decode_room"
        out.append(
            Issue(
                f"router.admission.{key}",
                f"late pairing chooses among the engines with room, which the {', '.join(sticky)} policy's "
                "stickiness cannot keep",
                hint="use random, round_robin, power_of_two or cache_aware, or leave the rooms at 0",
            )
        )
    return out
