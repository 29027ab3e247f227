"""``pdctl router``: argv goes to the router's own parser (sglang-router's flag shapes,
such as ``--prefill URL BOOTSTRAP_PORT``, do not fit click)."""

from __future__ import annotations

import click


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def router(argv: tuple[str, ...]) -> None:
    """Run the PD router standalone (see `pdctl router --help`)."""
    from pdctl.router.cli import main

    main(list(argv))


COMMANDS = [router]
