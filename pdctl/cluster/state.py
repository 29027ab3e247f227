"""The state file: ``NAME/state.json`` under ``$PDCTL_HOME``, else ``~/.pdctl`` (``state_root``).

Written atomically (temp file + rename), mode 0600, and locked (flock on ``lock``) while
``up`` or ``down`` runs. It holds everything ``down`` needs without the YAML: how to reach
every node and every process's pid, process group and start time. Each save also rewrites
the Prometheus target list beside it (pdctl.cluster.scrape).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pdctl.choices import Choice
from pdctl.cluster.scrape import Target, write_targets
from pdctl.errors import LifecycleError
from pdctl.plan.model import Plan
from pdctl.roles import Role
from pdctl.topology.model import Node, SSHConfig, Topology


def state_root() -> Path:
    """``$PDCTL_HOME``, else ``~/.pdctl``: the same from every directory (SkyPilot's ``~/.sky``
    convention), beside the default node workdir ``~/.pdctl/runs`` where logs live."""
    return Path(os.environ.get("PDCTL_HOME") or Path.home() / ".pdctl")


class Phase(Choice):
    """Where a cluster is in its life (a ``str`` enum: state files hold the value)."""

    STARTING = "starting"
    UP = "up"
    FAILED = "failed"
    STOPPING = "stopping"
    DOWN = "down"


@dataclass
class ProcessRecord:
    """One process of a running cluster as ``down`` and ``status`` need it: where it runs, the pid,
    process group and create time that identify it on its node, its log, ports and URLs."""

    id: str
    role: Role
    node: str
    pid: int
    pgid: int
    create_time: float
    """When it started, in seconds since its node booted (pdctl.node.proc.start_time): with the pid, its identity."""
    log_path: str
    ports: dict[str, int] = field(default_factory=dict)
    url: str | None = None
    health_path: str | None = None
    engine_id: str | None = None
    node_rank: int = 0
    exit_file: str | None = None
    """Where the process's supervisor writes its story: restarts, last exit, exit status
    (``pdctl.node.supervise``)."""


@dataclass
class ClusterState:
    """Everything recorded about one cluster, saved as its state file: its phase, how to reach its
    nodes, its processes, run directories and plan; enough for ``down`` without the YAML."""

    name: str
    run_id: str
    status: Phase
    nodes: list[dict[str, Any]]
    router_url: str | None = None
    processes: dict[str, ProcessRecord] = field(default_factory=dict)
    run_dirs: dict[str, str] = field(default_factory=dict)
    plan: Plan = field(default_factory=Plan)
    """What runs now, as planned (read once from the file into its types): a day-2 step replaces it."""
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    source: str = ""
    declared: dict[str, Any] = field(default_factory=dict)
    """What cannot change on a running cluster (``declared_of``), for ``pdctl apply``."""
    journal: dict[str, Any] | None = None
    """The day-2 step in progress (pdctl.cluster.journal): which command, on which engine, how
    far; left behind by a step that was interrupted and could not be undone at once."""
    cordoned_ahead: dict[str, Any] | None = None
    """Engines a move of several switches took out of rotation ahead of their own switch, so that
    they drain side by side (pdctl.cluster.switch.switch_all): ``command``, ``pid`` and
    ``engines`` (id -> URL). Each leaves it as its switch begins (the journal names it then); a
    move that stops lifts the others' cordons, and one killed leaves them here for the next
    command (``recover``) or the planner's restart."""
    mps: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per node, the CUDA MPS control daemon of a colocated cluster: pid, create_time,
    pipe_dir, log_dir, and ``started`` (false: it was already running; ``down`` leaves it)."""
    planner: dict[str, Any] = field(default_factory=dict)
    """The P:D planner's supervisor on the control machine (pdctl.cluster.planner_process): pid,
    create_time, log, exit_file; empty when none runs."""

    def node_objects(self) -> dict[str, Node]:
        """The recorded nodes as ``Node`` objects, keyed by node name."""
        out = {}
        for raw in self.nodes:
            raw = dict(raw)
            ssh = SSHConfig(**raw.pop("ssh", {}))
            out[raw["name"]] = Node(ssh=ssh, **raw)
        return out

    def scrape_targets(self) -> list[Target]:
        """Its running processes as Prometheus may scrape them, in plan order."""
        order = self.plan.order()
        records = sorted(self.processes.values(), key=lambda r: order.get(r.id, len(order)))
        return [Target(r.id, r.role, r.node, r.url, r.ports.get("metrics")) for r in records]

    def to_json(self) -> str:
        """The state file's text: compact ASCII JSON with sorted keys (an indented dump runs json's
        Python encoder, and ``asdict`` deep-copies: 1024 nodes' state took seconds per save). json,
        not orjson, which is faster but writes inf and nan as null and text unescaped."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["processes"] = {k: asdict(v) for k, v in self.processes.items()}
        data["plan"] = self.plan.to_dict()
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ClusterState:
        """The state read back from ``to_json``'s text; raises (``ValueError``, ``TypeError``,
        ``KeyError``) on text that does not hold a state."""
        data = json.loads(text)
        data["processes"] = {
            k: ProcessRecord(**{**v, "role": Role(v["role"])}) for k, v in data.get("processes", {}).items()
        }
        data["status"] = Phase(data["status"])
        data["plan"] = Plan.from_dict(data.get("plan") or {})
        return cls(**data)


