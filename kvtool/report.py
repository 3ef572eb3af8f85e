"""The one output object of every command that prints results: titled tables plus a summary and notes.

A ``Report`` renders as Rich tables that fit the console they are printed on, or as JSON (its
``payload``). A table is shown whole when it fits; otherwise transposed (its fields down the side,
one column per row, split into as many tables as it takes), and failing that one field/value block
per row. Nothing is ever cut to "…": only long free text (keys, hashes, reasons) folds in its cell.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

# A column whose longest cell is longer than this may fold its cells (never its header) to fit.
FOLD_ABOVE = 24
FOLD_MIN = 16  # the narrowest a folding column is planned at
Cell = str | Text | int | float | bool | None


@dataclass
class ReportTable:
    """Rows (dicts keyed by column name) shown under ``columns``; a missing cell shows as "-"."""

    title: str
    columns: list[str]
    rows: list[dict[str, Any]]


@dataclass
class Report:
    """Tables, a summary (``name: value`` lines) and notes; ``payload`` is what JSON output holds."""

    tables: list[ReportTable]
    summary: dict[str, Any] = field(default_factory=dict)
    notes: list[str | Text] = field(default_factory=list)  # str: dim; Text: as styled
    payload: dict[str, Any] | None = None  # default: the summary, the first table's rows, the notes

    def as_json(self) -> dict[str, Any]:
        if self.payload is not None:
            return self.payload
        rows = self.tables[0].rows if self.tables else []
        return {**self.summary, "rows": rows, "notes": [str(note) for note in self.notes]}

    def json_text(self) -> str:
        return json.dumps(self.as_json(), indent=2, default=str) + "\n"

    def render(self, console: Console) -> None:
        for table in self.tables:
            for part in fit_table(table, console.width):
                console.print(part)
        # Wrapped at the console's width; a word longer than a line (a key, a path) folds.
        for name, value in self.summary.items():
            line = f"{name.replace('_', ' ')}: {cell_text(value)}"
            console.print(line, overflow="fold", highlight=False, markup=False)
        for note in self.notes:
            if isinstance(note, Text):
                console.print(note, overflow="fold", highlight=False)
            else:
                console.print(note, style="dim", overflow="fold", highlight=False, markup=False)


def cell_text(value: Cell) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _cell(value: Any) -> Text:
    # Text, never markup: keys and reasons may hold "[".
    return value if isinstance(value, Text) else Text(cell_text(value))


def _is_number(text: str) -> bool:
    stripped = text.rstrip("%").replace(".", "", 1).lstrip("-")
    return stripped.isdigit() or text == "-"


# ---- layouts --------------------------------------------------------------------------------


def _frame(columns: int) -> int:
    """Width of a table's borders and padding: one space either side of a cell, one rule between."""
    return 3 * columns + 1


def fit_table(table: ReportTable, width: int) -> list[Table]:
    """The first layout of ``table`` that fits ``width``: whole; transposed, in as few tables as it
    takes; one field/value block per row."""
    cells = [[_cell(row.get(column)) for column in table.columns] for row in table.rows]
    if _whole_width(table.columns, cells) <= width:
        return [_whole(table, cells)]
    chunks: list[list[list[Text]]] = [[]]
    for row in cells:
        if chunks[-1] and _transposed_width(table.columns, [*chunks[-1], row]) > width:
            chunks.append([])
        chunks[-1].append(row)
    if all(_transposed_width(table.columns, chunk) <= width for chunk in chunks):
        titles = [table.title] + [f"{table.title} (continued)"] * (len(chunks) - 1)
        return [_transposed(title, table.columns, chunk) for title, chunk in zip(titles, chunks, strict=True)]
    return [_records(table, cells)]


def _column_cells(cells: Sequence[Sequence[Text]], index: int) -> list[Text]:
    return [row[index] for row in cells]


def _folds(column_cells: Sequence[Text]) -> bool:
    return max((c.cell_len for c in column_cells), default=0) > FOLD_ABOVE


def _whole_width(columns: Sequence[str], cells: Sequence[Sequence[Text]]) -> int:
    total = 0
    for index, column in enumerate(columns):
        values = _column_cells(cells, index)
        longest = max((c.cell_len for c in values), default=0)
        planned = min(longest, FOLD_MIN) if _folds(values) else longest
        total += max(cell_len(column), planned)
    return total + _frame(len(columns))


def _whole(table: ReportTable, cells: Sequence[Sequence[Text]]) -> Table:
    rich_table = Table(title=table.title, title_justify="left")
    for index, column in enumerate(table.columns):
        values = _column_cells(cells, index)
        numeric = bool(values) and all(_is_number(c.plain) for c in values)
        folds = _folds(values)
        rich_table.add_column(
            column,
            justify="right" if numeric else "left",
            no_wrap=not folds,
            overflow="fold",
            min_width=cell_len(column),
        )
    for row in cells:
        rich_table.add_row(*row)
    return rich_table


def _transposed_width(columns: Sequence[str], cells: Sequence[Sequence[Text]]) -> int:
    names = max((cell_len(c) for c in columns), default=0)
    per_row = [max((c.cell_len for c in row), default=0) for row in cells]
    return names + sum(per_row) + _frame(1 + len(cells))


def _transposed(title: str, columns: Sequence[str], cells: Sequence[Sequence[Text]]) -> Table:
    """Fields down the side, one column per row, headed by the row's first cell."""
    rich_table = Table(title=title, title_justify="left")
    rich_table.add_column(columns[0], no_wrap=True)
    for row in cells:
        numeric = all(_is_number(c.plain) for c in row[1:])
        rich_table.add_column(row[0], justify="right" if numeric else "left", no_wrap=True)
    for index, column in enumerate(columns[1:], start=1):
        rich_table.add_row(column, *(row[index] for row in cells))
    return rich_table


def _records(table: ReportTable, cells: Sequence[Sequence[Text]]) -> Table:
    """One field/value block per row, for tables too wide for the console either way."""
    rich_table = Table(title=table.title, title_justify="left", show_header=False)
    rich_table.add_column("field", no_wrap=True, style="bold")
    rich_table.add_column("value", overflow="fold")
    for row in cells:
        for index, column in enumerate(table.columns):
            rich_table.add_row(column, row[index], end_section=index == len(table.columns) - 1)
    return rich_table
