"""validate, plan, schema: everything that needs no node."""

from __future__ import annotations

import json
import shlex
import sys

import click
from rich.console import Console
from rich.table import Table

from pdctl.cli.tables import print_table
from pdctl.errors import Issue, TopologyError
from pdctl.plan import Plan, Planned, load_plan, load_plan_text
from pdctl.topology import default_topology_text, topology_schema

DEFAULT_NAME = "<default: local-sim.yaml>"


def load_or_default(file: str | None) -> tuple[Planned, str]:
    """Load and plan FILE, or the embedded default (sim on localhost) when FILE is None;
    print its warnings. Returns the planned topology and the name issues are reported under."""
    planned = load_plan_text(default_topology_text(), DEFAULT_NAME) if file is None else load_plan(file)
    filename = DEFAULT_NAME if file is None else file
    print_warnings(planned.warnings, filename)
    return planned, filename


def print_warnings(warnings: list[Issue], filename: str) -> None:
    for w in warnings:
        click.secho(w.format(filename), fg="yellow", err=True)


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, exists=True))
def validate(files: tuple[str, ...]) -> None:
    """Check topology FILES against the schema and the semantic rules.

    Every problem is printed as FILE:LINE:COL: dotted.path: message (hint). Exit 1 if any
    file has an error; warnings alone exit 0.
    """
    failed = False
    for file in files:
        try:
            warnings = load_plan(file).warnings
        except TopologyError as exc:
            failed = True
            for issue in exc.issues:
                color = "red" if issue.severity == "error" else "yellow"
                click.secho(issue.format(file), fg=color, err=True)
            continue
        print_warnings(warnings, file)
        click.echo(f"{file}: ok")
    if failed:
        sys.exit(1)


@click.command()
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the whole plan as JSON (argv, env, ports, GPUs, ranks).")
def plan(file: str | None, as_json: bool) -> None:
    """Show exactly what `up` would start for FILE (default: the embedded local sim topology).

    Pure: touches no node. The table lists each process with its node, GPUs and ports;
    --json adds argv, env, log paths and the weight group.
    """
    result = load_or_default(file)[0].plan
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    render_plan(result)


def render_plan(result: Plan) -> None:
    """A table (folded per process when the terminal is narrower than it), then each process's
    full command line (plain text, so a narrow terminal wraps it instead of cutting it)."""
    console = Console()
    table = Table(title=f"plan {result.name} ({result.engine})", show_lines=False)
    for col in ("process", "role", "node", "GPUs", "ports"):
        table.add_column(col)
    for proc in result.processes:
        ports = "\n".join(f"{k}={v}" for k, v in proc.ports.items())
        table.add_row(proc.id, proc.role.value, proc.node, _ranges(proc.gpu_ids) or "-", ports)
    print_table(console, table)
    console.print("commands:", style="bold")
    for proc in result.processes:
        console.print(f"{proc.id} on {proc.node}: {shlex.join(proc.argv)}", soft_wrap=True, highlight=False)
    console.print(f"router: {result.router_url}")
    for daemon in result.mps:
        console.print(f"mps: a control daemon on {daemon.node} (pipe {daemon.pipe_dir}), before any process there")
    if result.trainer_first:
        console.print("start order: trainer first (it claims its memory share), then engines and router")
    if result.weight_group:
        wg = result.weight_group
        ranks = ", ".join(f"{e.id}@{e.rank_offset}" for e in result.engines)
        console.print(
            f"weight group: {wg.backend} world_size={wg.world_size} at {wg.master_address}:{wg.master_port}; "
            f"rank offsets: {ranks}"
        )
    if result.data_plane:
        dp = result.data_plane
        pairs = ", ".join(f"{e.id}@{e.first_rank}" for e in dp.engines)
        console.print(
            f"data plane: {dp.backend} world_size={dp.world_size} at {dp.master_address}:{dp.master_port}; "
            f"trainer ranks 0..{dp.trainer_ranks - 1}, engine TP ranks from: {pairs}; "
            f"{dp.batch_size} sequences per step, aux layers {list(dp.aux_layers) or 'none'}"
        )


def _ranges(ids: tuple[int, ...]) -> str:
    """``(0, 1, 2, 3, 6)`` -> ``0-3,6``."""
    parts: list[str] = []
    for i in ids:
        if parts and "-" in parts[-1] and int(parts[-1].split("-")[1]) == i - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{i}"
        elif parts and "-" not in parts[-1] and int(parts[-1]) == i - 1:
            parts[-1] = f"{parts[-1]}-{i}"
        else:
            parts.append(str(i))
    return ",".join(parts)


@click.command()
def schema() -> None:
    """Print the topology JSON Schema (draft 2020-12) for editors and CI."""
    click.echo(json.dumps(topology_schema(), indent=2))


COMMANDS = [validate, plan, schema]
