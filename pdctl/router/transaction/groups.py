"""The fleet's weight groups as the facade keeps them: which engines joined a named group, and at
which ranks.

The fleet answers ``/init_weights_update_group`` as one engine of ``tp`` = all its engines' ranks:
the framework's ``rank_offset`` R0 is the fleet's first rank, and engine j joins at R0 + the ranks
of the engines before it, in the weight group's order (``weight_order``: prefills, then decodes,
then regular engines, each in the order they were registered, which is the plan's order for a
pdctl cluster's own engines: the same ranks ``pdctl plan`` gives them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pdctl.roles import Role
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang.control import DP_REFUSED, InitGroup
from pdctl.sglang.protocol import DEFAULT_GROUP_NAME

_ORDER = {Role.PREFILL: 0, Role.DECODE: 1, Role.REGULAR: 2}


class LayoutError(ValueError):
    """The fleet cannot join a group as asked (a 400 that says why)."""


def label(worker: Worker) -> str:
    """How messages name an engine: its role and URL."""
    return f"{worker.role} {worker.url}"


def label_of(registry: WorkerRegistry, url: str) -> str:
    """How messages name the engine at ``url``: its label while registered, else the URL."""
    worker = registry.workers.get(url)
    return label(worker) if worker is not None else url


def weight_order(workers: Iterable[Worker]) -> list[Worker]:
    """Engines in the weight group's order: prefills, decodes, then regular engines, each by registration."""
    return sorted(workers, key=lambda w: (_ORDER.get(w.role, 3), w.registered_at))


@dataclass(frozen=True)
class Member:
    """An engine in a group: its worker, first rank and rank count (its TP size)."""

    worker: Worker
    rank_offset: int
    ranks: int
    sglang_version: str
    is_sim: bool

    @property
    def url(self) -> str:
        """The member engine's URL."""
        return self.worker.url


@dataclass(frozen=True)
class FleetGroup:
    """One named group the fleet joined, as the framework asked for it."""

    spec: InitGroup
    members: tuple[Member, ...]

    @property
    def name(self) -> str:
        """The group's name, as the framework gave it (``group_name``)."""
        return self.spec.group_name

    def to_json(self) -> dict[str, Any]:
        """What ``pdctl weights status`` shows of it (the push record's ``group``)."""
        return {
            "name": self.name,
            "world_size": self.spec.world_size,
            "backend": self.spec.backend,
            "ranks": {m.url: [m.rank_offset, m.rank_offset + m.ranks - 1] for m in self.members},
        }


def engine_ranks(worker: Worker, info: Mapping[str, Any]) -> int:
    """How many ranks ``worker`` takes in a weight group (its TP size), from its ``/server_info``;
    LayoutError for an engine SGLang cannot update that way (pp or dp > 1)."""

    def size(*keys: str) -> int:
        for key in keys:
            value = info.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return 1

    pp = size("pp_size", "pipeline_parallel_size")
    if pp > 1:
        raise LayoutError(
            f"engine {label(worker)} has pp_size {pp}: a fleet weight group gives each engine one rank per TP rank "
            "(SGLang's rank_offset + tp_rank); run engines that receive weights with pp_size 1"
        )
    dp = size("dp_size")
    if dp > 1:
        raise LayoutError(f"engine {label(worker)} has dp_size {dp}: {DP_REFUSED}; run one engine per replica")
    return size("tp_size", "tensor_parallel_size")


def layout(spec: InitGroup, workers: Iterable[Worker], infos: Mapping[str, Mapping[str, Any]]) -> tuple[Member, ...]:
    """Each engine's place in the group ``spec`` asks for; LayoutError when the world size does
    not fit this fleet (the message names the one that does)."""
    members: list[Member] = []
    offset = spec.rank_offset
    for worker in weight_order(workers):
        info = infos[worker.url]
        ranks = engine_ranks(worker, info)
        members.append(Member(worker, offset, ranks, str(info.get("version", "0")), info.get("engine") == "pdctl-sim"))
        offset += ranks
    if not members:
        raise LayoutError("the router has no engines to join a weight group")
    total = offset - spec.rank_offset
    if spec.rank_offset + total != spec.world_size:
        sizes = ", ".join(f"{m.worker.role} {m.url} tp {m.ranks}" for m in members)
        raise LayoutError(
            f"world_size {spec.world_size} does not fit this fleet: rank_offset {spec.rank_offset} + its "
            f"{total} engine ranks ({sizes}) need world_size {spec.rank_offset + total} "
            f"(for a framework that computes rank_offset = 1 + i*tp: one engine of tp {total}, "
            f"e.g. AReaL's allocation sglang:d1t{total})"
        )
    return tuple(members)


class GroupBook:
    """The weight groups the fleet has joined, by name, and those that can carry no more updates.

    A call that names no group (skyrl-train's one-parameter updates and its bodyless destroy,
    written for SGLang before named groups) means SGLang 0.5.x's default group when the fleet has
    one by that name, else the fleet's only group, as SGLang before named groups used its one group.
    """

    def __init__(self) -> None:
        self.groups: dict[str, FleetGroup] = {}
        self.broken: dict[str, str] = {}
        """Group name -> why it can no longer carry updates (an engine left it mid-update)."""

    def resolve(self, name: str | None) -> str:
        """The group a call means; LayoutError saying why when that cannot be told."""
        if name is not None:
            return name
        if DEFAULT_GROUP_NAME in self.groups or not self.groups:
            return DEFAULT_GROUP_NAME
        if len(self.groups) == 1:
            return next(iter(self.groups))
        raise LayoutError(
            f"the call names no group_name and the fleet has joined {len(self.groups)} groups "
            f"({', '.join(sorted(self.groups))}): name the one it is for"
        )

    def add(self, group: FleetGroup) -> None:
        """Record ``group`` as joined under its name (replacing one of that name), no longer broken."""
        self.groups[group.name] = group
        self.broken.pop(group.name, None)

    def pop(self, name: str) -> FleetGroup | None:
        """Forget the group ``name`` (and why it broke); the group, or None when it was not joined."""
        self.broken.pop(name, None)
        return self.groups.pop(name, None)

    def broke(self, name: str, why: str) -> None:
        """Mark the joined group ``name`` unable to carry updates, for ``why``; nothing for a group not joined."""
        if name in self.groups:
            self.broken[name] = why
