"""`kvtool bench`: replay seeded workloads on a pair and report reuse against an ideal oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtool.commands.options import OutputOptions, with_options
from kvtool.commands.pairoptions import PairOptions
from kvtool.commands.output import check_writable, emit, user_errors_exit


@user_errors_exit
@with_options(pair_options=PairOptions, output_options=OutputOptions)
def bench_command(
    pair_options: PairOptions,
    output_options: OutputOptions,
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
            help="sub-block, cross-block, shared-prefix, multi-turn, chat, max-tokens-1, prefix-repetition or "
            "trace:PATH; repeat for several \\[default: sub-block]",
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
    plot: Annotated[Path | None, typer.Option("--plot", help="write a PNG: hits vs ideal, TTFT by connector")] = None,
    trace_block_tokens: Annotated[int, typer.Option(help="tokens one 512-token trace block becomes")] = 16,
    trace_start: Annotated[int, typer.Option(help="first trace line to replay (0-based)")] = 0,
    trace_requests: Annotated[int | None, typer.Option(help="trace requests to replay \\[default: --requests]")] = None,
    prefix_len: Annotated[int, typer.Option(help="prefix-repetition: tokens of each shared prefix")] = 80,
    suffix_len: Annotated[int, typer.Option(help="prefix-repetition: tokens after the prefix")] = 24,
    num_prefixes: Annotated[int, typer.Option(help="prefix-repetition: distinct prefixes")] = 2,
    quiet_s: Annotated[
        float,
        typer.Option(help="seconds from one request's end to the next one's start, durability wait included"),
    ] = 1.5,
) -> None:
    """Replay seeded workloads on a producer/consumer pair and report reuse against an ideal oracle.

    Reports per workload and prompt-length bucket: prompt, ideal and hit tokens (block and tail), hit
    rate, efficiency (hit / ideal), consumer TTFT, and answers that differ from a recomputation.
    """
    from kvtool.bench.command import check_bench_input, parse_compare, run_bench
    from kvtool.bench.config import BenchConfig
    from kvtool.bench.report import bench_report

    # Every input is checked before a pair is read, reached or started.
    output = output_options.with_legacy_json_file(json_path)
    output.check()
    check_writable(plot, "--plot")
    compared = parse_compare(compare)
    config = BenchConfig.from_options(
        workloads=tuple(workload or ("sub-block",)), requests=requests, max_tokens=max_tokens, seed=seed,
        verify=verify, tolerance=tolerance, quiet_s=quiet_s, interleave=interleave,
        trace_block_tokens=trace_block_tokens, trace_start=trace_start, trace_requests=trace_requests,
        prefix_len=prefix_len, suffix_len=suffix_len, num_prefixes=num_prefixes,
    )  # fmt: skip
    check_bench_input(config, ready_file, launch, compared)
    launch_cfg = pair_options.config(report=output.say) if launch else None

    outcome = run_bench(config, output.say, ready_file, launch_cfg, compared, output.progress_console)
    emit(bench_report(outcome.document), output)
    if plot is not None:
        from kvtool.bench.plot import write_plot

        write_plot(plot, outcome.reports)
        output.say(f"wrote {plot}")
    failure = outcome.failure_error()
    if failure is not None:
        raise failure
