"""The flags of single workloads (the trace replay's and prefix-repetition's), as a group of Typer
options ``kvtool bench`` takes (``kvtool.commands.options.with_options``): made from each workload's own
``Options`` model (``Workload.Options``, the workloads' registry ``workloads.with_options``), so a
workload with flags is one module; ``BenchConfig.from_options`` checks them."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import typer

from .workloads import with_options

WORKLOAD_PANEL = "Workload shapes"


def _flag(help_text: str) -> typer.models.OptionInfo:
    return typer.Option(help=help_text, rich_help_panel=WORKLOAD_PANEL)


def _workload_flags() -> list[tuple[str, Any, Any]]:
    """Every workload's ``Options`` fields, as dataclass fields whose annotations carry their options."""
    made = []
    for workload in with_options():
        assert workload.Options is not None
        for name, info in workload.Options.model_fields.items():
            option = _flag(f"{workload.name}: {info.description or name}")
            made.append((name, Annotated[info.annotation, option], dataclasses.field(default=info.default)))
    return made


WorkloadFlags = dataclasses.make_dataclass("WorkloadFlags", _workload_flags(), frozen=True)
WorkloadFlags.__module__ = __name__
WorkloadFlags.__doc__ = "The workloads' own flags, by name (``Workload.Options``)."
