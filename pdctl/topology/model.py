"""The topology as frozen dataclasses.

YAML enters only through ``Topology.from_dict`` after the schema check (schema.py); the
semantic checks across objects live in validate.py. Derived facts are properties.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pdctl.choices import Choice
from pdctl.refit import DEFAULT_BUCKET_MB, RefitMode
from pdctl.role_planner.config import PLANNED_FLEET_ROUTER_POLICY, PlannerConfig, PlannerMode
from pdctl.roles import RestartPolicy, Role

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
DEFAULT_PORT_BASE = 20000
DEFAULT_WORKDIR = "~/.pdctl/runs"


def _frozen_map(raw: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(raw or {}))


def _env(raw: Mapping[str, Any] | None) -> Mapping[str, str]:
    return MappingProxyType({k: _env_value(v) for k, v in (raw or {}).items()})


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class SSHConfig:
    """How to reach a remote node. Unset fields fall back to ~/.ssh/config, then defaults."""

    user: str | None = None
    port: int | None = None
    key: str | None = None
    known_hosts: str | None = None
    accept_new_host_key: bool = False
    """Record an unknown host's key (StrictHostKeyChecking=accept-new); a changed key is refused."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """One machine. ``host`` is the address engines bind and peers use."""

    name: str
    host: str
    gpus: int = 8
    ssh: SSHConfig = field(default_factory=SSHConfig)
    python: str = "python3"
    """Interpreter on the node that runs engines, the router and torchrun."""
    workdir: str = DEFAULT_WORKDIR
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def is_local(self) -> bool:
        """True when processes run on this machine without SSH."""
        return self.host in LOCAL_HOSTS

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Node:
        """Build from one schema-valid ``nodes`` entry. A local node defaults to this interpreter and,
        under ``$PDCTL_HOME``, to that home's runs directory."""
        host = raw["host"]
        default_python = sys.executable if host in LOCAL_HOSTS else "python3"
        # A node on this machine keeps its runs under this machine's pdctl home ($PDCTL_HOME), so
        # that two homes with a cluster of the same name do not rotate each other's logs.
        home = os.environ.get("PDCTL_HOME")
        default_workdir = f"{home}/runs" if home and host in LOCAL_HOSTS else DEFAULT_WORKDIR
        return cls(
            name=raw["name"],
            host=host,
            gpus=raw.get("gpus", 8),
            ssh=SSHConfig(**raw.get("ssh", {})),
            python=raw.get("python", default_python),
            workdir=raw.get("workdir", default_workdir),
            env=_env(raw.get("env")),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """The ``model:`` section: the checkpoint ``path`` the engines load, with optional served name,
    tokenizer and dtype."""

    path: str
    served_name: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerGroup:
    """A set of identical engines of one role.

    An engine uses ``tp * pp * dp`` GPUs; ``attn_dp`` splits attention inside the tp GPUs.
    """

    name: str
    role: Role
    replicas: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 1
    attn_dp: int = 1
    transfer_backend: str | None = None
    ib_device: str | None = None
    nodes: tuple[str, ...] | None = None
    """Pin engines to these nodes, in order; None = first fit over all nodes."""
    args: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Extra SGLang flags (full names, no leading --), rendered after pdctl's own."""
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    path: str = ""
    """Where the group is written (``decode``, ``prefill[1]``, ``allocation``), for messages."""
    restart: RestartPolicy = RestartPolicy.ON_FAILURE
    """Restart policy of its processes on their nodes (pdctl.node.supervise): on-failure or never."""
    liveness_timeout_secs: float | None = 30.0
    """Its supervisor kills (then restarts by policy) an engine silent this long on its HTTP port
    once it first answered; None: never (pdctl.node.supervise)."""
    role_switch: bool = False
    """Its engines may switch PD role live (SGLang's ``/pd_role_switch``, ``--enable-pd-role-switch``):
    ``pdctl apply`` moves engines between a prefill and a decode group that both allow it, and
    ``pdctl switch`` does one by hand."""

    def arg(self, name: str) -> Any:
        """The value of SGLang flag ``name`` (no leading --) in ``args``, where it may be written
        with or without the dashes; None when unset."""
        for key, value in self.args.items():
            if str(key).lstrip("-") == name:
                return value
        return None

    @property
    def gpus_per_engine(self) -> int:
        """GPUs one engine takes: ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp

    @property
    def total_gpus(self) -> int:
        """GPUs the whole group takes, every replica's."""
        return self.gpus_per_engine * self.replicas

    @property
    def needs_dist_init(self) -> bool:
        """Attention-DP engines need a --dist-init-addr block even on one node."""
        return self.attn_dp > 1 or self.dp > 1

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, role: Role, default_name: str, path: str) -> ServerGroup:
        """Build from one schema-valid group section of ``role``; ``path`` is where the file writes it."""
        return cls(
            path=path,
            name=raw.get("name", default_name),
            role=role,
            replicas=raw.get("replicas", 1),
            tp=raw.get("tp", 1),
            pp=raw.get("pp", 1),
            dp=raw.get("dp", 1),
            attn_dp=raw.get("attn_dp", 1),
            transfer_backend=raw.get("transfer_backend"),
            ib_device=raw.get("ib_device"),
            nodes=tuple(raw["nodes"]) if "nodes" in raw else None,
            args=_frozen_map(raw.get("args")),
            env=_env(raw.get("env")),
            restart=RestartPolicy(raw.get("restart", "on-failure")),
            liveness_timeout_secs=raw.get("liveness_timeout_secs", 30.0),
            role_switch=bool(raw.get("role_switch", False)),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterSpec:
    """The ``router:`` section: where the router runs, its policies, its keys and its own settings."""

    node: str | None = None
    """Node that runs the router; None = the first node."""
    host: str = "127.0.0.1"
    port: int | None = None
    """None = next port of the router node's cursor."""
    policy: str = "round_robin"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    api_key_env: str | None = None
    """Environment variable holding the API key; the key never appears in files or logs."""
    allow_unauthenticated: bool = False
    """Serve inference without a client key on an address other machines reach (validate refuses
    a non-loopback router without ``api_key_env`` unless this is true)."""
    control_open_from: tuple[str, ...] = ()
    """Networks (CIDR) whose calls to SGLang's control routes and ``/workers`` need no key (RL
    frameworks send none): ``pdctl router --control-plane-open-from``."""
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: MappingProxyType({}))
    """The router's own settings as the file gives them: group (``retry``, ``breaker``,
    ``admission``, ``health``, ``cache``) -> setting -> value; what is not given keeps the router's
    default (pdctl.router.config). The planner turns each into its flag."""
    restart: RestartPolicy = RestartPolicy.ON_FAILURE

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RouterSpec:
        """Build from the schema-valid ``router:`` section. Group settings and the flat keys of earlier
        files (``LEGACY_ROUTER_KEYS``) both end up in ``settings``; a group's own key wins over a flat one."""
        r = dict(raw)
        settings: dict[str, dict[str, Any]] = {}
        for group in ROUTER_GROUPS:
            if group in r:
                settings[group] = dict(r.pop(group))
        for key, (group, name) in LEGACY_ROUTER_KEYS.items():  # the flat spellings of earlier files
            if key in r:
                settings.setdefault(group, {}).setdefault(name, r.pop(key))
        if "restart" in r:
            r["restart"] = RestartPolicy(r["restart"])
        if "control_open_from" in r:
            r["control_open_from"] = tuple(r["control_open_from"])
        return cls(**r, settings=MappingProxyType({g: MappingProxyType(v) for g, v in settings.items()}))


