"""The pdctl command line: thin commands over the library, one error boundary.

Exit codes: 0 ok, 1 a pdctl error (invalid topology, failed up, something down), 2 usage,
130 interrupted. Tracebacks only with ``--debug``. The root group is imported inside ``main``
and each command's module when it is named (pdctl.cli.app), so that a Ctrl-C while they load
ends quietly too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdctl.lazy import lazy_exports

if TYPE_CHECKING:
    from pdctl.cli.app import cli


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    from pdctl.signals import exit_interrupted, interrupt_on_every_stop_signal

    interrupt_on_every_stop_signal()  # kill and a closed terminal stop a command as Ctrl-C does
    try:
        from pdctl.cli.app import cli
    except KeyboardInterrupt:
        exit_interrupted()
    cli.main(args=argv, prog_name="pdctl", standalone_mode=True)


__getattr__ = lazy_exports(__name__, {"cli": "pdctl.cli.app"})  # the click group, for tests and embedding


__all__ = ["cli", "main"]
