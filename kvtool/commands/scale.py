"""`kvtool scale`: add engines to a serving fleet, or take some away, while it serves."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from kvtool.commands.options import with_options
from kvtool.commands.output import OutputOptions, emit, user_errors_exit
from kvtool.errors import EXIT_RUNTIME, UserError
from kvtool.report import Report, ReportTable

POLL_S = 0.5
PICKUP_S = 30.0  # a fleet reads requests every half second: this long unanswered, it does not


@user_errors_exit
@with_options(output=OutputOptions)
def scale_command(
    output: OutputOptions,
    pair: Annotated[
        Path,
        typer.Option("--pair", help="the ready file of the fleet (serve-pair --engines N --ready-file PATH)"),
    ],
    engines: Annotated[int, typer.Option("--engines", help="how many engines the fleet should have", min=1)],
    timeout_s: Annotated[
        float,
        typer.Option(
            "--timeout",
            help="seconds to wait for the fleet to get there (an engine added starts, warms up with the store, then "
            "joins the router's rotation; one that leaves finishes what it holds first)",
            min=1,
        ),
    ] = 1200.0,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="wait for the outcome, or only ask")] = True,
) -> None:
    """Scale a serving fleet to --engines N: engines are added on their own ports and join the router's
    rotation once warm, or the last ones leave it, finish their requests and stop. The fleet says how it
    went in its ready file (``scaling``); this command waits for that and prints it."""
    from kvtool.pair.ready import read_ready_file
    from kvtool.pair.scale import withdraw_scale_request, write_scale_request

    output.check()
    info = read_ready_file(pair)
    if info.router is None or info.log_dir is None:
        raise UserError(f"{pair} is a producer / consumer pair's; only a fleet scales (serve-pair --engines N)")
    request = write_scale_request(Path(info.log_dir), engines)
    output.say(f"asked the fleet behind {info.router} for {engines} engine(s)")
    if not wait:
        emit(Report([], summary={"request": request.id, "engines": engines, "state": "asked"}), output)
        return
    began = time.monotonic()
    deadline = began + timeout_s
    while True:
        if not pair.exists():
            raise UserError(f"the fleet stopped ({pair} is gone) before it scaled", exit_code=EXIT_RUNTIME)
        info = read_ready_file(pair)
        state = info.scaling
        taken = state is not None and state.request == request.id
        if taken and state.state != "working":
            break
        if not taken and time.monotonic() - began > PICKUP_S:
            withdraw_scale_request(Path(info.log_dir), request)
            raise UserError(
                f"the fleet behind {info.router} did not take the request within {PICKUP_S:g} s (one started by a "
                "kvtool without kvtool scale, or one busy with an earlier request); nothing was changed",
                exit_code=EXIT_RUNTIME,
            )
        if time.monotonic() > deadline:
            raise UserError(
                f"the fleet did not scale to {engines} engine(s) within {timeout_s:g} s; it goes on trying: "
                f"see {Path(info.log_dir or '.') / 'supervisor.log'}",
                exit_code=EXIT_RUNTIME,
            )
        time.sleep(POLL_S)
    rows = [{"engine": name, "url": url, "pid": info.pids.get(name)} for name, url in sorted(info.engines.items())]
    summary = {"engines": engines, "state": state.state, "message": state.message}
    payload = {**summary, "request": request.id, "router": info.router, "serving": rows}
    emit(
        Report([ReportTable("engines in the router's rotation", ["engine", "url", "pid"], rows)], summary, [], payload),
        output,
    )
    if state.state == "failed":
        raise UserError(f"the fleet did not scale: {state.message}", exit_code=EXIT_RUNTIME)
