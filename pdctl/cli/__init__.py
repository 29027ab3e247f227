"""The pdctl command line: thin commands over the library, one error boundary.

Exit codes: 0 ok, 1 a pdctl error (invalid topology, failed up, something down), 2 usage.
Tracebacks only with ``--debug``.
"""

from __future__ import annotations

from pdctl.cli.app import cli


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="pdctl", standalone_mode=True)


__all__ = ["cli", "main"]
