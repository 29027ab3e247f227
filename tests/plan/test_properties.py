"""Property tests: random valid topologies plan with invariants intact; random mutations of
valid files end in a useful error (TopologyError issues with messages and places) or a plan."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdctl.errors import PdctlError, TopologyError
from pdctl.plan import check_invariants, load_plan_text
from tests.conftest import TOPOLOGIES
from tests.helpers import topologies


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topologies())
def test_valid_topologies_plan_with_invariants(data) -> None:
    try:
        plan = load_plan_text(yaml.safe_dump(data)).plan
    except PdctlError:
        return  # over-committed draws are rejected cleanly; that path is the next test's
    check_invariants(plan, colocate=False)
    ports = {}
    for proc in plan.processes:
        for port in proc.owned_ports():
            assert (proc.node, port) not in ports
            ports[(proc.node, port)] = proc.id
            assert data["ports"]["base"] <= port <= 65535
    assert len({e.url for e in plan.engines}) == len(plan.engines)
    if plan.weight_group:
        assert plan.weight_group.world_size == 1 + sum(e.gpus for e in plan.engines)


EXAMPLES = [p.read_text() for p in TOPOLOGIES]
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 70000),
    st.text(max_size=12),
    st.lists(st.integers(-1, 3), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _set(node, path, value):
    if not path:
        return value
    node[path[0]] = _set(node[path[0]], path[1:], value)
    return node


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(EXAMPLES), st.data())
def test_mutations_never_escape_the_error_path(text, data) -> None:
    doc = yaml.safe_load(text)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        path = data.draw(st.sampled_from(paths))
        doc = _set(doc, path, data.draw(JUNK))
    outcome(yaml.safe_dump(doc))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(EXAMPLES), st.integers(0, 2000), st.text(max_size=4))
def test_text_corruption_never_escapes_the_error_path(text, at, junk) -> None:
    cut = at % (len(text) + 1)
    outcome(text[:cut] + junk + text[cut:])


def outcome(text: str) -> None:
    """Bad input is one of pdctl's errors, and a useful one: a TopologyError has at least one
    error, each issue a message and a place in the file (or the file as a whole, line 0);
    what loads plans with its invariants holding."""
    try:
        planned = load_plan_text(text, "f.yaml")
    except TopologyError as exc:
        errors = [i for i in exc.issues if i.severity == "error"]
        assert errors, exc.issues
        lines = len(text.splitlines()) + 1  # YAML places "end of stream" one line past the last
        for issue in exc.issues:
            assert issue.message.strip() and issue.severity in ("error", "warning")
            assert 0 <= issue.line <= lines, (issue, lines)
            assert issue.format("f.yaml").startswith("f.yaml:")
        return
    except PdctlError as exc:
        assert str(exc).strip()
        return
    check_invariants(planned.plan, colocate=planned.topology.placement.colocate)
