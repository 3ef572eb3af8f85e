"""Where a command's output goes: results on stdout (a table, or JSON), everything else on stderr,
expected failures as one sentence and an exit code (kvtool.errors.EXIT_CODES)."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from rich.console import Console

from kvtool.errors import EXIT_CODES, EXIT_INTERRUPTED, UserError
from kvtool.report import Report

if TYPE_CHECKING:
    from kvtool.commands.options import OutputOptions

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
