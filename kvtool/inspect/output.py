"""The one output object every inspect subcommand renders: a Rich table by default, JSON for machines."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass
class Report:
    """A titled table of rows plus a summary; ``payload`` is what ``--json`` prints."""

    title: str
    columns: list[str]
    rows: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    payload: dict[str, Any] | None = None  # default: {"summary": ..., "rows": ...}

    def as_json(self) -> dict[str, Any]:
        if self.payload is not None:
            return self.payload
        return {**self.summary, "rows": self.rows, "notes": self.notes}

    def render(self, console: Console, as_json: bool) -> None:
        if as_json:
            # print() on the raw stream: Rich would wrap long keys inside the JSON.
            console.file.write(json.dumps(self.as_json(), indent=2, default=str) + "\n")
            return
        table = Table(title=self.title, title_justify="left")
        for column in self.columns:
            table.add_column(column, overflow="fold")
        for row in self.rows:
            table.add_row(*(_cell(row.get(column)) for column in self.columns))
        console.print(table)
        for name, value in self.summary.items():
            console.print(f"{name.replace('_', ' ')}: {_cell(value)}", soft_wrap=True, highlight=False, markup=False)
        for note in self.notes:
            console.print(note, style="dim", soft_wrap=True, highlight=False, markup=False)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