def declared_of(top: Topology) -> dict[str, Any]:
    """The topology's fields that ``pdctl apply`` cannot change live, by their path in the file."""
    return {
        "model.path": top.model.path,
        "engine": top.engine,
        "ports.base": top.port_base,
        "trainer.command": list(top.trainer.command) if top.trainer else None,
        "placement.mode": "colocate" if top.placement.colocate else "separate",
        "placement.data_plane": _data_plane_declared(top),
        "router mode": "pd" if top.is_pd else "regular",  # the router's --pd-disaggregation, fixed at its start
    }


def _data_plane_declared(top: Topology) -> dict[str, Any] | None:
    """A data plane's union world is fixed when it forms (as torchrun's is): its settings and the
    engines it pairs with trainer ranks cannot change under a running trainer."""
    dp = top.placement.data_plane
    if dp is None:
        return None
    out = {k: v for k, v in asdict(dp).items() if k != "backend"}
    out["aux_layers"] = list(dp.aux_layers)
    out["backend"] = dp.backend.value if dp.backend else None
    out["engines"] = [f"{g.name}: {g.replicas} x tp {g.tp}" for g in top.groups]
    return out


def node_to_dict(node: Node) -> dict[str, Any]:
    return {
        "name": node.name,
        "host": node.host,
        "gpus": node.gpus,
        "python": node.python,
        "workdir": node.workdir,
        "env": dict(node.env),
        "ssh": asdict(node.ssh),
    }


class StateStore:
    """The clusters' state files under one root (``state_root`` unless given): one directory per
    cluster name."""

    def __init__(self, root: Path | None = None):
        self.root = root or state_root()

    def dir(self, name: str) -> Path:
        """The cluster's directory (it may not exist)."""
        return self.root / name

    def path(self, name: str) -> Path:
        """The cluster's state file (it may not exist)."""
        return self.dir(name) / "state.json"

    def load(self, name: str) -> ClusterState | None:
        """The cluster's saved state; ``None`` when it has none. Raises ``LifecycleError`` when the
        file cannot be read or parsed."""
        path = self.path(name)
        if not path.exists():
            return None
        try:
            return ClusterState.from_json(path.read_text())
        except KeyError as exc:
            raise LifecycleError(f"state file {path} is unreadable: a missing key {exc}") from exc
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise LifecycleError(f"state file {path} is unreadable: {exc}") from exc

    def save(self, state: ClusterState) -> None:
        """Atomic, 0600: write a temp file in the same directory, fsync, rename."""
        state.updated_at = time.time()
        directory = self.dir(state.name)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = directory / f".state.json.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(state.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path(state.name))
        write_targets(directory, state.name, state.scrape_targets())  # Prometheus' file_sd list follows every change

    def names(self) -> list[str]:
        """The names of the clusters that have a state file, sorted."""
        if not self.root.is_dir():
            return []
        return sorted(p.parent.name for p in self.root.glob("*/state.json"))

    def remove(self, name: str) -> None:
        """Delete the cluster's directory (state, lock, target list); a missing one is fine."""
        import shutil

        shutil.rmtree(self.dir(name), ignore_errors=True)

    @contextlib.contextmanager
    def locked(self, name: str) -> Iterator[None]:
        """Exclusive lock for up/down of ``name``; a second one fails at once, naming the holder."""
        directory = self.dir(name)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                raise LifecycleError(f"another pdctl up/down of {name!r} is running (pid {holder})") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield
        finally:
            if not self.path(name).exists():  # nothing was saved (a refused up): leave nothing behind
                (directory / "lock").unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    directory.rmdir()
            os.close(fd)

    def resolve_name(self, name: str | None) -> str:
        """NAME; else the only cluster there is, or the only one not down (a stopped cluster's
        state stays for its logs and must not make NAME necessary); a clear error otherwise."""
        if name:
            return name
        names = self.names()
        if len(names) == 1:
            return names[0]
        if not names:
            raise LifecycleError(f"no clusters in {self.root}; give a NAME or run `pdctl up` first")
        live = [n for n in names if (state := self.load(n)) is not None and state.status != Phase.DOWN]
        if len(live) == 1:
            return live[0]
        raise LifecycleError(f"several clusters in {self.root} ({', '.join(names)}); give a NAME")
