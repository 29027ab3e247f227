"""Limits that keep the topology loader safe on input made to hurt.

Topologies get shared between teams, and every path (``validate``, ``plan``, ``up``) reads
them, so any byte string must end quickly in a FILE:LINE:COL error. Three attacks are
bounded here, each before the step it would hurt:

- size and encoding (``decode``): at most MAX_BYTES; bytes that are not UTF-8 name the
  line and column of the first bad byte;
- nesting (``check_depth``): PyYAML composes recursively, so a file nested thousands deep
  would end in RecursionError; the token stream (scanned without recursion) is checked
  against MAX_DEPTH first;
- alias expansion (``check_expansion``): "billion laughs" aliases compose into a small
  graph that every later step (schema, walk) would expand; the expanded size is counted on
  the graph (linear time) against MAX_NODES, and an alias that contains itself is refused.
"""

from __future__ import annotations

import yaml

from pdctl.errors import Issue

MAX_BYTES = 256 * 1024
"""Six times a 1024-node topology (benchmarks/plan_scale.py writes 42 KB); 256 KiB of the
densest valid YAML validates in about 1.5 s on a slow 2-core machine (schema checks cost
per value, so the size bounds the time)."""
MAX_DEPTH = 64
"""Real topologies nest 5 deep (nodes[i].ssh.key)."""
MAX_NODES = 50_000
"""Values after alias expansion; 256 KiB without aliases holds at most about 40 000."""

_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class Loader(_BaseLoader):  # type: ignore[misc,valid-type]  # a base chosen at run time: not a static type
    """PyYAML's safe loader (libyaml's C parser when PyYAML has it: several times faster)
    whose constructors fail with a positioned YAMLError, not a bare Python one: PyYAML's
    own raise ValueError or AttributeError for values such as ``!!int x`` or ``!!timestamp ''``."""

    def construct_object(self, node: yaml.Node, deep: bool = False):
        """PyYAML's, except that a Python error from a constructor is raised as a ConstructorError
        at the node's position."""
        try:
            return super().construct_object(node, deep=deep)
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, AttributeError, OverflowError, KeyError, IndexError) as exc:
            problem = f"cannot read this {node.tag.rsplit(':', 1)[-1]} value ({type(exc).__name__}: {exc})"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from exc


def decode(data: bytes) -> tuple[str | None, Issue | None]:
    """The text of a topology file, or the issue that stops it being read as one."""
    if len(data) > MAX_BYTES:
        return None, Issue("", f"the file is {len(data)} bytes; a topology is at most {MAX_BYTES} bytes", 1, 1)
    try:
        return data.decode("utf-8-sig"), None
    except UnicodeDecodeError as exc:
        start = exc.start
        line = data.count(b"\n", 0, start) + 1
        line_start = data.rfind(b"\n", 0, start) + 1
        col = len(data[line_start:start].decode("utf-8", errors="replace")) + 1
        message = f"the file is not UTF-8: byte 0x{data[start]:02x} at offset {start} ({exc.reason})"
        return None, Issue("", message, line, col, hint="save the file as UTF-8")


def check_size(text: str) -> Issue | None:
    """For text that did not come through ``decode`` (an API caller's string)."""
    if len(text) > MAX_BYTES:
        return Issue("", f"the text is {len(text)} characters; a topology is at most {MAX_BYTES} bytes", 1, 1)
    return None


def check_depth(text: str) -> Issue | None:
    """An issue at the first collection nested deeper than MAX_DEPTH, else None.

    Syntax errors are left to the parser, which reports them with their position."""
    loader = Loader(text)
    depth = 0
    try:
        while (token := loader.get_token()) is not None:
            if isinstance(token, (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken,
                                  yaml.FlowMappingStartToken, yaml.FlowSequenceStartToken)):  # fmt: skip
                depth += 1
                if depth > MAX_DEPTH:
                    mark = token.start_mark
                    message = f"nesting deeper than {MAX_DEPTH} levels"
                    return Issue("", message, mark.line + 1, mark.column + 1)
            elif isinstance(token, (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)):
                depth -= 1
    except yaml.YAMLError:
        return None
    finally:
        loader.dispose()
    return None


def check_expansion(root: yaml.Node) -> Issue | None:
    """An issue when the composed graph expands to more than MAX_NODES values or an alias
    contains itself, else None. Iterative, and linear in the graph's size."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] > MAX_NODES:
                mark = node.start_mark
                message = f"aliases expand this to more than {MAX_NODES} values (a 'billion laughs' file?)"
                return Issue("", message, mark.line + 1, mark.column + 1)
            continue
        if key in sizes:
            continue
        if key in on_path:
            mark = node.start_mark
            return Issue("", "an alias refers to a collection that contains it", mark.line + 1, mark.column + 1)
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
    return None


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []
