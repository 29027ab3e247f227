"""load_topology: YAML -> schema -> frozen dataclasses -> allocation DSL -> semantic checks.

All issues of all layers are collected, given file positions, and raised together as one
TopologyError. Warnings are returned beside the topology. Whether the topology also fits its
nodes (GPUs, ports) is the planner's question: ``pdctl.plan.load_plan`` asks both.
"""

from __future__ import annotations

from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from pdctl.errors import AllocationError, Issue, PdctlError, TopologyError
from pdctl.roles import Role
from pdctl.topology.alloc import Allocation, Dims, parse_allocation
from pdctl.topology.guard import MAX_BYTES, decode
from pdctl.topology.model import PlacementMode, ServerGroup, Topology
from pdctl.topology.schema import SourceMap, check_schema, parse_yaml
from pdctl.topology.validate import validate

DEFAULT_TOPOLOGY = "local-sim.yaml"


def default_topology_text() -> str:
    """The embedded default: the CPU sim engine on localhost, one prefill and one decode."""
    return resources.files("pdctl").joinpath("topologies").joinpath(DEFAULT_TOPOLOGY).read_text()


def read_topology_file(path: str | Path) -> str:
    """The file's text. Raises PdctlError when it cannot be read, TopologyError (at the
    offending line and column) when it is too large or not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # never more than the limit, whatever the file's size
    except OSError as exc:
        raise PdctlError(f"cannot read topology {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_BYTES:
        issue = Issue("", f"the file is larger than {MAX_BYTES} bytes, the most a topology may be", 1, 1)
        raise TopologyError(str(path), [issue])
    text, problem = decode(data)
    if problem:
        raise TopologyError(str(path), [problem])
    assert text is not None
    return text


def load_topology(path: str | Path) -> tuple[Topology, list[Issue]]:
    """Load and fully validate a topology file. Returns (topology, warnings).

    Raises:
        PdctlError: the file cannot be read.
        TopologyError: anything is invalid; ``issues`` lists every problem with positions.
    """
    return load_topology_text(read_topology_file(path), str(path))


def load_topology_text(text: str, filename: str = "<topology>") -> tuple[Topology, list[Issue]]:
    """Like load_topology, from text."""
    top, warnings, _ = parse_topology(text, filename)
    return top, warnings


def parse_topology(text: str, filename: str = "<topology>") -> tuple[Topology, list[Issue], SourceMap]:
    """Like load_topology_text, and the source map that gives later issues (the planner's) positions."""
    data, source, issues = parse_yaml(text)
    if data is not None and not isinstance(data, dict):
        issues.append(Issue("", "a topology is a mapping (name:, model:, nodes:, ...)", 1, 1))
    if issues:
        raise TopologyError(filename, issues)
    issues = check_schema(data, source)
    if issues:
        raise TopologyError(filename, issues)
    top = Topology.from_dict(data)
    if top.allocation is not None:
        top, alloc_issues = _apply_allocation(top, data, source)
        issues += alloc_issues
    if not any(i.severity == "error" for i in issues):
        issues += validate(top)
    issues = sorted((source.attach(i) for i in issues), key=lambda i: (i.line, i.col, i.path))
    if any(i.severity == "error" for i in issues):
        raise TopologyError(filename, issues)
    return top, issues, source


def _apply_allocation(top: Topology, data: dict[str, Any], source: SourceMap) -> tuple[Topology, list[Issue]]:
    assert top.allocation is not None
    try:
        alloc = parse_allocation(top.allocation)
    except AllocationError as exc:
        return top, [_allocation_issue(exc, source)]
    issues: list[Issue] = []
    groups: list[ServerGroup] = []
    train_world: int | None = None
    for comp in alloc.components:
        if comp.is_inference:
            if comp.backend != "sglang":
                issues.append(Issue("allocation", f"pdctl launches SGLang engines; {comp.backend!r} is not supported"))
                continue
            assert isinstance(comp.dims, Dims)
            role = Role(comp.pd_role) if comp.pd_role else Role.REGULAR
            groups.append(
                ServerGroup(
                    name=comp.name or role.value,
                    role=role,
                    replicas=comp.dims.d,
                    tp=comp.dims.t,
                    pp=comp.dims.p,
                    path="allocation",
                )
            )
        elif train_world is not None:
            issues.append(Issue("allocation", "pdctl runs one trainer; the allocation has two training components"))
        else:
            train_world = comp.world_size
    colocated = any(len(pool) > 1 for pool in alloc.pools)
    if issues:
        return top, issues
    if top.groups:
        issues += _compare_groups(top.groups, groups)
    else:
        top = replace(top, groups=tuple(sorted(groups, key=_role_order)))
    top, trainer_issues = _apply_trainer(top, train_world, alloc)
    issues += trainer_issues
    if colocated:
        if "placement" in data and not top.placement.colocate:
            issues.append(Issue("placement", "allocation colocates components with '|' but placement is separate"))
        elif not top.placement.colocate:
            top = replace(top, placement=replace(top.placement, mode=PlacementMode.COLOCATE))
    elif top.placement.colocate:
        issues.append(
            Issue(
                "allocation",
                "placement is colocate but the allocation separates pools with '+'",
                hint="write 'sglang[...]:... | fsdp[trainer]:...' to colocate",
            )
        )
    return top, issues


def _role_order(group: ServerGroup) -> int:
    return [Role.PREFILL, Role.DECODE, Role.REGULAR].index(group.role)


def _compare_groups(explicit: tuple[ServerGroup, ...], dsl: list[ServerGroup]) -> list[Issue]:
    issues = []
    by_name = {g.name: g for g in explicit}
    for g in dsl:
        mine = by_name.pop(g.name, None)
        if mine is None:
            issues.append(
                Issue(
                    "allocation",
                    f"allocation names group {g.name!r} that the file does not define",
                    hint="add it, or rename the group to match",
                )
            )
            continue
        if mine.role is not g.role:
            issues.append(Issue(f"{mine.path}", f"group {g.name!r} is {mine.role} here but {g.role} in allocation"))
        for field, letter in (("replicas", "d"), ("tp", "t"), ("pp", "p")):
            if getattr(mine, field) != getattr(g, field):
                issues.append(
                    Issue(
                        f"{mine.path}.{field}",
                        f"{field} {getattr(mine, field)} disagrees with allocation "
                        f"({letter}{getattr(g, field)} for {g.name!r})",
                        hint="make them agree or drop one",
                    )
                )
    for name, g in by_name.items():
        issues.append(Issue(g.path, f"group {name!r} is missing from allocation", hint="add it to allocation"))
    return issues


def _apply_trainer(top: Topology, world: int | None, alloc: Allocation) -> tuple[Topology, list[Issue]]:
    if world is None:
        return top, []
    if top.trainer is None:
        return top, [
            Issue(
                "allocation",
                f"allocation has a training component of {world} GPUs but there is no trainer section",
                hint="add trainer: {command: [python, train.py]}",
            )
        ]
    nodes = top.trainer.nodes or (top.nodes[-1].name,)
    if top.trainer.nproc_per_node is not None:
        have = top.trainer.nproc_per_node * len(nodes)
        if have != world:
            return top, [
                Issue(
                    "trainer.nproc_per_node",
                    f"trainer world size {have} (nproc_per_node x nodes) disagrees with allocation ({world})",
                )
            ]
        return top, []
    if world % len(nodes):
        return top, [
            Issue("trainer.nodes", f"allocation's trainer world size {world} does not divide over {len(nodes)} node(s)")
        ]
    trainer = replace(top.trainer, nproc_per_node=world // len(nodes))
    return replace(top, trainer=trainer), []


def _allocation_issue(exc: AllocationError, source: SourceMap) -> Issue:
    line, col = source.locate(("allocation",))
    value = source.values.get(("allocation",))
    if value and exc.col and "\n" not in exc.text:
        line, col, style = value
        col += exc.col - 1 + (1 if style in ("'", '"') else 0)
    message = exc.reason.split("\nHints:")[0]
    hint = "write components like sglang[prefill]:d2t2 + sglang[decode]:d1t4" if "Hints" in exc.reason else ""
    where = f" (column {exc.col} of the allocation string)" if exc.col else ""
    return Issue("allocation", message + where, line, col, hint=hint)
