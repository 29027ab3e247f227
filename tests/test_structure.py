"""The shape of the code: no import circles among pdctl's modules; no unbounded wait in its tests.

Every import counts: at module level, inside functions and under ``if TYPE_CHECKING`` (a
circle hidden from the interpreter is still two modules that cannot be read, tested or
changed apart). Importing ``a.b.c`` counts as importing ``a.b`` too (its ``__init__`` runs
first), except where the importer lives inside ``a.b`` itself, which Python has already
started importing.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pdctl"


def module_names() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_package)
    return mods


def import_graph() -> dict[str, set[str]]:
    mods = module_names()
    graph: dict[str, set[str]] = {m: set() for m in mods}

    def add(importer: str, target: str) -> None:
        parts = target.split(".")
        own = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
        for i in range(2, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in mods and name != importer and name not in own:
                graph[importer].add(name)

    for name, (path, is_package) in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("pdctl"):
                        add(name, alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("pdctl"):
                    add(name, target)
                    for alias in node.names:  # from pkg import submodule
                        add(name, f"{target}.{alias.name}")
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    graph = import_graph()
    assert len(graph) > 50 and "pdctl.plan" in graph["pdctl.cli.topology_cmds"]  # the scan sees imports
    assert circles(graph) == []


def error_classes() -> dict[str, str]:
    """Every class under PdctlError in pdctl's source (read, not imported): name -> its base."""
    bases: dict[str, str] = {}
    for path, _ in module_names().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.bases:
                base = node.bases[0]
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
                bases[node.name] = name
    out: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for cls, parent in bases.items():
            if cls not in out and (parent == "PdctlError" or parent in out):
                out[cls] = parent
                changed = True
    return out


def drawn_tree() -> dict[str, str]:
    """The error tree drawn in pdctl/errors.py's docstring: name -> its parent."""
    import pdctl.errors

    doc = pdctl.errors.__doc__ or ""
    lines = doc[doc.index("    PdctlError") :].split("\n\n")[0].splitlines()
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in lines:
        start = next(i for i, ch in enumerate(line) if ch.isalpha())
        name = line[start:].split()[0]
        while stack and stack[-1][0] >= start:
            stack.pop()
        if stack:
            parents[name] = stack[-1][1]
        stack.append((start, name))
    return parents


def test_the_drawn_error_tree_is_the_real_one() -> None:
    real, drawn = error_classes(), drawn_tree()
    assert drawn == real, f"drawn but not real: {set(drawn.items()) - set(real.items())}; " + (
        f"real but not drawn: {set(real.items()) - set(drawn.items())}"
    )


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_request_path_never_reaches_the_http_server() -> None:
    """The dispatcher returns a reply and the server writes it (issue 30): nothing under dispatch
    imports the server, so that the request path is tested without one."""
    graph = import_graph()
    for module in ("pdctl.router.dispatch", "pdctl.router.legs", "pdctl.router.retry", "pdctl.router.shaping"):
        assert "pdctl.router.server" not in reachable(graph, module), module
    assert "pdctl.router.server" in reachable(graph, "pdctl.router.app")  # the check can see an import


def test_the_node_side_never_reaches_the_control_plane_or_the_router() -> None:
    """What runs on a node (pdctl.node) needs nothing of the control plane or the router: a node
    runs it without their imports, and neither half can lean on the other's internals."""
    graph = import_graph()
    rooms = ("pdctl.cluster", "pdctl.plan", "pdctl.topology", "pdctl.router", "pdctl.cli", "pdctl.role_planner")
    for module in (m for m in graph if m.startswith("pdctl.node")):
        foreign = sorted(m for m in reachable(graph, module) if m.startswith(rooms))
        assert not foreign, (module, foreign)
    assert "pdctl.node.supervise" in reachable(graph, "pdctl.node.agent")  # the check can see an import