ROUTER_GROUPS = ("health", "retry", "breaker", "admission", "cache")
"""pdctl.router.config.GROUPS' names (kept here: the topology does not import the router)."""
LEGACY_ROUTER_KEYS = {
    "request_timeout_secs": ("admission", "request_timeout_secs"),
    "max_concurrent_requests": ("admission", "max_concurrent_requests"),
    "health_check_interval_secs": ("health", "interval_secs"),
    "health_failure_threshold": ("health", "failure_threshold"),
}
"""Flat ``router:`` keys of earlier topology files -> the group setting they mean."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    """The ``trainer:`` section: the training command, the nodes and ranks it runs on, and its
    restart policy."""

    command: tuple[str, ...]
    nproc_per_node: int | None = None
    """None = every GPU of the node (or world size / nodes from ``allocation``)."""
    nodes: tuple[str, ...] | None = None
    """None = the last node."""
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    restart: RestartPolicy = RestartPolicy.NEVER
    """Its ranks are not restarted unless asked: a restarted rank cannot rejoin a torchrun job."""
    startup_secs: float = 10.0
    """How long ``up`` watches it after its start: an exit with an error in that time fails ``up``."""


class EngineAuth(Choice):
    """``engine_auth``: whether engines ask callers for the cluster's engine key."""

    KEY = "key"
    """SGLang's --api-key: the router, pdctl and the trainer hold it; nobody else is answered."""
    NONE = "none"
    """No key: anyone who reaches an engine's port is answered (slime's external-engine mode sends none)."""


