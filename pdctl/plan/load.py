"""load_plan: a topology file checked by itself and then planned, every issue at its line.

The topology package checks the file (schema, references, pairing rules); whether it fits its
nodes (GPUs, ports) is known only once it is planned. Both kinds of issue come back together,
with positions, from here: the one place that needs both (validate, plan, up).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdctl.errors import Issue, TopologyError
from pdctl.plan.model import Plan
from pdctl.plan.planner import make_plan
from pdctl.topology.load import parse_topology, read_topology_file
from pdctl.topology.model import Topology


@dataclass(frozen=True)
class Planned:
    """A topology file that checked and planned cleanly: the topology, its plan, and the warnings of
    both steps."""

    topology: Topology
    plan: Plan
    warnings: list[Issue]


def load_plan(path: str | Path) -> Planned:
    """Load, validate and plan a topology file.

    Raises:
        PdctlError: the file cannot be read.
        TopologyError: anything is invalid or does not fit; ``issues`` lists every problem with positions.
    """
    return load_plan_text(read_topology_file(path), str(path))


def load_plan_text(text: str, filename: str = "<topology>") -> Planned:
    """Like load_plan, from text."""
    top, warnings, source = parse_topology(text, filename)
    try:
        plan = make_plan(top)
    except TopologyError as exc:
        issues = warnings + [source.attach(i) for i in exc.issues]
        raise TopologyError(filename, sorted(issues, key=_position)) from None
    warnings = sorted(warnings + [source.attach(i) for i in plan.warnings], key=_position)
    return Planned(top, plan, warnings)


def _position(issue: Issue) -> tuple[int, int, str]:
    return issue.line, issue.col, issue.path
