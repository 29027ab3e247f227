"""GPU placement: which GPUs of which nodes each engine and the trainer get. Pure.

Engines take whole GPUs, first fit in declaration order (or on their pinned nodes). An
engine of ``tp*pp*dp`` GPUs fits in one node as a contiguous block (SGLang addresses GPUs
as ``--base-gpu-id + i``), or spans whole nodes (then one server process per node).
Failures are Issues that name the groups holding the GPUs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from pdctl.errors import Issue
from pdctl.topology.model import Node, ServerGroup, Topology, TrainerConfig


@dataclass(frozen=True)
class EnginePlacement:
    """One engine: ``slices`` is one (node, gpu_ids) per node rank, node rank 0 first."""

    group: ServerGroup
    index: int
    slices: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def engine_id(self) -> str:
        """The engine's id: its group's name and its index in the group (``decode-0``)."""
        return f"{self.group.name}-{self.index}"


@dataclass(frozen=True)
class GpuLayout:
    """Where every engine and the trainer run: each engine's placement, in declaration order, and the
    trainer's GPUs."""

    engines: tuple[EnginePlacement, ...]
    trainer: tuple[tuple[str, tuple[int, ...]], ...]
    """(node, gpu_ids) per trainer node, node rank order."""


class _Pool:
    """Free GPUs per node plus who took what, for messages."""

    def __init__(self, nodes: tuple[Node, ...]):
        self.nodes = {n.name: n for n in nodes}
        self.free = {n.name: [True] * n.gpus for n in nodes}
        self.free_count = {n.name: n.gpus for n in nodes}
        self.users: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def take_block(self, node: str, count: int, user: str) -> tuple[int, ...] | None:
        if self.free_count[node] < count:
            return None
        free = self.free[node]
        run = 0
        for i, ok in enumerate(free):
            run = run + 1 if ok else 0
            if run == count:
                ids = tuple(range(i - count + 1, i + 1))
                for g in ids:
                    free[g] = False
                self.free_count[node] -= count
                self.users[node][user] += count
                return ids
        return None

    def take_exact(self, node: str, ids: tuple[int, ...], user: str) -> None:
        for g in ids:
            self.free[node][g] = False
        self.free_count[node] -= len(ids)
        self.users[node][user] += len(ids)

    def take_any(self, node: str, count: int, user: str) -> tuple[int, ...] | None:
        ids = tuple(i for i, ok in enumerate(self.free[node]) if ok)[:count]
        if len(ids) < count:
            return None
        for g in ids:
            self.free[node][g] = False
        self.free_count[node] -= count
        self.users[node][user] += count
        return ids

    def fully_free(self, node: str) -> bool:
        return self.free_count[node] == len(self.free[node]) > 0

    def describe(self, names: list[str]) -> str:
        parts = []
        for name in names:
            used = ", ".join(f"{u} {n}" for u, n in self.users[name].items()) or "nothing"
            parts.append(f"{name}: {sum(self.free[name])}/{len(self.free[name])} free (taken by {used})")
        return "; ".join(parts)


Slices = tuple[tuple[str, tuple[int, ...]], ...]
"""(node, gpu_ids) per node rank."""


def place_gpus(top: Topology, keep: Mapping[str, Slices] | None = None) -> tuple[GpuLayout | None, list[Issue]]:
    """Place every engine, then the trainer. Returns (layout, []) or (None, issues).

    ``keep`` (``pdctl apply``): the GPUs of running engines (by engine id) and of a running
    trainer (``"trainer"``): each keeps them when the new topology still has it with as many
    GPUs there, before anything new is placed first fit, so that an edit moves no engine that
    it did not change (and an engine that switches role keeps its GPUs under its new id)."""
    pool = _Pool(top.nodes)
    kept = _reserve_kept(top, pool, keep or {})
    engines: list[EnginePlacement] = []
    issues: list[Issue] = []
    for group in top.groups:
        candidates = list(group.nodes) if group.nodes else [n.name for n in top.nodes]
        biggest = max(pool.nodes[c].gpus for c in candidates)
        for index in range(group.replicas):
            if (group.name, index) in kept:
                engines.append(EnginePlacement(group, index, kept[(group.name, index)]))
                continue
            # First fit: skip the leading nodes that are already full (keeps 1024 nodes fast).
            while len(candidates) > 1 and pool.free_count[candidates[0]] == 0:
                candidates = candidates[1:]
            placement, issue = _place_engine(pool, group, index, candidates, biggest)
            if issue:
                issues.append(issue)
                break
            engines.append(placement)
    if issues:
        return None, issues
    trainer_kept = kept.get(("trainer", 0))
    if trainer_kept is not None:
        return GpuLayout(tuple(engines), trainer_kept), []
    trainer, trainer_issues = _place_trainer(top, pool, engines)
    if trainer_issues:
        return None, trainer_issues
    return GpuLayout(tuple(engines), trainer), []