class WeightBackend(Choice):
    """The flat weight group's torch.distributed backend: ``nccl`` on GPUs, ``gloo`` on CPU."""

    NCCL = "nccl"
    GLOO = "gloo"


class PlacementMode(Choice):
    """Words for ``placement.mode``: whether the trainer and the engines share GPUs."""

    SEPARATE = "separate"
    """Engines and trainer on disjoint GPUs."""
    COLOCATE = "colocate"
    """Trainer ranks share the engines' GPUs (under CUDA MPS)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightsConfig:
    """The ``weights:`` section: the trainer's flat weight group to the engines, and how an update
    treats requests in flight."""

    backend: WeightBackend = WeightBackend.NCCL
    bucket_mb: int = DEFAULT_BUCKET_MB
    group_name: str = "weight_update_group"
    refit: RefitMode = RefitMode.DRAIN
    """How a weight update treats requests in flight (pdctl.refit)."""
    max_staleness: int | None = None
    """``interrupt``: the most updates one request may be continued across (None: no bound)."""
    from_peer: bool = True
    """A restarted or added engine takes the fleet's weights from a peer (pdctl.node.peer_weights)."""


class DataPlaneBackend(Choice):
    """How the data plane moves hidden states between the two processes on one GPU:
    ``cuda_ipc`` (one device-to-device copy into the trainer's buffer), ``gloo`` (through host
    memory; the sim's, on CPU). ``nccl`` is refused by validation: NCCL will not put two ranks of
    one communicator on one GPU."""

    CUDA_IPC = "cuda_ipc"
    GLOO = "gloo"
    NCCL = "nccl"


