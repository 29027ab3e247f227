"""Tables that never split a word: printed whole when they fit the console, else folded.

A rich table squeezed into a narrow terminal cuts its cells mid-word (``weigh|ts``,
``boots|trap=|21002``). ``print_table`` measures the table's natural width first: when it fits,
it prints as is; when not, it folds instead of cutting:
- ``stack`` (one row per thing: processes, engines): each row becomes a bold first cell followed
  by indented ``column: value`` lines, which wrap at spaces like any text;
- ``split`` (one column per thing: bench load points): the columns are printed in groups that
  fit, each group with the first (label) column again.
A single word longer than the whole line is the only thing that may still break.
"""

from __future__ import annotations

import os
import sys
from typing import Literal

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

Fold = Literal["stack", "split"]


def _plain(cell: object) -> str:
    if isinstance(cell, Text):
        return cell.plain
    return Text.from_markup(str(cell)).plain if isinstance(cell, str) else str(cell)


def _fits(console: Console, table: Table) -> bool:
    # Measured with room to spare: a measurement within the console's own width is clamped to it.
    natural = Measurement.get(console, console.options.update_width(1 << 20), table).maximum
    return natural <= console.width


def stdout_console(**kwargs: object) -> Console:
    """A console on stdout: a terminal's width or $COLUMNS; piped without $COLUMNS 160, not
    rich's 80 (which would fold versions and ports)."""
    return Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160, **kwargs)  # type: ignore[arg-type]


def print_table(console: Console, table: Table, fold: Fold = "stack") -> None:
    """Print ``table`` on ``console`` whole if it fits, else folded (see the module docstring)."""
    for column in table.columns:
        column.no_wrap = True  # a cell is either whole on its line or the table folds
    if _fits(console, table):
        console.print(table)
        return
    if fold == "split" and len(table.columns) > 2:
        _print_split(console, table)
    else:
        _print_stacked(console, table)


def _print_stacked(console: Console, table: Table) -> None:
    if table.title:
        console.print(table.title, style="bold")
    columns = table.columns
    cells = [list(c.cells) for c in columns]
    for row in range(table.row_count):
        console.print(f"[bold]{cells[0][row]}[/]" if isinstance(cells[0][row], str) else cells[0][row])
        for column, values in zip(columns[1:], cells[1:], strict=True):
            value = values[row]
            text = Text.from_markup(value.replace("\n", ", ")) if isinstance(value, str) else Text(_plain(value))
            console.print(Text(f"  {_plain(column.header)}: ") + text)


def _print_split(console: Console, table: Table) -> None:
    rest = table.columns[1:]
    groups: list[list[int]] = [[]]
    for i in range(len(rest)):
        trial = _subtable(table, [0, *(j + 1 for j in groups[-1]), i + 1])
        if groups[-1] and not _fits(console, trial):
            groups.append([])
        groups[-1].append(i)
    for n, group in enumerate(groups):
        sub = _subtable(table, [0, *(j + 1 for j in group)])
        if n:
            sub.title = None
        if not _fits(console, sub):  # one load point alone is too wide: stack it
            _print_stacked(console, sub)
        else:
            console.print(sub)


def _subtable(table: Table, indexes: list[int]) -> Table:
    out = Table(title=table.title, box=table.box, show_lines=table.show_lines)
    columns = [table.columns[i] for i in indexes]
    for column in columns:
        out.add_column(column.header, justify=column.justify, no_wrap=True)
    cells = [list(c.cells) for c in columns]
    for row in range(table.row_count):
        out.add_row(*(values[row] for values in cells))
    return out
