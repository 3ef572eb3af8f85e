"""Where a command's output goes: results on stdout (a table, or JSON), everything else on stderr,
expected failures as one sentence and an exit code (kvtool.errors.EXIT_CODES)."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from dataclasses import dataclass, replace
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from kvtool.errors import EXIT_CODES, EXIT_INTERRUPTED, UserError
from kvtool.report import Report

out = Console()
err = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])

# Shown under every command's --help.
EXIT_CODES_EPILOG = "Exit codes:\n" + "\n".join(f"{code:<4} {meaning}" for code, meaning in EXIT_CODES)


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


def check_writable(path: Path | None, flag: str) -> None:
    if path is None:
        return
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file name")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the file's directories are created, from the nearest that exists
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UserError(f"{flag} {path}: cannot write there ({parent} is not a writable directory)")


# ---- the output's flags: every command that prints results ------------------------------------

OUTPUT_PANEL = "Output"


@dataclass(frozen=True)
class OutputOptions:
    """--format, --output and --quiet, as every command that prints results takes them."""

    format: Annotated[
        OutputFormat,
        typer.Option("--format", help="table, or json (only the JSON report on stdout)", rich_help_panel=OUTPUT_PANEL),
    ] = OutputFormat.table
    output: Annotated[
        Path | None,
        typer.Option("--output", help="also write the JSON report to this file", rich_help_panel=OUTPUT_PANEL),
    ] = None
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet",
            "-q",
            help="no table, no progress, no status lines (errors still print)",
            rich_help_panel=OUTPUT_PANEL,
        ),
    ] = False

    def with_legacy_json_file(self, path: Path | None) -> OutputOptions:
        """bench's old ``--json PATH``: the same as ``--output PATH``."""
        if path is None:
            return self
        if self.output is not None and self.output != path:
            raise UserError("--json PATH is the old name of --output PATH; give one of them")
        say("--json PATH is the old name of --output PATH and goes away in the next release; use --output")
        return replace(self, output=path)

    def with_legacy_json_flag(self, as_json: bool) -> OutputOptions:
        """inspect's old ``--json`` flag: the same as ``--format json``."""
        if not as_json:
            return self
        say("--json is the old name of --format json and goes away in the next release; use --format json")
        return replace(self, format=OutputFormat.json)

    def check(self) -> None:
        """A file --output cannot write fails now, before anything runs."""
        check_writable(self.output, "--output")

    def say(self, message: str) -> None:
        """A status line on stderr, unless --quiet."""
        if not self.quiet:
            say(message)

    @property
    def progress_console(self) -> Console | None:
        """Where progress bars go (stderr, so stdout keeps only results); None: no progress."""
        return None if self.quiet else err


def emit(report: Report, options: OutputOptions) -> None:
    """Print the report as the options ask, and write it to --output."""
    if options.format is OutputFormat.json:
        # Written raw: Rich would wrap long strings inside the JSON.
        out.file.write(report.json_text())
        out.file.flush()
    elif not options.quiet:
        report.render(out)
    if options.output is not None:
        from kvtool.files import write_json_atomically

        write_json_atomically(options.output, json.loads(report.json_text()))
        options.say(f"wrote {options.output}")


def say(message: str) -> None:
    err.print(f"[dim]kvtool:[/dim] {message}", soft_wrap=True, highlight=False)


def print_user_error(exc: UserError) -> None:
    # soft_wrap keeps the sentence on one line whatever the terminal width; markup off: paths may hold [].
    err.print(f"error: {exc.message}", style="bold red", soft_wrap=True, markup=False, highlight=False)
    if exc.details:
        err.print(exc.details, style="dim", soft_wrap=True, markup=False, highlight=False)


def user_errors_exit(command: F) -> F:
    """Expected failures leave as one sentence on stderr and their exit code, Ctrl-C as 130; never a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except UserError as exc:
            print_user_error(exc)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err.print("interrupted", style="bold red", highlight=False)
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper  # type: ignore[return-value]
