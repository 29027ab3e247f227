"""Input made to hurt: every byte string given to `pdctl validate` ends quickly with exit 1
and FILE:LINE:COL errors, never a traceback (tests run the real CLI in a subprocess)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdctl.errors import TopologyError
from pdctl.plan import load_plan
from pdctl.topology import load_topology
from pdctl.topology.guard import MAX_BYTES, MAX_DEPTH

PER_FILE_SECS = 3.0
"""The issue's bound is "a second or two" per file; the subprocess gets this per file plus
its start-up, so that a slow CI machine does not fail a correct loader."""
POSITION = re.compile(r"^(?P<file>[^\n]+?):(?P<line>\d+):(?P<col>\d+): ", re.M)


def validate_files(tmp: Path, blobs: list[bytes]) -> tuple[int, str, list[Path]]:
    paths = []
    for i, blob in enumerate(blobs):
        path = tmp / f"t{i}.yaml"
        path.write_bytes(blob)
        paths.append(path)
    out = subprocess.run(
        [sys.executable, "-m", "pdctl", "validate", *map(str, paths)],
        capture_output=True,
        timeout=10 + PER_FILE_SECS * len(paths),
    )
    return out.returncode, (out.stdout + out.stderr).decode(errors="replace"), paths


def check_all_refused(tmp: Path, blobs: list[bytes]) -> None:
    code, text, paths = validate_files(tmp, blobs)
    assert "Traceback" not in text and "internal error" not in text, text[-3000:]
    assert code == 1, text[-3000:]
    positioned = {m["file"] for m in POSITION.finditer(text)}
    for path in paths:
        assert str(path) in positioned or f"{path}: ok" in text, (path, text[-3000:])


# -- hostile YAML, built from the features that hurt parsers ----------------------------------
scalars = st.one_of(
    st.text(max_size=20),
    st.integers(),
    st.sampled_from(["~", "null", "yes", "1e999", "-.inf", ".nan", "0x1F", "0o17", "2001-12-14t21:59:43.10-05:00"]),
    st.builds(lambda n: "x" * n, st.integers(0, 50_000)),  # huge scalars
)
tags = st.sampled_from(["", "!!str ", "!!binary ", "!!python/object:os.system ", "!custom ", "!!map ", "!!set ",
                        "!!omap ", "!!timestamp ", "!<tag:yaml.org,2002:int> "])  # fmt: skip


@st.composite
def hostile_yaml(draw) -> bytes:
    anchors: list[str] = []

    def value(depth: int) -> str:
        kind = draw(st.integers(0, 6 if depth < 6 else 1))
        if kind == 0:
            return draw(tags) + repr(draw(scalars))
        if kind == 1 and anchors:
            return "*" + draw(st.sampled_from(anchors))
        if kind in (2, 3):
            items = [value(depth + 1) for _ in range(draw(st.integers(0, 4)))]
            text = "[" + ", ".join(items) + "]"
        elif kind in (4, 5):
            keys = draw(st.lists(st.text("abcnodesmpl_", min_size=1, max_size=6), max_size=4))
            text = "{" + ", ".join(f"{k}: {value(depth + 1)}" for k in keys) + "}"
        else:
            text = "[" * draw(st.integers(60, 3000)) + "]" * draw(st.integers(0, 3000))  # deep, maybe unclosed
        if draw(st.booleans()):
            name = f"a{len(anchors)}"
            anchors.append(name)
            return f"&{name} {text}"
        return text

    top_keys = ["name", "model", "nodes", "prefill", "decode", "router", "allocation", "x", "<<"]
    keys = draw(st.lists(st.sampled_from(top_keys), min_size=1, max_size=6))
    body = "\n".join(f"{key}: {value(0)}" for key in keys)
    laughs = draw(st.integers(0, 12))  # a billion laughs of this many levels
    if laughs:
        lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
        lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, laughs)]
        body = "\n".join(lines) + "\n" + body
    encoded = body.encode(draw(st.sampled_from(["utf-8", "utf-8", "utf-16", "latin-1"])), errors="replace")
    if draw(st.booleans()):  # a stray byte somewhere
        at = draw(st.integers(0, len(encoded)))
        encoded = encoded[:at] + bytes([draw(st.integers(0, 255))]) + encoded[at:]
    return encoded


SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@SETTINGS
@given(st.lists(st.binary(max_size=3000), min_size=6, max_size=6))
def test_arbitrary_bytes(tmp_path_factory, blobs) -> None:
    check_all_refused(tmp_path_factory.mktemp("bytes"), blobs)


@SETTINGS
@given(st.lists(hostile_yaml(), min_size=6, max_size=6))
def test_hostile_yaml(tmp_path_factory, blobs) -> None:
    check_all_refused(tmp_path_factory.mktemp("yaml"), blobs)


# -- each guard, with its position ---------------------------------------------------------------
def issue_of(tmp_path: Path, blob: bytes) -> str:
    path = tmp_path / "t.yaml"
    path.write_bytes(blob)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    return "\n".join(i.format("t.yaml") for i in info.value.issues)


def test_each_guard_names_the_place(tmp_path) -> None:
    assert issue_of(tmp_path, b"name: x\nmodel: {path: caf\xe9}\n").startswith(
        "t.yaml:2:18: <root>: the file is not UTF-8: byte 0xe9 at offset 25"
    )
    assert issue_of(tmp_path, "name: \u00e9\u00e9\nx: \xff".encode("latin-1")).startswith(
        "t.yaml:1:7: <root>: the file"
    )
    assert issue_of(tmp_path, b"name: x\nmo\x00del: 1\n").startswith(
        "t.yaml:2:3: <root>: YAML does not allow the character U+0000 here"
    )
    laughs = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    laughs += [f"{k}: &{k} [" + ", ".join([f"*{p}"] * 10) + "]" for p, k in zip("abcdefgh", "bcdefghi", strict=True)]
    assert "aliases expand this to more than" in issue_of(tmp_path, "\n".join(laughs).encode())
    assert issue_of(tmp_path, b"a: &a [1, *a]\n").startswith(
        "t.yaml:1:4: <root>: an alias refers to a collection that contains it"
    )
    assert issue_of(tmp_path, b"a: " + b"[" * 100 + b"]" * 100).startswith(
        f"t.yaml:1:{3 + MAX_DEPTH}: <root>: nesting deeper than {MAX_DEPTH} levels"  # the mapping is level 1
    )
    block = "".join(f"{' ' * 2 * i}k{i}:\n" for i in range(MAX_DEPTH + 5)) + " " * 2 * (MAX_DEPTH + 5) + "v\n"
    assert f"nesting deeper than {MAX_DEPTH} levels" in issue_of(tmp_path, block.encode())
    assert issue_of(tmp_path, b"name: x\n" + b"#" * MAX_BYTES).startswith(
        f"t.yaml:1:1: <root>: the file is larger than {MAX_BYTES} bytes"
    )
    many = issue_of(tmp_path, b"name: x\nnodes:\n" + b"  - 1\n" * 5000)
    assert many.count("\n") == 100 and "more schema errors from here on" in many.splitlines()[-1]


def test_a_1024_node_topology_is_within_the_limits(tmp_path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from plan_scale import topology_text

    path = tmp_path / "n1024.yaml"
    path.write_text(topology_text(1024))
    planned = load_plan(path)
    assert len(planned.topology.nodes) == 1024 and len(planned.plan.engines) > 1024
    # The plan grows with the engines, not with their square (each listed every peer of its layout:
    # about 130 KB per engine here, 200 MB in all); benchmarks/plan_scale.py measures the same bytes.
    per_engine = len(json.dumps(planned.plan.to_dict())) / len(planned.plan.engines)
    assert per_engine < 4096, per_engine
