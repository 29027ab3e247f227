"""The plan: every process pdctl will start, exactly. The contract between YAML and what runs.

``pdctl plan --json`` prints ``Plan.to_dict()``; tests assert on it; ``up`` executes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from pdctl.colocate.env import DataPlaneSpec
from pdctl.errors import Issue
from pdctl.roles import RestartPolicy, Role


def url_host(host: str) -> str:
    """Host as it appears in a URL: IPv6 in brackets, localhost as 127.0.0.1."""
    if host == "localhost":
        return "127.0.0.1"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass(frozen=True, kw_only=True, slots=True)
class KeptArgs:
    """What a switched engine's process keeps from its old group until its next restart (SGLang keeps a
    process's args across a role switch): ``args`` is ``{flag: [its value, its new group's value]}``,
    true while process ``pid`` runs (``pdctl status`` shows them then)."""

    pid: int | None
    args: Mapping[str, tuple[str | None, str | None]]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, as ``from_dict`` reads it back."""
        return {"pid": self.pid, "args": {flag: list(pair) for flag, pair in self.args.items()}}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KeptArgs:
        """The record ``to_dict`` wrote."""
        args = raw.get("args") or {}
        return cls(pid=raw.get("pid"), args=MappingProxyType({f: (v[0], v[1]) for f, v in args.items()}))


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchSpec:
    """One OS process on one node.

    ``ports`` names each port the process owns on its node: ``http``, ``nccl``,
    ``bootstrap`` (prefill), ``dist_init`` (first of a block of ``dist_init_block``),
    ``metrics`` (router), ``master``, ``weight_group`` and ``data_plane`` (trainer node rank 0).
    """

    id: str
    role: Role
    node: str
    host: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    log_path: str
    gpu_ids: tuple[int, ...] = ()
    ports: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    dist_init_block: int = 0
    engine_id: str | None = None
    node_rank: int = 0
    entrypoint: bool = False
    """True for the one process per engine that serves HTTP requests (and the router)."""
    health_path: str | None = None
    restart: RestartPolicy = RestartPolicy.NEVER
    """on-failure: its node's supervisor restarts it when it fails (pdctl.node.supervise)."""
    liveness_secs: float | None = None
    """Its supervisor kills it when its HTTP port has answered nothing this long (once it first did)."""
    peer_weights: Mapping[str, Any] | None = None
    """An engine's part in weights from a peer (pdctl.node.peer_weights ``PeerPlan.to_dict()``): its
    supervisor starts it from a peer that holds the fleet's weights, and relays its own seed side."""
    switched: bool = False
    """In a running cluster's plan only: the process took this role by a live switch (pdctl.cluster.switch)
    and runs its old group's soft flags until its next restart."""
    kept_args: KeptArgs | None = None
    """In a running cluster's plan only: the soft flags a switched process kept (``status`` shows them)."""

    @property
    def url(self) -> str | None:
        """The process's HTTP URL when it is an entrypoint with an ``http`` port, else ``None``."""
        port = self.ports.get("http")
        return f"http://{url_host(self.host)}:{port}" if port and self.entrypoint else None

    def owned_ports(self) -> list[int]:
        """Every port this process binds on its node, dist-init block included."""
        out = [p for name, p in self.ports.items() if name != "dist_init"]
        if "dist_init" in self.ports:
            start = self.ports["dist_init"]
            out.extend(range(start, start + self.dist_init_block))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-ready data (``url`` included), as ``from_dict`` reads it back."""
        return {
            "id": self.id,
            "role": self.role.value,
            "node": self.node,
            "host": self.host,
            "argv": list(self.argv),
            "env": dict(self.env),
            "cwd": self.cwd,
            "log_path": self.log_path,
            "gpu_ids": list(self.gpu_ids),
            "ports": dict(self.ports),
            "dist_init_block": self.dist_init_block,
            "engine_id": self.engine_id,
            "node_rank": self.node_rank,
            "entrypoint": self.entrypoint,
            "health_path": self.health_path,
            "restart": self.restart,
            "liveness_secs": self.liveness_secs,
            "peer_weights": None if self.peer_weights is None else dict(self.peer_weights),
            "url": self.url,
            **({"switched": True} if self.switched else {}),
            **({"kept_args": self.kept_args.to_dict()} if self.kept_args is not None else {}),
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LaunchSpec:
        """The spec ``to_dict`` wrote (a state file's plan), to launch it again."""
        return cls(
            id=raw["id"],
            role=Role(raw["role"]),
            node=raw["node"],
            host=raw["host"],
            argv=tuple(raw["argv"]),
            env=MappingProxyType(dict(raw["env"])),
            cwd=raw["cwd"],
            log_path=raw["log_path"],
            gpu_ids=tuple(raw.get("gpu_ids", ())),
            ports=MappingProxyType(dict(raw.get("ports", {}))),
            dist_init_block=raw.get("dist_init_block", 0),
            engine_id=raw.get("engine_id"),
            node_rank=raw.get("node_rank", 0),
            entrypoint=raw.get("entrypoint", False),
            health_path=raw.get("health_path"),
            restart=RestartPolicy(raw.get("restart", RestartPolicy.NEVER.value)),
            liveness_secs=raw.get("liveness_secs"),
            peer_weights=raw.get("peer_weights"),
            switched=bool(raw.get("switched", False)),
            kept_args=KeptArgs.from_dict(raw["kept_args"]) if raw.get("kept_args") else None,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """One SGLang server (one lifecycle unit), possibly one process per node."""

    id: str
    group: str
    role: Role
    tp: int
    gpus: int
    process_ids: tuple[str, ...]
    url: str
    bootstrap_port: int | None
    """Where a prefill serves its KV (an engine that may switch role has one in either role)."""
    rank_offset: int | None = None
    """First rank in the weight group (1 + GPUs of the engines before), if there is one."""
    role_switch: bool = False
    """It runs with ``--enable-pd-role-switch``: it may turn prefill or decode live."""
    switch_group: str | None = None
    """The group of the other role it joins when it switches (``pdctl switch``)."""

    @property
    def prefill_bootstrap_port(self) -> int | None:
        """The bootstrap port the router sends a prefill's requests to (None for other roles)."""
        return self.bootstrap_port if self.role is Role.PREFILL else None

    def to_dict(self) -> dict[str, Any]:
        """The engine as JSON-ready data."""
        return {
            "id": self.id,
            "group": self.group,
            "role": self.role.value,
            "tp": self.tp,
            "gpus": self.gpus,
            "process_ids": list(self.process_ids),
            "url": self.url,
            "bootstrap_port": self.bootstrap_port,
            "rank_offset": self.rank_offset,
            "role_switch": self.role_switch,
            "switch_group": self.switch_group,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> EngineSpec:
        """The engine ``to_dict`` wrote (a state file's plan)."""
        return cls(
            id=raw["id"],
            group=raw["group"],
            role=Role(raw["role"]),
            tp=int(raw["tp"]),
            gpus=int(raw["gpus"]),
            process_ids=tuple(raw["process_ids"]),
            url=raw["url"],
            bootstrap_port=raw.get("bootstrap_port"),
            rank_offset=raw.get("rank_offset"),
            role_switch=bool(raw.get("role_switch", False)),
            switch_group=raw.get("switch_group"),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightGroup:
    """The flat broadcast group: trainer rank 0 is rank 0, then every engine GPU once."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str
    bucket_mb: int
    refit: str = "drain"
    max_staleness: int | None = None

    def to_dict(self, engines: tuple[EngineSpec, ...]) -> dict[str, Any]:
        """The group as JSON-ready data, with each of ``engines`` that has a rank in it."""
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "world_size": self.world_size,
            "group_name": self.group_name,
            "backend": self.backend,
            "bucket_mb": self.bucket_mb,
            "refit": self.refit,
            "max_staleness": self.max_staleness,
            "engines": [  # in rank order (a switched engine keeps its ranks and takes a new id)
                {"id": e.id, "url": e.url, "rank_offset": e.rank_offset, "gpus": e.gpus}
                for e in sorted((e for e in engines if e.rank_offset is not None), key=lambda e: e.rank_offset or 0)
            ],
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> WeightGroup:
        """The group ``to_dict`` wrote; its engine list is the plan's (``to_dict`` derives it)."""
        return cls(
            master_address=raw["master_address"],
            master_port=int(raw["master_port"]),
            world_size=int(raw["world_size"]),
            group_name=raw["group_name"],
            backend=raw["backend"],
            bucket_mb=int(raw["bucket_mb"]),
            refit=raw.get("refit", "drain"),
            max_staleness=raw.get("max_staleness"),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class MpsDaemon:
    """The CUDA MPS control daemon a colocated plan needs on one node (pdctl/node/mps.py)."""

    node: str
    pipe_dir: str
    log_dir: str

    def to_dict(self) -> dict[str, Any]:
        """The daemon as JSON-ready data."""
        return {"node": self.node, "pipe_dir": self.pipe_dir, "log_dir": self.log_dir}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> MpsDaemon:
        """The daemon ``to_dict`` wrote."""
        return cls(node=raw["node"], pipe_dir=raw["pipe_dir"], log_dir=raw["log_dir"])


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Everything ``up`` will do. Pure data; deterministic for a given topology.

    A running cluster's state holds its plan as it runs now (``ClusterState.plan``): a day-2 step
    (``apply``, ``switch``, ``restart``) builds a new one (``with_unit``, ``without_unit``) rather than
    editing it. ``Plan()`` is the empty plan of a state that has none yet."""

    name: str = ""
    engine: str = ""
    processes: tuple[LaunchSpec, ...] = ()
    engines: tuple[EngineSpec, ...] = ()
    router_id: str = ""
    weight_group: WeightGroup | None = None
    warnings: tuple[Issue, ...] = ()
    api_key_env: str | None = None
    """The variable holding the router's API key on the control machine (the name only; never the key)."""
    mps: tuple[MpsDaemon, ...] = ()
    """Colocate with MPS: one daemon per node with GPU processes, started before any of them."""
    trainer_first: bool = False
    """Colocate: the trainer starts first, so it claims its memory share before engines size their pools."""
    trainer_startup_secs: float = 10.0
    """How long ``up`` watches the trainer after its start (``trainer.startup_secs``)."""
    refit: str = "drain"
    """``weights.refit``: how updates (a trainer's push, ``pdctl weights load``) treat requests in flight."""
    max_staleness: int | None = None
    data_plane: DataPlaneSpec | None = None
    """Colocate with ``placement.data_plane``: the union world of trainer and engine ranks."""
    engine_auth: str = "key"
    """``engine_auth``: ``none`` starts engines without the engine key (pdctl.cluster.up)."""
    planner: Mapping[str, Any] | None = None
    """The topology's ``planner:`` section (``pdctl planner`` reads it from the state)."""

    def process(self, process_id: str) -> LaunchSpec:
        """The process with this id; raises ``KeyError`` when the plan has none."""
        for spec in self.processes:
            if spec.id == process_id:
                return spec
        raise KeyError(f"no process {process_id!r} in plan {self.name!r}")

    def process_map(self) -> dict[str, LaunchSpec]:
        """Its processes by id, in plan order (one pass: a caller that looks up many builds it once)."""
        return {spec.id: spec for spec in self.processes}

    def engine_map(self) -> dict[str, EngineSpec]:
        """Its engines by id, in plan order."""
        return {engine.id: engine for engine in self.engines}

    def order(self) -> dict[str, int]:
        """Each process id's place in plan order (prefill, decode, router, trainer), for sorting."""
        return {spec.id: i for i, spec in enumerate(self.processes)}

    def without_unit(self, unit: str) -> Plan:
        """This plan without engine ``unit`` and its processes."""
        return replace(
            self,
            processes=tuple(p for p in self.processes if (p.engine_id or p.id) != unit),
            engines=tuple(e for e in self.engines if e.id != unit),
        )

    def with_unit(self, engine: EngineSpec | None, processes: tuple[LaunchSpec, ...], *, replacing: str) -> Plan:
        """This plan with unit ``replacing`` (and its processes) gone, then ``processes`` and ``engine``
        (when given) added at the end: what runs once a step has started, replaced or switched it."""
        rest = self.without_unit(replacing)
        ids = {p.id for p in processes}
        return replace(
            rest,
            processes=(*(p for p in rest.processes if p.id not in ids), *processes),
            engines=(*rest.engines, engine) if engine is not None else rest.engines,
        )

    @property
    def router(self) -> LaunchSpec:
        """The router's process."""
        return self.process(self.router_id)

    @property
    def router_url(self) -> str:
        """Where clients send traffic (the router's bind address, or its node's if 0.0.0.0)."""
        return self.router.url or ""

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data: what ``pdctl plan --json`` prints and the state file keeps."""
        router_url = self.router.url if self.router_id else None
        return {
            "name": self.name,
            "engine": self.engine,
            "router": {"id": self.router_id, "url": router_url, "api_key_env": self.api_key_env},
            "processes": [p.to_dict() for p in self.processes],
            "engines": [e.to_dict() for e in self.engines],
            "weight_group": self.weight_group.to_dict(self.engines) if self.weight_group else None,
            "warnings": [{"path": w.path, "message": w.message} for w in self.warnings],
            "mps": [d.to_dict() for d in self.mps],
            "trainer_first": self.trainer_first,
            "trainer_startup_secs": self.trainer_startup_secs,
            "refit": {"mode": self.refit, "max_staleness": self.max_staleness},
            "data_plane": self.data_plane.to_dict() if self.data_plane else None,
            "engine_auth": self.engine_auth,
            "planner": dict(self.planner) if self.planner is not None else None,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Plan:
        """The plan ``to_dict`` wrote (a state file's), read once into its types; ``{}`` is ``Plan()``.
        Raises ``KeyError``, ``TypeError`` or ``ValueError`` on data that does not hold a plan."""
        if not raw:
            return cls()
        router = raw.get("router") or {}
        refit = raw.get("refit") or {}
        if isinstance(refit, str):  # (a state written before max_staleness joined the mode)
            refit = {"mode": refit}
        group, data_plane = raw.get("weight_group"), raw.get("data_plane")
        return cls(
            name=raw["name"],
            engine=raw["engine"],
            processes=tuple(LaunchSpec.from_dict(p) for p in raw.get("processes", ())),
            engines=tuple(EngineSpec.from_dict(e) for e in raw.get("engines", ())),
            router_id=router.get("id", ""),
            weight_group=WeightGroup.from_dict(group) if group else None,
            warnings=tuple(Issue(path=w["path"], message=w["message"]) for w in raw.get("warnings", ())),
            api_key_env=router.get("api_key_env"),
            mps=tuple(MpsDaemon.from_dict(d) for d in raw.get("mps", ())),
            trainer_first=bool(raw.get("trainer_first", False)),
            trainer_startup_secs=raw.get("trainer_startup_secs", 10.0),
            refit=refit.get("mode", "drain"),
            max_staleness=refit.get("max_staleness"),
            data_plane=DataPlaneSpec.from_dict(data_plane) if data_plane else None,
            engine_auth=raw.get("engine_auth", "key"),
            planner=MappingProxyType(dict(raw["planner"])) if raw.get("planner") is not None else None,
        )
