"""validate / plan / schema through the real click app."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from pdctl.cli import cli
from tests.conftest import REPO


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def all_commands():
    """Every command path, as `pdctl --help` lists them (the root group loads its commands lazily)."""
    out = []

    def walk(group, prefix):
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            assert cmd is not None, f"pdctl {' '.join((*prefix, name))} is listed but does not load"
            out.append((*prefix, name))
            if isinstance(cmd, click.Group):
                walk(cmd, (*prefix, name))

    walk(cli, ())
    return out


def test_every_command_module_is_reachable_and_a_command_loads_only_its_own() -> None:
    """Each command of every pdctl.cli module is named in COMMAND_MODULES (a command left out
    would be silently missing), and loading one (`pdctl switch --help`) imports neither paramiko
    (a localhost cluster needs no SSH: it loads with the first node that is not local), nor the
    bench client's aiohttp, nor the topology's loader and its schema (jsonschema: only `up`,
    `apply` and the topology commands read a file)."""
    from pdctl.cli.app import COMMAND_MODULES

    for path in sorted((REPO / "pdctl" / "cli").glob("*_cmds.py")):
        module = importlib.import_module(f"pdctl.cli.{path.stem}")
        for command in module.COMMANDS:
            assert COMMAND_MODULES.get(command.name) == path.stem, (command.name, path.stem)
    probe = (
        "import sys\n"
        "from pdctl.cli.app import cli\n"
        "try:\n"
        "    cli.main(['switch', '--help'], prog_name='pdctl')\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('paramiko', 'aiohttp', 'pdctl.cli.bench_cmds', 'jsonschema', 'pdctl.plan.load')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.splitlines()[-1] == "[]", out.stdout


def test_a_mistyped_command_is_told_the_one_it_meant() -> None:
    """The commands load lazily; a name that is none still gets click's suggestion among all."""
    result = run("swich")
    assert result.exit_code == 2 and "Did you mean 'switch'?" in result.output, result.output


@pytest.mark.parametrize("command", all_commands(), ids=" ".join)
def test_every_command_has_help(command) -> None:
    result = run(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "usage:" in result.output.lower() and len(result.output.splitlines()) > 3


def test_validate_ok_and_errors(write_yaml) -> None:
    ok = run("validate", str(REPO / "topologies" / "2node-hetero-tp.yaml"))
    assert ok.exit_code == 0 and ": ok" in ok.output
    bad = write_yaml("name: t\nmodel: {path: m}\nnodes: [{name: n0, host: h}]\nprefill: {tp: 2, tpp: 1}\n")
    result = run("validate", str(bad))
    assert result.exit_code == 1
    assert f"{bad}:4:18: prefill.tpp: unknown key 'tpp'" in result.output
    assert "Traceback" not in result.output


def test_validate_missing_file_is_usage_error(tmp_path) -> None:
    """A missing file and a directory are both usage errors (exit 2, click's message), as any
    other bad argument; a file that exists but is wrong is exit 1."""
    result = run("validate", "/nonexistent/x.yaml")
    assert result.exit_code == 2 and "does not exist" in result.output
    result = run("validate", str(tmp_path))
    assert result.exit_code == 2 and "is a directory" in result.output


def test_usage_errors_exit_2() -> None:
    assert run("validate").exit_code == 2
    assert run("plan", "--bogus").exit_code == 2


def test_plan_json_and_table() -> None:
    result = run("plan", str(REPO / "topologies" / "2node-hetero-tp.yaml"), "--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["weight_group"]["world_size"] == 9
    assert {p["id"] for p in data["processes"]} >= {"prefill-0", "prefill-1", "decode-0", "router", "trainer.n1"}
    table = run("plan", str(REPO / "topologies" / "2node-hetero-tp.yaml"))
    assert table.exit_code == 0 and "decode-0" in table.output and "world_size=9" in table.output


def test_plan_default_is_local_sim() -> None:
    data = json.loads(run("plan", "--json").output)
    assert data["engine"] == "sim" and data["router"]["url"].startswith("http://127.0.0.1:")


def test_schema_prints_json_schema() -> None:
    data = json.loads(run("schema").output)
    assert data["$schema"].endswith("2020-12/schema") and "nodes" in data["required"]


def test_internal_errors_have_no_traceback_without_debug(write_yaml, monkeypatch) -> None:
    import pdctl.cli.topology_cmds as cmds

    def boom(_):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(cmds, "load_plan", boom)
    result = run("plan", str(REPO / "topologies" / "colocate.yaml"))
    assert result.exit_code == 1 and "internal error: RuntimeError: kaboom" in result.output
    assert "Traceback" not in result.output


def test_a_bad_enum_value_gets_did_you_mean(tmp_path) -> None:
    topo = tmp_path / "t.yaml"
    topo.write_text("name: x\nmodel: {path: sim://tiny}\nengine: sim\nnodes: [{name: a, host: 127.0.0.1, gpus: 2}]\n"
                    "prefill: {}\ndecode: {}\nrouter: {policy: round_robn}\n")  # fmt: skip
    result = run("validate", str(topo))
    assert result.exit_code == 1 and "7:10: router.policy: 'round_robn' is not one of" in result.output
    assert "did you mean 'round_robin'?" in result.output


def test_plan_at_80_columns_keeps_ids_whole_and_shows_full_commands() -> None:
    import shlex
    import subprocess
    import sys

    topo = str(REPO / "topologies" / "sim-multinode-decode.yaml")  # the longest ids: decode-0.h1, trainer.h0
    out = subprocess.run([sys.executable, "-m", "pdctl", "plan", topo], capture_output=True, text=True,
                         env={**__import__("os").environ, "COLUMNS": "80"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert all(len(line) <= 80 for line in out.stdout.splitlines() if line.startswith(("┃", "│", "┏", "└")))
    plan = json.loads(run("plan", topo, "--json").output)
    for proc in plan["processes"]:
        assert f"│ {proc['id']} " in out.stdout, proc["id"]  # whole in its cell, not cut with an ellipsis
        assert f"{proc['id']} on {proc['node']}: {shlex.join(proc['argv'])}" in out.stdout  # the full command
    assert "…" not in out.stdout


def test_every_router_flag_is_described() -> None:
    from pdctl.router.cli import build_parser

    undocumented = [a.option_strings[0] for a in build_parser()._actions if a.option_strings and not a.help]
    assert not undocumented, undocumented
