"""Root command group and the error boundary."""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Any

import click

from pdctl import __version__
from pdctl.errors import PdctlError


class PdctlGroup(click.Group):
    """Turns PdctlError into a message and exit 1; anything else into a one-line internal error."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except PdctlError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                traceback.print_exc()
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.secho("interrupted", fg="red", err=True)
            sys.exit(130)
        except Exception as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.secho(
                f"internal error: {type(exc).__name__}: {exc} (run with --debug for a traceback)", fg="red", err=True
            )
            sys.exit(1)


@click.group(cls=PdctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.version_option(__version__, prog_name="pdctl")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Declarative prefill/decode SGLang fleets plus a torchrun trainer on bare-metal GPU nodes.

    One YAML topology file describes nodes, engines, router and trainer; pdctl validates it,
    plans every process, launches them over SSH and routes traffic through its PD router.
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if not debug:
        # paramiko logs a failed handshake itself (an empty ERROR line for an unreachable host);
        # pdctl reports the failure with the node's name, so paramiko's own lines only with --debug.
        logging.getLogger("paramiko").setLevel(logging.CRITICAL)


def _register() -> None:
    from pdctl.cli import bench_cmds, cluster_cmds, observe_cmds, router_cmds, topology_cmds, weights_cmds

    for module in (topology_cmds, cluster_cmds, observe_cmds, router_cmds, weights_cmds, bench_cmds):
        for command in module.COMMANDS:
            cli.add_command(command)


_register()