def _reserve_kept(top: Topology, pool: _Pool, keep: Mapping[str, Slices]) -> dict[tuple[str, int], Slices]:
    """Take the kept GPUs of engines (and the trainer) that ``top`` still has with the same GPU
    count, on nodes it still has, where they are free; the rest is placed as new."""
    out: dict[tuple[str, int], Slices] = {}
    wanted = [(g.name, i, g.gpus_per_engine, f"{g.name}-{i}", g.nodes) for g in top.groups for i in range(g.replicas)]
    trainer = top.trainer
    if trainer is not None and not top.placement.colocate and "trainer" in keep:
        wanted.append(("trainer", 0, sum(len(ids) for _, ids in keep["trainer"]), "trainer", trainer.nodes))
    for name, index, size, key, pinned in wanted:
        slices = keep.get(key)
        if not slices or sum(len(ids) for _, ids in slices) != size:
            continue
        if pinned and any(node not in pinned for node, _ in slices):
            continue
        if not all(node in pool.free and all(0 <= g < len(pool.free[node]) and pool.free[node][g] for g in ids)
                   for node, ids in slices):  # fmt: skip
            continue
        for node, ids in slices:
            pool.take_exact(node, ids, name)
        out[(name, index)] = tuple(slices)
    return out


def _place_engine(
    pool: _Pool, group: ServerGroup, index: int, candidates: list[str], biggest: int
) -> tuple[EnginePlacement, Issue | None]:
    size = group.gpus_per_engine
    label = f"{group.name}-{index}"
    where = group.path or group.role.value
    if size <= biggest:
        for node in candidates:
            ids = pool.take_block(node, size, group.name)
            if ids is not None:
                return EnginePlacement(group, index, ((node, ids),)), None
        msg = (
            f"no room for engine {label} ({size} GPUs = tp {group.tp} x pp {group.pp} x dp {group.dp}): "
            + pool.describe(candidates)
        )
        return _dummy(group, index), Issue(where, msg, hint="add nodes or GPUs, or lower replicas/tp")
    # Larger than any node: whole nodes, one server process per node.
    if any(size % pool.nodes[c].gpus for c in candidates if pool.nodes[c].gpus):
        msg = (
            f"engine {label} needs {size} GPUs, more than a node has ({biggest}); an engine that spans "
            f"nodes must take whole nodes, so tp x pp x dp must be a multiple of the GPUs per node"
        )
        return _dummy(group, index), Issue(f"{where}.tp", msg, hint=f"use tp {biggest} or a multiple of it")
    slices: list[tuple[str, tuple[int, ...]]] = []
    got = 0
    for node in candidates:
        if got == size:
            break
        if pool.fully_free(node):
            slices.append((node, tuple(range(pool.nodes[node].gpus))))
            got += pool.nodes[node].gpus
    if got != size:
        msg = f"engine {label} needs {size} GPUs on whole free nodes: " + pool.describe(candidates)
        return _dummy(group, index), Issue(where, msg, hint="add nodes, or pin groups to other nodes")
    for node, ids in slices:
        pool.take_any(node, len(ids), group.name)
    return EnginePlacement(group, index, tuple(slices)), None


def _dummy(group: ServerGroup, index: int) -> EnginePlacement:
    return EnginePlacement(group, index, ())


def _pair_trainer(
    trainer: TrainerConfig, engines: list[EnginePlacement]
) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], list[Issue]]:
    """Colocate: trainer rank i on engine GPU i (TorchSpec's pairing), in engine order: engine
    TP rank j of the engine with weight-group rank offset o shares its GPU with trainer rank
    o - 1 + j. torchrun starts the same number of ranks on every node, so every node must
    hold as many engine GPUs, and the trainer's nodes are the engines' nodes in that order."""
    per_node: dict[str, list[int]] = {}
    for eng in engines:
        for node, ids in eng.slices:
            per_node.setdefault(node, []).extend(ids)
    counts = {node: len(ids) for node, ids in per_node.items()}
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{n}: {c}" for n, c in counts.items())
        return (), [
            Issue(
                "placement.mode",
                f"colocate pairs trainer rank i with engine GPU i, and torchrun starts the same number of ranks "
                f"on every node, but the engines use different GPU counts per node ({shown})",
                hint="give every node the same number of engine GPUs",
            )
        ]
    issues = []
    if trainer.nodes is not None and list(trainer.nodes) != list(per_node):
        issues.append(
            Issue(
                "trainer.nodes",
                f"colocate runs trainer ranks on the engines' nodes in engine order ({', '.join(per_node)}), "
                f"not {', '.join(trainer.nodes)}",
                hint="leave trainer.nodes out, or list the engines' nodes in that order",
            )
        )
    per = next(iter(counts.values()), 0)
    if trainer.nproc_per_node is not None and trainer.nproc_per_node != per:
        issues.append(
            Issue(
                "trainer.nproc_per_node",
                f"colocate pairs one trainer rank with one engine GPU: nproc_per_node {trainer.nproc_per_node} "
                f"!= {per} engine GPUs per node",
            )
        )
    if issues:
        return (), issues
    return tuple((n, tuple(ids)) for n, ids in per_node.items()), []


def _place_trainer(
    top: Topology, pool: _Pool, engines: list[EnginePlacement]
) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], list[Issue]]:
    trainer = top.trainer
    if trainer is None:
        return (), []
    if top.placement.colocate:
        return _pair_trainer(trainer, engines)
    nodes = list(trainer.nodes) if trainer.nodes else [top.nodes[-1].name]
    out: list[tuple[str, tuple[int, ...]]] = []
    for rank, node in enumerate(nodes):
        count = trainer.nproc_per_node or pool.nodes[node].gpus
        ids = pool.take_any(node, count, "trainer")
        if ids is None:
            msg = f"trainer needs {count} GPUs on node {node}: " + pool.describe([node])
            path = f"trainer.nodes[{rank}]" if trainer.nodes else "trainer"
            return (), [Issue(path, msg, hint="move the trainer to other nodes or lower nproc_per_node")]
        out.append((node, ids))
    return tuple(out), []
