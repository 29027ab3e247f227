"""Read a topology YAML with positions and check it against the JSON Schema.

Layer (a) of validation: shape, types, enums. Every problem becomes an ``Issue`` with a
dotted path and the line/column of the offending key or value, so the CLI can print
``FILE:LINE:COL: path: message``. yaml and jsonschema errors are converted here.
"""

from __future__ import annotations

import difflib
import itertools
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import jsonschema
import yaml

from pdctl.errors import Issue
from pdctl.topology.guard import Loader, check_depth, check_expansion, check_size

PathKey = str | int
Path = tuple[PathKey, ...]


@cache
def topology_schema() -> dict[str, Any]:
    """The topology JSON Schema (draft 2020-12), shipped as package data, with ``router``'s
    setting groups (``retry``, ``breaker``, ``admission``, ``health``, ``cache``) added from the
    router's own settings table (pdctl.router.config.SETTINGS): one definition, one set of defaults."""
    from pdctl.refit import DEFAULT_BUCKET_MB
    from pdctl.router.config import SETTINGS

    text = resources.files("pdctl").joinpath("schemas/topology.schema.json").read_text()
    schema = json.loads(text)
    schema["properties"]["weights"]["properties"]["bucket_mb"]["default"] = DEFAULT_BUCKET_MB
    router = schema["properties"]["router"]["properties"]
    kinds = {int: "integer", float: "number", bool: "boolean"}
    for setting in SETTINGS:
        group = router.setdefault(setting.group, {"type": "object", "additionalProperties": False, "properties": {}})
        group["properties"][setting.name] = {
            "type": kinds[setting.kind],
            "default": setting.default,
            "description": f"{setting.help} (pdctl router {setting.flag})",
        }
    return schema


@cache
def _validator() -> jsonschema.protocols.Validator:
    schema = topology_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def dotted(path: Path) -> str:
    """``("nodes", 1, "host")`` -> ``nodes[1].host``."""
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def parse_dotted(text: str) -> Path:
    """``nodes[1].host`` -> ``("nodes", 1, "host")``; inverse of ``dotted``."""
    out: list[PathKey] = []
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", text):
        out.append(int(part[1:-1]) if part.startswith("[") else part)
    return tuple(out)


@dataclass(frozen=True)
class SourceMap:
    """Maps data paths to 1-based (line, col) of their key (mappings) or value (lists)."""

    positions: dict[Path, tuple[int, int]]
    values: dict[Path, tuple[int, int, str | None]] = field(default_factory=dict)
    """Start of each scalar value, with its quote style (None = plain)."""

    def locate(self, path: Path) -> tuple[int, int]:
        """Position of ``path``, or of its deepest existing ancestor; (0, 0) if none."""
        for cut in range(len(path), -1, -1):
            pos = self.positions.get(tuple(path[:cut]))
            if pos:
                return pos
        return (0, 0)

    def attach(self, issue: Issue) -> Issue:
        """``issue`` with line/col filled in from its dotted path (if it has none)."""
        if issue.line:
            return issue
        line, col = self.locate(parse_dotted(issue.path))
        return Issue(issue.path, issue.message, line, col, issue.severity, issue.hint)

    def issue(self, path: Path, message: str, *, hint: str = "", severity: str = "error") -> Issue:
        """An Issue at ``path``, positioned at it or at its deepest ancestor found in the file."""
        line, col = self.locate(path)
        return Issue(path=dotted(path), message=message, line=line, col=col, hint=hint, severity=severity)


def parse_yaml(text: str) -> tuple[Any, SourceMap, list[Issue]]:
    """Parse YAML text into plain data plus a SourceMap. Syntax errors become Issues.

    Duplicate mapping keys, which PyYAML silently overwrites, are reported as errors.
    """
    guard_issue = check_size(text) or check_depth(text)
    if guard_issue:
        return None, SourceMap({}, {}), [guard_issue]
    try:
        loader = Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None, SourceMap({}, {}), [Issue("", "the file is empty", 1, 1)]
            guard_issue = check_expansion(node)  # before anything walks the expanded tree
            if guard_issue:
                return None, SourceMap({}, {}), [guard_issue]
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
        kind = "syntax error" if isinstance(exc, (yaml.scanner.ScannerError, yaml.parser.ParserError)) else "error"
        message = f"YAML {kind}: {exc.problem or exc}"
        return None, SourceMap({}, {}), [Issue("", message, line, col)]
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (NUL, other controls)
        line, col = _line_col(text, exc.position)
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        message = f"YAML does not allow the character U+{char:04X} here"
        return None, SourceMap({}, {}), [Issue("", message, line, col)]
    except yaml.YAMLError as exc:
        return None, SourceMap({}, {}), [Issue("", f"YAML error: {exc}", 1, 1)]
    positions: dict[Path, tuple[int, int]] = {(): (node.start_mark.line + 1, node.start_mark.column + 1)}
    issues: list[Issue] = []
    values: dict[Path, tuple[int, int, str | None]] = {}
    for path, mark_node, value_node, duplicate in _walk(node, ()):
        pos = (mark_node.start_mark.line + 1, mark_node.start_mark.column + 1)
        if duplicate:
            issues.append(Issue(dotted(path), "duplicate key (YAML keeps only the last one)", *pos))
        positions.setdefault(path, pos)
        if isinstance(value_node, yaml.ScalarNode):
            mark = value_node.start_mark
            values.setdefault(path, (mark.line + 1, mark.column + 1, value_node.style))
    return data, SourceMap(positions, values), issues


