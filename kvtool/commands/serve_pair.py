"""`kvtool serve-pair`: start a master, a producer and a consumer on 127.0.0.1 and keep them running."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvtool.commands.options import with_options
from kvtool.commands.pairoptions import PairOptions
from kvtool.commands.output import check_writable, out, say, user_errors_exit
from kvtool.pair.ready import ReadyFile


@user_errors_exit
@with_options(pair=PairOptions)
def serve_pair_command(
    pair: PairOptions,
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
    supervised like the master; an engine that dies is taken out by the router and the rest serve on.

    A master (or standalone store) that dies or stops answering its health check is killed and started
    again on the same ports, with back-off. Stops everything on Ctrl-C, on SIGTERM or when an engine
    dies (exit 130 for a signal, 1 for a death).
    """
    from kvtool.pair.launch import run_pair
    from kvtool.pair.smoke import run_smoke

    check_writable(ready_file, "--ready-file")  # before a minute of start-up, not after it
    cfg = pair.config(ready_file=ready_file)

    def on_ready(info: ReadyFile) -> None:
        print_pair(info)
        if not smoke:
            say("serving; Ctrl-C stops everything")

    code = run_pair(cfg, say, on_ready, smoke=(lambda info: run_smoke(info, out)) if smoke else None)
    if code:
        raise typer.Exit(code)


def print_pair(info: ReadyFile) -> None:
    table = Table(title="kvtool serve-pair")
    table.add_column("process")
    table.add_column("pid", justify="right")
    table.add_column("address")
    table.add_column("log")
    addresses = {
        "master": f"{info.master} (admin {info.admin})",
        "store": info.store_address or "",
        "producer": info.producer,
        "consumer": info.consumer,
        "router": f"{info.router} ({info.router_policy})",
        **info.engines,
    }
    for name, pid in info.pids.items():
        table.add_row(name, str(pid), addresses.get(name, ""), str(Path(info.log_dir) / f"{name}.log"))
    out.print(table)
    roles = f"{len(info.engines)} engines, kv_both, behind the router" if info.router else info.roles
    out.print(
        f"model: {info.model}\nconnector: {info.connector}  roles: {roles}  "
        f"store: {info.store}  block size: {info.block_size}  hash unit: {info.hash_unit}",
        soft_wrap=True,
        highlight=False,
    )
