"""`kvtool serve-pair`: start a master, a producer and a consumer on 127.0.0.1 and keep them running."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.commands.options import with_options
from kvtool.commands.output import OutputOptions, check_writable, emit, user_errors_exit
from kvtool.commands.pairoptions import PairOptions
from kvtool.pair.ready import ReadyFile
from kvtool.report import Report, ReportTable


@user_errors_exit
@with_options(pair=PairOptions, output=OutputOptions)
def serve_pair_command(
    pair: PairOptions,
    output: OutputOptions,
    ready_file: Annotated[
        Path | None,
        typer.Option(help="once all are healthy, write their addresses here as JSON; removed on exit"),
    ] = None,
    smoke: Annotated[
        bool, typer.Option("--smoke", help="run one producer-then-consumer check, print it, stop")
    ] = False,
) -> None:
    """Start a Mooncake master, a producer and a consumer vLLM server on 127.0.0.1 and keep them running.

    With --engines N, a fleet instead: N vLLM engines (each kv_both) behind vLLM's router, which is
    supervised like the master; an engine that dies is taken out of the router's rotation, started
    again and put back once warm, while the rest serve on.

    A master (or standalone store) that dies or stops answering its health check is killed and started
    again on the same ports, with back-off. Stops everything on Ctrl-C, on SIGTERM or when an engine
    dies (exit 130 for a signal, 1 for a death). With --format json, stdout holds one JSON document:
    the ready file's content once all are healthy (with --smoke, and the smoke check's exchanges).
    """
    from kvtool.pair.launch import run_pair
    from kvtool.pair.smoke import run_smoke

    output.check()
    check_writable(ready_file, "--ready-file")  # before a minute of start-up, not after it
    cfg = pair.config(ready_file=ready_file, report=output.say)

    def on_ready(info: ReadyFile) -> None:
        if not smoke:  # with --smoke the report comes once the check is done
            emit(pair_report(info), output)
            output.say("serving; Ctrl-C stops everything")

    def smoke_check(info: ReadyFile) -> None:
        emit(pair_report(info, run_smoke(info)), output)

    code = run_pair(cfg, output.say, on_ready, smoke=smoke_check if smoke else None)
    if code:
        raise typer.Exit(code)


def pair_report(info: ReadyFile, smoke: list[dict[str, Any]] | None = None) -> Report:
    """The pair's processes (a row each: pid, address, log) and its settings; the JSON is the ready
    file's content, under ``pair``, with ``smoke``'s exchanges where the check ran."""
    from kvtool.pair.smoke import smoke_table

    addresses = {
        "master": f"{info.master} (admin {info.admin})",
        "store": info.store_address or "",
        "producer": info.producer,
        "consumer": info.consumer,
        "router": f"{info.router} ({info.router_policy})",
        **info.engines,
    }
    rows = [
        {
            "process": name,
            "pid": pid,
            "address": addresses.get(name, ""),
            "log": str(Path(info.log_dir or ".") / f"{name}.log"),
        }
        for name, pid in info.pids.items()
    ]
    tables = [ReportTable("kvtool serve-pair", ["process", "pid", "address", "log"], rows)]
    if smoke is not None:
        tables.append(smoke_table(info, smoke))
    roles = f"{len(info.engines)} engines, kv_both, behind the router" if info.router else info.roles
    summary = {
        "model": info.model,
        "connector": info.connector,
        "roles": roles,
        "store": info.store,
        "block_size": info.block_size,
        "hash_unit": info.hash_unit,
    }
    payload = {"pair": info.to_json(), **({"smoke": smoke} if smoke is not None else {})}
    return Report(tables, summary=summary, payload=payload)
