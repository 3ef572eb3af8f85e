"""Errors that kvtool's CLI turns into one sentence on stderr and an exit code."""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# What every command's exit status means; shown in each command's --help and in the README.
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "ok (a bench's answer mismatches are in its results, not in the exit code)"),
    (EXIT_RUNTIME, "a server or the store failed, died or was unreachable (bench --compare: a connector's run)"),
    (EXIT_USAGE, "bad input (a flag, a file, a workload), refused before a pair starts or a store is asked"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C or SIGTERM); what the command started is stopped first"),
)


class UserError(Exception):
    """Something the user can fix: the message says what is wrong and what to do.

    Printed as is (no traceback); exit_code 2 for bad input, 1 for a failed run.
    """

    def __init__(self, message: str, exit_code: int = EXIT_USAGE, details: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        # Extra lines (e.g. a log's tail) shown below the message; empty for plain usage errors.
        self.details = details


class ServerError(UserError):
    """A process kvtool started failed or died; the message points at its log."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message, exit_code=EXIT_RUNTIME, details=details)
