"""Root command group and the error boundary."""

from __future__ import annotations

import importlib
import logging
import sys
import traceback
from typing import Any

import click

from pdctl import __version__
from pdctl.errors import PdctlError
from pdctl.signals import exit_interrupted


class PdctlGroup(click.Group):
    """Turns PdctlError into a message and exit 1; anything else into a one-line internal error.

    Commands load when they run (``COMMAND_MODULES``): a command imports only its own module, so
    `pdctl switch` does not pay for the bench client's aiohttp, and `--version` for none."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Every command's name, loaded or not, sorted."""
        return sorted({*COMMAND_MODULES, *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The command, its module loaded; for a name that is none, every module is loaded first,
        so that click's "did you mean" sees every command."""
        if cmd_name in self.commands:
            return self.commands[cmd_name]
        module = COMMAND_MODULES.get(cmd_name)
        for name in [module] if module is not None else sorted(set(COMMAND_MODULES.values())):
            self._load(name)
        return self.commands.get(cmd_name)

    def _load(self, module: str) -> None:
        try:  # click parses (and prints --help, which loads every module) before invoke's boundary
            commands = importlib.import_module(f"pdctl.cli.{module}").COMMANDS
        except KeyboardInterrupt:
            exit_interrupted()
        self.commands.update((command.name, command) for command in commands if command.name)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command: a PdctlError prints ``error: ...`` and exits 1, Ctrl-C exits 130, any other
        exception prints a one-line internal error and exits 1 (``--debug`` shows the traceback)."""
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
            exit_interrupted()
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


COMMAND_MODULES = {
    "validate": "topology_cmds", "plan": "topology_cmds", "schema": "topology_cmds",
    "up": "cluster_cmds", "down": "cluster_cmds", "status": "cluster_cmds", "logs": "cluster_cmds",
    "restart": "cluster_cmds", "apply": "cluster_cmds", "switch": "cluster_cmds",
    "top": "observe_cmds", "metrics": "observe_cmds", "endpoints": "observe_cmds",
    "router": "router_cmds", "weights": "weights_cmds", "bench": "bench_cmds",
    "planner": "planner_cmds",
}  # fmt: skip
"""Each command and the module of pdctl.cli that defines it (in its ``COMMANDS``)."""