def _members(cls: ast.ClassDef) -> tuple[set[str], set[str]]:
    """A class's declared names, and those of them that are data (fields, class attributes,
    properties, ``__slots__`` entries and attributes ``__init__`` sets), dunders aside."""
    names: set[str] = set()
    data: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
            if any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list):
                data.add(node.name)
            if node.name == "__init__":
                for sub in ast.walk(node):
                    if not (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)):
                        continue
                    if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        data.add(sub.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            data.add(node.target.id)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if not isinstance(target, ast.Name):
                    continue
                if target.id == "__slots__" and isinstance(node.value, ast.Tuple):
                    data |= {
                        e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
                    }
                else:
                    data.add(target.id)
    names |= data
    return {n for n in names if not n.startswith("__")}, {n for n in data if not n.startswith("__")}


def restated_classes() -> list[str]:
    """Protocols that restate one class of a module that imports them (issue 51): a Protocol with
    data (not a port of callbacks that a lower layer calls, such as ``StreamSink``) that exactly
    one class in pdctl has all the names of, that class's module reaching the Protocol's. Such a
    Protocol is an import the design wanted and dodged: the two modules are one circle."""
    graph = import_graph()
    protocols: list[tuple[str, ast.ClassDef]] = []
    classes: list[tuple[str, ast.ClassDef]] = []
    for name, (path, _) in module_names().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                is_protocol = any(isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases)
                (protocols if is_protocol else classes).append((name, node))
    found = []
    for module, protocol in protocols:
        wanted, data = _members(protocol)
        if not data:
            continue
        having = [(m, c.name) for m, c in classes if wanted <= _members(c)[0]]
        if len(having) == 1 and module in reachable(graph, having[0][0]):
            found.append(f"{module}.{protocol.name} restates {having[0][0]}.{having[0][1]}")
    return found


def test_the_restated_class_finder_finds_one(tmp_path: Path) -> None:
    """The check sees the trick it forbids: relay.py's Protocols before issue 51 restated the
    dispatcher (which imports the relay) and the request it made."""
    global PACKAGE
    package = tmp_path / "pdctl"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "relay.py").write_text(
        "from typing import Protocol\n"
        "class Continuer(Protocol):\n    registry: object\n    def tail(self, request): ...\n"
        "class Reader(Protocol):\n    def block(self, block): ...\n"
    )
    (package / "dispatch.py").write_text(
        "from pdctl.relay import Continuer\n"
        "class Dispatcher:\n    def __init__(self):\n        self.registry = None\n"
        "    def tail(self, request): ...\n    def block(self, block): ...\n"
    )
    saved, PACKAGE = PACKAGE, package
    try:
        assert restated_classes() == ["pdctl.relay.Continuer restates pdctl.dispatch.Dispatcher"]
    finally:
        PACKAGE = saved


def test_no_protocol_restates_a_class_to_dodge_an_import() -> None:
    assert restated_classes() == []


def test_the_architecture_doc_names_every_router_module_and_no_other() -> None:
    """docs/architecture.md's router rooms stay true: each module of pdctl/router (each
    subpackage as a folder) is named there, and each module it names exists."""
    import re

    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    router_part = doc[doc.index("## The router") :]
    router = PACKAGE / "router"
    modules = {p.name for p in router.glob("*.py") if p.name != "__init__.py"}
    packages = {f"{p.name}/" for p in router.iterdir() if (p / "__init__.py").exists()}
    named = set(re.findall(r"`([\w/]+(?:\.py|/))`", router_part))
    missing = sorted((modules | packages) - named)
    assert not missing, f"router modules with no room in docs/architecture.md: {missing}"
    nested = list(router.glob("*/*.py"))
    existing = modules | packages | {p.name for p in nested} | {str(p.relative_to(router)) for p in nested}
    stale = sorted(n for n in named if n.endswith(".py") and n not in existing and not n.startswith("pdctl/"))
    assert not stale, f"docs/architecture.md names router modules that do not exist: {stale}"


def unbounded_polls(source: str) -> list[int]:
    """The lines of ``while`` loops that sleep between polls (a sleep in the loop's own body)
    with no bound of their own in sight (a deadline, a clock, a count): waits that a regression
    would turn into a hang until the suite's timeout. ``tests.helpers.eventually`` (and
    ``eventually_async``) is the bounded way."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.While):
            loop = ast.get_source_segment(source, node) or ""
            polls = any(
                "sleep(" in (ast.get_source_segment(source, s) or "") for s in node.body if isinstance(s, ast.Expr)
            )
            if polls and not any(b in loop for b in ("deadline", "monotonic", "range(", "timeout")):
                lines.append(node.lineno)
    return lines


def test_the_poll_finder_finds_an_unbounded_one() -> None:
    assert unbounded_polls("while not done():\n    time.sleep(0.1)\n") == [1]
    assert unbounded_polls("while not done():\n    assert time.monotonic() < deadline\n    time.sleep(0.1)\n") == []


def test_every_wait_in_the_tests_is_bounded() -> None:
    tests = Path(__file__).resolve().parent
    found = {
        f"{path.relative_to(tests.parent)}:{line}"
        for path in tests.rglob("*.py")
        for line in unbounded_polls(path.read_text())
    }
    assert not found, f"poll loops with no bound (use tests.helpers.eventually): {sorted(found)}"