@dataclass(frozen=True, kw_only=True, slots=True)
class DataPlaneConfig:
    """``placement.data_plane``: hidden states from engine TP rank i to trainer rank i
    (pdctl.colocate). ``backend`` None: gloo for the sim, else cuda_ipc."""

    backend: DataPlaneBackend | None = None
    batch_size: int = 8
    """Sequences per step of one engine; TP rank j sends its TP-th share of them."""
    aux_layers: tuple[int, ...] = ()
    """Layers whose output (the residual stream after ``model.layers.K``) is sent too, as Eagle3 reads."""
    dtype: str | None = None
    """None: as the engine computed them."""
    timeout_secs: float = 300.0
    """How long a trainer rank's ``recv`` waits for its engine rank's step once it said ready
    (an engine rank waits for its trainer rank as long as that one lives)."""
    join_timeout_secs: float = 900.0
    """How long every rank waits for the whole union world to join (engines join once their model
    is loaded)."""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DataPlaneConfig:
        """Build from the schema-valid ``placement.data_plane`` section; ``aux_layers`` come back sorted."""
        fields = dict(raw)
        if fields.get("backend") is not None:
            fields["backend"] = DataPlaneBackend(fields["backend"])
        fields["aux_layers"] = tuple(sorted(int(k) for k in fields.get("aux_layers") or ()))
        return cls(**fields)


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """``separate``: engines and trainer on disjoint GPUs; ``colocate``: shared under CUDA MPS.

    ``mps``: None when the file does not say (colocate then runs MPS); ``thread_percentage``:
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` per role (trainer, prefill, decode, regular)."""

    mode: PlacementMode = PlacementMode.SEPARATE
    train_frac: float | None = None
    infer_frac: float | None = None
    mps: bool | None = None
    thread_percentage: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    data_plane: DataPlaneConfig | None = None

    @property
    def colocate(self) -> bool:
        """True in ``colocate`` mode."""
        return self.mode is PlacementMode.COLOCATE

    @property
    def uses_mps(self) -> bool:
        """Colocated processes share each GPU through one MPS control daemon per node."""
        return self.colocate and self.mps is not False

    @classmethod
    def from_dict(cls, raw: str | Mapping[str, Any]) -> Placement:
        """Build from ``placement:``, either a mode word or a schema-valid mapping."""
        if isinstance(raw, str):
            return cls(mode=PlacementMode(raw))
        fields = {k: v for k, v in raw.items() if k != "mps_active_thread_percentage"}
        if "mode" in fields:
            fields["mode"] = PlacementMode(fields["mode"])
        if fields.get("data_plane") is not None:  # (null: no data plane)
            fields["data_plane"] = DataPlaneConfig.from_dict(fields["data_plane"])
        percentages = raw.get("mps_active_thread_percentage") or {}
        return cls(**fields, thread_percentage=MappingProxyType({str(k): int(v) for k, v in percentages.items()}))


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """A whole cluster. Groups keep declaration order: prefill groups, decode, regular."""

    name: str
    model: ModelSpec
    engine: str = "sglang"
    nodes: tuple[Node, ...]
    port_base: int = DEFAULT_PORT_BASE
    allocation: str | None = None
    groups: tuple[ServerGroup, ...] = ()
    router: RouterSpec = field(default_factory=RouterSpec)
    trainer: TrainerConfig | None = None
    weights: WeightsConfig | None = None
    placement: Placement = field(default_factory=Placement)
    engine_auth: EngineAuth = EngineAuth.KEY
    planner: PlannerConfig | None = None
    """The ``planner:`` section (pdctl.role_planner), if any."""
    _nodes_by_name: Mapping[str, Node] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_nodes_by_name", MappingProxyType({n.name: n for n in self.nodes}))

    @property
    def data_plane_backend(self) -> DataPlaneBackend | None:
        """``placement.data_plane.backend``, else gloo for the sim (on CPU) and cuda_ipc for GPU engines."""
        if self.placement.data_plane is None:
            return None
        default = DataPlaneBackend.GLOO if self.engine == "sim" else DataPlaneBackend.CUDA_IPC
        return self.placement.data_plane.backend or default

    @property
    def is_pd(self) -> bool:
        """True when any group is a prefill or decode group."""
        return any(g.role in (Role.PREFILL, Role.DECODE) for g in self.groups)

    def node(self, name: str) -> Node:
        """The node called ``name``; raises KeyError naming the known nodes."""
        node = self._nodes_by_name.get(name)
        if node is not None:
            return node
        raise KeyError(f"no node {name!r}; nodes: {', '.join(n.name for n in self.nodes)}")

    @property
    def router_node(self) -> Node:
        """The node that runs the router: ``router.node``, else the first node; KeyError for an
        unknown name."""
        return self.node(self.router.node) if self.router.node else self.nodes[0]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Topology:
        """Build from schema-valid data. Allocation-DSL groups are merged by load.py."""
        groups: list[ServerGroup] = []
        for role in (Role.PREFILL, Role.DECODE, Role.REGULAR):
            section = raw.get(role.value)
            if isinstance(section, dict):
                groups.append(ServerGroup.from_dict(section, role=role, default_name=role.value, path=role.value))
            elif isinstance(section, list):
                groups.extend(
                    ServerGroup.from_dict(g, role=role, default_name=role.value, path=f"{role.value}[{i}]")
                    for i, g in enumerate(section)
                )
        placement = Placement.from_dict(raw.get("placement", "separate"))
        trainer = None
        if "trainer" in raw:
            t = raw["trainer"]
            trainer = TrainerConfig(
                command=tuple(t["command"]),
                nproc_per_node=t.get("nproc_per_node"),
                nodes=tuple(t["nodes"]) if "nodes" in t else None,
                env=_env(t.get("env")),
                restart=RestartPolicy(t.get("restart", "never")),
                startup_secs=t.get("startup_secs", 10.0),
            )
        engine = raw.get("engine", "sglang")
        weights = None
        if "weights" in raw or trainer is not None:
            w = dict(raw.get("weights", {}))
            w["backend"] = WeightBackend(w.get("backend") or ("gloo" if engine == "sim" else "nccl"))
            w["refit"] = RefitMode.parse(w.get("refit"))
            weights = WeightsConfig(**w)
        planner = PlannerConfig.from_dict(raw["planner"]) if "planner" in raw else None
        r = dict(raw.get("router", {}))
        if planner is not None and planner.mode is PlannerMode.ACT:
            r.setdefault("policy", PLANNED_FLEET_ROUTER_POLICY)
        return cls(
            name=raw["name"],
            model=ModelSpec(**raw["model"]),
            engine=engine,
            nodes=tuple(Node.from_dict(n) for n in raw["nodes"]),
            port_base=raw.get("ports", {}).get("base", DEFAULT_PORT_BASE),
            allocation=raw.get("allocation"),
            groups=tuple(groups),
            router=RouterSpec.from_dict(r),
            trainer=trainer,
            weights=weights,
            placement=placement,
            engine_auth=EngineAuth(raw.get("engine_auth", EngineAuth.KEY.value)),
            planner=planner,
        )
