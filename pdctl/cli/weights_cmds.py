"""``pdctl weights status`` and ``pdctl weights load``: thin commands over pdctl.cluster.weights."""

from __future__ import annotations

import json
import os
import sys

import click
from rich.console import Console
from rich.table import Table

from pdctl.cli.tables import print_table
from pdctl.cluster import StateStore
from pdctl.cluster.weights import WeightsStatus, load_weights, weights_status
from pdctl.refit import RefitMode


@click.group()
def weights() -> None:
    """The engines' weights: versions, the trainer's group, loads from disk."""


@weights.command("status")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(name: str | None, as_json: bool) -> None:
    """Each engine of NAME: weight version, its ranks in the weight group, rotation.

    "planned" ranks come from the plan; "in group" from the group the trainer's latest push
    used (the router keeps it). Exit 1 when an engine does not answer, is out of the router's
    rotation, the engines do not all hold one version, or an update holds the router's requests
    (a framework's pause, a push under way).
    """
    store = StateStore()
    result = weights_status(store.resolve_name(name), store=store)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        _print(result)
    if not result.ok:
        sys.exit(1)


@weights.command("load")
@click.argument("path")
@click.argument("name", required=False)
@click.option("--version", "version", help="Weight version the engines report afterwards (default: PATH's last part).")
@click.option(
    "--refit",
    type=click.Choice([m.value for m in RefitMode]),
    help="drain: wait for in-flight requests first; interrupt: stop them at a token boundary and continue "
    "them on the new weights (default: the topology's weights.refit).",
)
def load(path: str, name: str | None, version: str | None, refit: str | None) -> None:
    """Load the checkpoint at PATH into every engine of cluster NAME.

    PATH is read by each engine on its own node (/update_weights_from_disk). One transaction,
    which the router runs: it holds (and, with --refit drain, drains), engines pause, load, take
    the version, resume; an engine that fails to load leaves the router's rotation and the
    command exits 1. A Ctrl-C while requests drain cancels the load (nothing changed); after
    that the router finishes it on its own.
    """
    store = StateStore()
    cluster = store.resolve_name(name)
    version = version or os.path.basename(path.rstrip("/")) or path
    try:
        report = load_weights(
            cluster, path, version, refit=refit, store=store, progress=lambda m: click.echo(m, err=True)
        )
    except KeyboardInterrupt:
        click.echo(
            "the router runs the load: it cancels it if it still waited for requests in flight (nothing changed), "
            f"else finishes it on its own; `pdctl weights status {cluster}` says where the fleet is",
            err=True,
        )
        raise
    click.echo(
        f"loaded {path} as version {report.version} into {len(report.engines)} engine(s) in {report.seconds:.2f}s "
        f"(load {report.phases.get('transfer', 0.0):.2f}s, refit {report.refit})"
    )


def _print(result: WeightsStatus) -> None:
    out = Console(width=None if sys.stdout.isatty() else 160)
    group = result.group
    title = f"{result.name}: weights"
    if group:
        title += f"  group {group['group_name']} ({group['backend']}, {group['world_size']} ranks)"
    table = Table(title=title)
    for col in ("engine", "role", "version", "planned ranks", "in group", "rotation"):
        table.add_column(col)
    for e in result.engines:
        version = f"[red]{e.error}[/]" if e.error else (e.version or "-")
        planned = _ranks(e.planned_ranks)
        in_group = _ranks(e.group_ranks) if result.last_push and result.last_push.get("group") else "-"
        rotation = f"[red]out: {e.out_of_rotation}[/]" if e.out_of_rotation else "[green]in[/]"
        table.add_row(e.id, e.role, version, planned, in_group, rotation)
    print_table(out, table)
    if result.hold:
        out.print(f"[red]requests wait: the router is {result.hold.get('reason')}[/]")
    push = result.last_push
    if push:
        line = f"last push: {push.get('version')} {push.get('state')}"
        if push.get("failed"):
            line += "; failed: " + ", ".join(f"{url} ({why})" for url, why in push["failed"].items())
        out.print(line)
    elif result.router_error:
        out.print(f"[red]router: {result.router_error}[/]")
    else:
        out.print("no push since the router started")


def _ranks(ranks: tuple[int, int] | list[int] | None) -> str:
    if not ranks:
        return "-"
    first, last = ranks
    return str(first) if first == last else f"{first}-{last}"


COMMANDS = [weights]
