"""The load test's flags (``LoadOptions``, a group of Typer options bench takes) and what one
connector's run gives (``LoadResult``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import typer

from kvtool.errors import UserError

from .metrics import LoadSummary
from .runner import LoadRun
from .sessions import LOAD_WORKLOADS

LOAD_PANEL = "Load test (--load)"


def _load(help_text: str, *names: str) -> Any:
    return typer.Option(*names, help=help_text, rich_help_panel=LOAD_PANEL)


@dataclass(frozen=True)
class LoadOptions:
    """The load test's flags; ``--max-tokens`` (each answer), ``--seed``, ``--tolerance`` and
    ``--compare`` are bench's own."""

    load: Annotated[
        str | None,
        _load(
            "a load test instead of the one-request-at-a-time replay: agentic (a shared system-and-tools prompt, "
            "each turn adds the answer and a tool result) or chat sessions, many in flight; requests go to a "
            "fleet's router (serve-pair --engines) or a pair's consumer",
            "--load",
        ),
    ] = None
    sessions: Annotated[int, _load("sessions in the run")] = 12
    concurrency: Annotated[int, _load("sessions in flight at most (closed loop: always this many)")] = 4
    session_rate: Annotated[
        float | None, _load("open loop: sessions arrive at this Poisson rate a second \\[default: closed loop]")
    ] = None
    think_s: Annotated[float, _load("mean think time between a session's turns, seconds (exponential)")] = 1.0
    duration: Annotated[float, _load("no turn starts after this many seconds")] = 600.0
    slo_ttft_ms: Annotated[float, _load("the TTFT objective goodput counts against, ms")] = 2000.0
    check_every: Annotated[
        int, _load("every n-th answer is checked against a recomputation after the load (0: none)")
    ] = 10

    def check(self) -> None:
        """The flags' values, checked before any pair is read or started; a UserError naming the flag."""
        if self.load not in LOAD_WORKLOADS:
            raise UserError(f"--load {self.load!r} is not one of: {', '.join(LOAD_WORKLOADS)}")
        for flag, value, least in (
            ("--sessions", self.sessions, 1),
            ("--concurrency", self.concurrency, 1),
            ("--check-every", self.check_every, 0),
        ):
            if value < least:
                raise UserError(f"{flag} {value} must be at least {least}")
        if self.think_s < 0:
            raise UserError(f"--think-s {self.think_s:g} must be 0 or more")
        for flag, number in (("--duration", self.duration), ("--slo-ttft-ms", self.slo_ttft_ms)):
            if number <= 0:
                raise UserError(f"{flag} {number:g} must be more than 0")
        if self.session_rate is not None and self.session_rate <= 0:
            raise UserError(f"--session-rate {self.session_rate:g} must be more than 0 (leave it out: a closed loop)")


@dataclass(frozen=True)
class LoadResult:
    connector: str
    fleet: dict[str, Any]
    summary: LoadSummary
    run: LoadRun
    store_keys: float | None
