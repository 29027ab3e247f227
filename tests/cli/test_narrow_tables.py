"""Tables at 60, 80 and 100 columns never split a word (new-user issue, item 3): `pdctl status`,
`pdctl plan` and `pdctl bench`'s sweep table print whole when they fit and fold when they do not.

Each check takes every word of every cell and header and asserts it appears whole in the output
(a word longer than the line is the only one allowed to break)."""

from __future__ import annotations

import pytest
from rich.console import Console

from pdctl.bench import report as bench_report
from pdctl.cli.cluster_cmds import _print_status
from pdctl.cli.tables import print_table
from pdctl.cluster.inspect import ClusterStatus, EngineStatus, ProcessStatus
from pdctl.cluster.state import Phase

WIDTHS = (60, 80, 100)


def _status() -> ClusterStatus:
    procs = [
        ProcessStatus(
            "prefill-0", "prefill", "me", 123456, True, True, "default",
            {"http": 21000, "bootstrap": 21002, "dist_init": 21003}, 3605.2,
        ),
        ProcessStatus("decode-0", "decode", "me", 123457, True, True, "default", {"http": 21001}, 3605.0),
        ProcessStatus(
            "router", "router", "me", 123458, True, True, None, {"http": 21004, "metrics": 21005}, 3604.9,
            restarts=2, last_exit={"code": -9, "at": 0},
        ),
        ProcessStatus(
            "trainer.me", "trainer", "me", 123459, False, None, None, {"weight_group": 22008}, None, exit_code=0
        ),
    ]  # fmt: skip
    engines = [
        EngineStatus("prefill-0", "prefill", ["prefill-0"], True),
        EngineStatus("decode-0", "decode", ["decode-0"], True),
    ]
    return ClusterStatus("local", Phase.UP, "http://127.0.0.1:21004", procs, None, engines)


def _words_whole(out: str, texts: list[str], width: int) -> None:
    flat = " ".join(out.split())
    for text in texts:
        for word in text.split():
            if len(word) + 4 <= width:
                assert word in flat, f"{word!r} is split at {width} columns:\n{out}"


@pytest.mark.parametrize("width", WIDTHS)
def test_status_never_splits_a_word(width, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", str(width))
    st = _status()
    _print_status(st)
    out = capsys.readouterr().out
    assert all(len(line) <= width for line in out.splitlines()), out
    words = ["role node pid alive health weights ports uptime"]  # (the first column is named by its values)
    for p in st.processes:
        words += [p.id, p.role, p.node, str(p.pid), p.weight_version or "", *(f"{k}={v}" for k, v in p.ports.items())]
    _words_whole(out, words, width)


@pytest.mark.parametrize("width", WIDTHS)
def test_a_bench_sweep_table_never_splits_a_word(width) -> None:
    runs = []
    for rate in ("1.0", "2.0", "4.0", "8.0", "16.0", "inf"):
        run = {key: 1234.5678 for key, _label, _fmt in bench_report.ROWS}
        runs.append({**run, "request_rate": rate, "max_concurrency": 64, "errors": {"http_503": 3}})
    report = {"url": "http://127.0.0.1:21004", "api": "generate", "num_prompts": 200, "runs": runs}
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    print_table(console, bench_report.table(report), fold="split")
    out = console.export_text()
    assert all(len(line) <= width for line in out.splitlines()), out
    labels = [label for _key, label, _fmt in bench_report.ROWS]
    _words_whole(out, [*labels, *(bench_report.run_label(r) for r in runs), "1234.57", "http_503: 3"], width)
    for rate in ("16.0", "inf"):
        assert f"rate {rate}" in out, "every load point is shown"


@pytest.mark.parametrize("width", WIDTHS)
def test_plan_never_splits_a_word(width, capsys, monkeypatch) -> None:
    from pathlib import Path

    from pdctl.cli.topology_cmds import render_plan
    from pdctl.plan import make_plan
    from pdctl.topology import load_topology

    monkeypatch.setenv("COLUMNS", str(width))
    top, _ = load_topology(Path(__file__).resolve().parents[2] / "topologies" / "rl-sim.yaml")
    plan = make_plan(top)
    render_plan(plan)
    out = capsys.readouterr().out
    words = ["role node GPUs ports"]
    for p in plan.processes:
        words += [p.id, p.role.value, p.node, *(f"{k}={v}" for k, v in p.ports.items())]
    _words_whole(out, words, width)
