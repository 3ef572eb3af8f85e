"""`kvtool bench`: replay seeded workloads on a pair and report reuse against an ideal oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtool.commands.options import with_options
from kvtool.commands.output import OutputOptions
from kvtool.commands.pairoptions import PairOptions
from kvtool.commands.output import check_writable, user_errors_exit
from kvtool.bench.flags import WorkloadFlags
from kvtool.bench.workloads import workload_names
from kvtool.load.options import LoadOptions


@user_errors_exit
@with_options(
    pair_options=PairOptions, output_options=OutputOptions, load_options=LoadOptions, workload_flags=WorkloadFlags
)
def bench_command(
    pair_options: PairOptions,
    output_options: OutputOptions,
    load_options: LoadOptions,
    workload_flags: WorkloadFlags,
    ready_file: Annotated[
        Path | None, typer.Option("--pair", help="ready file of a running kvtool serve-pair (its --ready-file)")
    ] = None,
    launch: Annotated[
        bool, typer.Option("--launch", help="start a pair with the pair flags below, run, and stop it")
    ] = False,
    workload: Annotated[
        list[str] | None,
        typer.Option(
            "--workload",
            "-w",
            help=f"{', '.join(workload_names())}; repeat for several \\[default: sub-block]",
        ),
    ] = None,
    requests: Annotated[int, typer.Option(help="consumer requests per workload")] = 8,
    max_tokens: Annotated[int, typer.Option(help="tokens each consumer request generates")] = 8,
    seed: Annotated[int, typer.Option(help="seed of every workload")] = 0,
    verify: Annotated[
        bool, typer.Option(help="compare every consumer answer with a recomputation (tokens and top-5 logprobs)")
    ] = True,
    tolerance: Annotated[float, typer.Option(help="largest |logprob difference| a matching answer may have")] = 1e-3,
    compare: Annotated[
        str | None,
        typer.Option(help="run the same workload on each of these connectors (comma-separated; needs --launch)"),
    ] = None,
    interleave: Annotated[
        bool, typer.Option(help="with --compare: every pair at once, each step sent to each pair in turn")
    ] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="old name of --output", hidden=True)] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="write a PNG: hits vs ideal and TTFT by connector; with --sweep-rates, TTFT p99 by request rate",
        ),
    ] = None,
    quiet_s: Annotated[
        float,
        typer.Option(help="seconds from one request's end to the next one's start, durability wait included"),
    ] = 1.5,
) -> None:
    """Replay seeded workloads on a producer/consumer pair and report reuse against an ideal oracle.

    Reports per workload and prompt-length bucket: prompt, ideal and hit tokens (block and tail), hit
    rate, efficiency (hit / ideal), consumer TTFT, and answers that differ from a recomputation.
    """
    from kvtool.bench.command import parse_compare, replay
    from kvtool.bench.config import BenchConfig

    # Every input is checked before a pair is read, reached or started.
    output = output_options.with_legacy_json_file(json_path)
    output.check()
    check_writable(plot, "--plot")
    compared = parse_compare(compare)
    if load_options.load is not None:  # a load test: sessions in flight (kvtool/load/)
        from kvtool.load.command import load_command

        bench = {"max_tokens": max_tokens, "seed": seed, "tolerance": tolerance}
        bench |= {"trace_start": workload_flags.trace_start, "trace_block_tokens": workload_flags.trace_block_tokens}
        return load_command(load_options, output, pair_options, ready_file, launch, compared, plot, **bench)
    config = BenchConfig.from_options(
        workloads=tuple(workload or ("sub-block",)),
        requests=requests,
        max_tokens=max_tokens,
        seed=seed,
        verify=verify,
        tolerance=tolerance,
        quiet_s=quiet_s,
        interleave=interleave,
        **workload_flags.__dict__,
    )
    replay(config, output, pair_options, ready_file, launch, compared, plot)
