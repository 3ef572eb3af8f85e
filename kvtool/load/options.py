"""The load test's flags (``LoadOptions``, a group of Typer options bench takes) and what one
connector's run gives (``LoadResult``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.errors import UserError

from .churn import Churn
from .join import Join
from .metrics import LoadSummary
from .runner import LoadRun
from .sessions import LOAD_WORKLOADS, TraceLoad

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
            "each turn adds the answer and a tool result) or chat sessions, many in flight, or trace:PATH (a "
            "Mooncake trace at its timestamps, --sessions of its requests from --trace-start, scaled by "
            "--trace-block-tokens and --time-scale); requests go to a fleet's router (serve-pair --engines) or "
            "a pair's consumer",
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
    sweep_rates: Annotated[
        str | None,
        _load(
            "a sweep: session arrival rates a second, comma-separated (for example 0.1,0.2,0.4), each run in turn "
            "on each pair or fleet with fresh sessions (open loop); one report row per connector and rate, and "
            "with --plot the TTFT p99 against the request rate",
            "--sweep-rates",
        ),
    ] = None
    time_scale: Annotated[
        float, _load("--load trace:PATH: the trace's arrival times multiplied by this (10: a tenth of its rate)")
    ] = 1.0
    kill_engine_after: Annotated[
        float | None,
        _load(
            "a fleet's churn: kill one engine (SIGKILL, the fleet's last) this many seconds into the load; the "
            "report adds TTFT before, while it is down (serve-pair restarts it, it rejoins once warm) and after",
            "--kill-engine-after",
        ),
    ] = None
    add_engine_after: Annotated[
        float | None,
        _load(
            "a fleet scaled out: ask it for one engine more (as kvtool scale does) this many seconds into the load; "
            "the report adds TTFT before, while it starts and warms up, and once it is in the router's rotation",
            "--add-engine-after",
        ),
    ] = None

    @property
    def workload(self) -> str:
        """The workload's name: agentic, chat or trace (of trace:PATH)."""
        return (self.load or "").split(":", 1)[0]

    def trace_load(self, start: int, block_tokens: int) -> TraceLoad | None:
        """``--load trace:PATH`` with bench's --trace-start and --trace-block-tokens; None for a session
        workload."""
        if self.workload != "trace":
            return None
        path = Path((self.load or "").split(":", 1)[1])
        return TraceLoad(path, start=start, block_tokens=block_tokens, time_scale=self.time_scale)

    def rates(self) -> list[float | None]:
        """The session rates to run in turn: the sweep's, else the one of ``--session-rate`` (None: a closed
        loop)."""
        if self.sweep_rates is None:
            return [self.session_rate]
        return [_rate(text) for text in self.sweep_rates.split(",")]

    def check(self) -> None:
        """The flags' values, checked before any pair is read or started; a UserError naming the flag."""
        if self.workload not in LOAD_WORKLOADS or (self.workload == "trace") != (":" in (self.load or "")):
            raise UserError(f"--load {self.load!r} is not one of: agentic, chat, trace:PATH (a Mooncake trace)")
        if not self.time_scale > 0 or self.time_scale == float("inf"):
            raise UserError(f"--time-scale {self.time_scale:g} must be a number above 0")
        if self.workload == "trace" and (self.session_rate is not None or self.sweep_rates is not None):
            raise UserError(
                "--load trace:PATH sends at the trace's timestamps: leave --session-rate and --sweep-rates out"
            )
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
        if self.kill_engine_after is not None:
            if not self.kill_engine_after > 0:
                raise UserError(f"--kill-engine-after {self.kill_engine_after:g} must be more than 0 (seconds)")
            if self.sweep_rates is not None:
                raise UserError("--kill-engine-after kills one engine in one run: leave --sweep-rates out")
        if self.add_engine_after is not None:
            if not self.add_engine_after > 0:
                raise UserError(f"--add-engine-after {self.add_engine_after:g} must be more than 0 (seconds)")
            if self.sweep_rates is not None or self.kill_engine_after is not None:
                raise UserError(
                    "--add-engine-after adds one engine in one run: leave --sweep-rates and --kill-engine-after out"
                )
        if self.sweep_rates is not None:
            if self.session_rate is not None:
                raise UserError("--sweep-rates sets each run's session rate: leave --session-rate out")
            rates = self.rates()
            if len(set(rates)) != len(rates):
                raise UserError(f"--sweep-rates {self.sweep_rates!r} names a rate twice: give each rate once")


def _rate(text: str) -> float:
    """One rate of ``--sweep-rates``; a UserError naming it where it is not a number above 0."""
    try:
        rate = float(text)
    except ValueError:
        rate = float("nan")
    if not rate > 0 or rate == float("inf"):
        raise UserError(f"--sweep-rates: {text.strip()!r} is not a rate above 0 (sessions a second, for example 0.2)")
    return rate


@dataclass(frozen=True)
class LoadResult:
    connector: str
    fleet: dict[str, Any]
    summary: LoadSummary
    run: LoadRun
    store_keys: float | None
    session_rate: float | None = None  # the run's session arrival rate (None: a closed loop)
    churn: Churn | None = None  # --kill-engine-after: the engine killed, when it left and rejoined
    phases: list[dict[str, Any]] | None = None  # ... and each phase's TTFT (kvtool.load.churn), or --add-engine-after's
    join: Join | None = None  # --add-engine-after: when the engine was asked for and when it joined

    @property
    def sent_rate(self) -> float | None:
        """Requests sent a second, first send to last: the load the run offered (a sweep's x axis)."""
        sent = sorted(record.sent_s for record in self.run.records)
        if len(sent) < 2 or sent[-1] <= sent[0]:
            return None
        return (len(sent) - 1) / (sent[-1] - sent[0])
