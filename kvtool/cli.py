"""kvtool's command line: the Typer app, built from one module per command (kvtool/commands/)."""

from __future__ import annotations

import signal
import sys

import typer

from kvtool.commands.bench import bench_command
from kvtool.commands.config import config_app
from kvtool.commands.inspect import inspect_app
from kvtool.commands.model import model_command
from kvtool.commands.output import EXIT_CODES_EPILOG, print_user_error
from kvtool.commands.scale import scale_command
from kvtool.commands.serve_pair import serve_pair_command
from kvtool.errors import EXIT_INTERRUPTED, UserError

app = typer.Typer(
    name="kvtool",
    help="Partial-tail KV offload for vLLM over a Mooncake store: serve a producer/consumer pair, bench, inspect.",
    epilog=EXIT_CODES_EPILOG,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
app.command("serve-pair", epilog=EXIT_CODES_EPILOG)(serve_pair_command)
app.command("scale", epilog=EXIT_CODES_EPILOG)(scale_command)
app.command("bench", epilog=EXIT_CODES_EPILOG)(bench_command)
app.command("model", epilog=EXIT_CODES_EPILOG)(model_command)
app.add_typer(inspect_app, name="inspect")
app.add_typer(config_app, name="config")


def _terminate_as_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops a command as Ctrl-C does: what it started is stopped, exit 130


def main() -> None:
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)  # serve-pair installs handlers of its own
    try:
        app()  # standalone: usage errors exit 2
    except UserError as exc:  # raised outside a command, e.g. while parsing
        print_user_error(exc)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:  # outside a command's own handling
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
