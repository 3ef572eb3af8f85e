"""The flags of single workloads (the trace replay's and prefix-repetition's), as a group of Typer
options ``kvtool bench`` takes (``kvtool.commands.options.with_options``); ``BenchConfig.from_options``
checks them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import typer

WORKLOAD_PANEL = "Workload shapes"


def _flag(help_text: str) -> typer.models.OptionInfo:
    return typer.Option(help=help_text, rich_help_panel=WORKLOAD_PANEL)


@dataclass(frozen=True)
class WorkloadFlags:
    trace_block_tokens: Annotated[int, _flag("tokens one 512-token trace block becomes")] = 16
    trace_start: Annotated[int, _flag("first trace line to replay (0-based)")] = 0
    trace_requests: Annotated[int | None, _flag("trace requests to replay \\[default: --requests]")] = None
    prefix_len: Annotated[int, _flag("prefix-repetition: tokens of each shared prefix")] = 80
    suffix_len: Annotated[int, _flag("prefix-repetition: tokens after the prefix")] = 24
    num_prefixes: Annotated[int, _flag("prefix-repetition: distinct prefixes")] = 2