def _line_col(text: str, index: int) -> tuple[int, int]:
    """1-based line and column of character ``index`` of ``text``."""
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


def _walk(node: yaml.Node, path: Path) -> Iterator[tuple[Path, yaml.Node, yaml.Node, bool]]:
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
            child = (*path, key)
            yield child, key_node, value_node, key in seen
            seen.add(key)
            yield from _walk(value_node, child)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = (*path, index)
            yield child, item, item, False
            yield from _walk(item, child)


MAX_SCHEMA_ERRORS = 100
"""More are not computed (a file of 40 000 wrong entries would take seconds) nor read."""


def check_schema(data: Any, source: SourceMap) -> list[Issue]:
    """The JSON Schema violations in ``data`` (at most MAX_SCHEMA_ERRORS, then one line that
    says there are more) as Issues, sorted by position."""
    errors = list(itertools.islice(_validator().iter_errors(data), MAX_SCHEMA_ERRORS + 1))
    issues = [issue for err in errors[:MAX_SCHEMA_ERRORS] for issue in _to_issues(err, source)]
    issues.sort(key=lambda i: (i.line, i.col, i.path))
    if len(errors) > MAX_SCHEMA_ERRORS:
        first_unshown = _to_issues(errors[-1], source)
        line, col = (first_unshown[0].line, first_unshown[0].col) if first_unshown else (1, 1)
        message = f"more schema errors from here on (only the first {MAX_SCHEMA_ERRORS} are shown); fix these first"
        issues.append(Issue("", message, line or 1, col or 1))
    return issues


def _to_issues(error: jsonschema.ValidationError, source: SourceMap) -> list[Issue]:
    if error.context:
        # oneOf/anyOf: report the errors of the branches whose type matched the value (a
        # mapping where a mapping or a list is allowed), not "is not valid under any of ...".
        inner = [e for e in error.context if not (e.validator == "type" and not e.relative_path)]
        wrong_type = [e for e in error.context if e.validator == "type" and not e.relative_path]
        if inner:
            return [issue for e in inner for issue in _to_issues(e, source)]
        if wrong_type:
            allowed = " or ".join(sorted({str(e.validator_value) for e in wrong_type} | _enum_values(error)))
            return [source.issue(tuple(error.absolute_path), f"{error.instance!r} must be {allowed}")]
    return [_to_issue(error, source)]


def _enum_values(error: jsonschema.ValidationError) -> set[str]:
    return {", ".join(map(repr, _listed(e.validator_value))) for e in error.context or () if e.validator == "enum"}


def _listed(value: object) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else []


def _schema_of(error: jsonschema.ValidationError) -> Mapping[str, Any]:
    """The schema the error is about (the stubs allow a bool schema, which has no keys)."""
    return error.schema if isinstance(error.schema, Mapping) else {}


def _to_issue(error: jsonschema.ValidationError, source: SourceMap) -> Issue:
    path: Path = tuple(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = set(_schema_of(error).get("properties", {}))
        extra = [k for k in error.instance if k not in allowed]
        key = extra[0] if extra else "?"
        match = difflib.get_close_matches(str(key), sorted(allowed), n=1)
        hint = f"did you mean {match[0]!r}?" if match else "allowed: " + ", ".join(sorted(allowed))
        return source.issue((*path, key), f"unknown key {key!r}", hint=hint)
    if error.validator == "required":
        return source.issue(path, error.message, hint="add it; see `pdctl schema`")
    if error.validator == "pattern":
        hint = _schema_of(error).get("description") or f"must match {error.validator_value}"
        return source.issue(path, f"{error.instance!r} is not a safe name", hint=hint)
    if error.validator == "enum":
        choices = [_yaml_word(c) for c in _listed(error.validator_value)]
        match = difflib.get_close_matches(str(error.instance), choices, n=1)
        hint = f"did you mean {match[0]!r}?" if match else ""
        return source.issue(path, f"{error.instance!r} is not one of: {', '.join(choices)}", hint=hint)
    return source.issue(path, error.message)


def _yaml_word(value: object) -> str:
    """An enum choice as the topology's YAML spells it (null, true, false; a string bare)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
