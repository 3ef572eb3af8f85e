"""`kvtool inspect`: keys, watermarks, prompt, store. Each takes the same target and output flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from kvtool.commands.options import AdminOpt, MasterOpt, NamespaceOpt, ReadyFileOpt, with_options
from kvtool.commands.output import OutputOptions
from kvtool.commands.output import EXIT_CODES_EPILOG, emit, user_errors_exit

inspect_app = typer.Typer(
    name="inspect",
    help="Look into the store: decoded keys, watermarks, a prompt's boundaries and misses, capacity and evictions.",
    no_args_is_help=True,
)

# inspect's old --json flag, kept (hidden) for scripts: the same as --format json.
LegacyJsonFlag = Annotated[bool, typer.Option("--json", help="old name of --format json", hidden=True)]


def _command(name: str):
    """Register a subcommand with the output flags, one-line errors and the exit-code table."""

    def register(fn):
        command = user_errors_exit(with_options(output_options=OutputOptions)(fn))
        return inspect_app.command(name, epilog=EXIT_CODES_EPILOG)(command)

    return register


@_command("keys")
def keys_command(
    output_options: OutputOptions,
    admin: AdminOpt = None,
    pair: ReadyFileOpt = None,
    kind: Annotated[
        str | None, typer.Option("--kind", help="block, tail, state, pointer, watermark or foreign")
    ] = None,
    namespace: NamespaceOpt = None,
    prefix: Annotated[str | None, typer.Option("--prefix", help="only keys that start with this")] = None,
    limit: Annotated[int, typer.Option("--limit", help="keys per page")] = 200,
    offset: Annotated[int, typer.Option("--offset", help="keys to skip (the previous page's next_offset)")] = 0,
    block_size: Annotated[
        int | None, typer.Option("--block-size", help="to show a tail's valid tokens \\[default: from --pair]")
    ] = None,
    sizes: Annotated[
        bool, typer.Option("--sizes/--no-sizes", help="ask the master for each listed object's size")
    ] = True,
    as_json: LegacyJsonFlag = False,
) -> None:
    """List the store's keys, decoded (kind, namespace, end token or boundary); others are marked foreign."""
    from kvtool.inspect.keys import check_kind, keys_report
    from kvtool.inspect.target import resolve_target

    output = output_options.with_legacy_json_flag(as_json)
    output.check()
    check_kind(kind)
    target = resolve_target(admin, pair)
    report = keys_report(target.store, kind, namespace, prefix, limit, offset, block_size or target.block_size, sizes)
    emit(report, output)


@_command("watermarks")
def watermarks_command(
    output_options: OutputOptions,
    admin: AdminOpt = None,
    pair: ReadyFileOpt = None,
    master: MasterOpt = None,
    namespace: NamespaceOpt = None,
    request_id: Annotated[str | None, typer.Option("--request-id", help="only this request")] = None,
    as_json: LegacyJsonFlag = False,
) -> None:
    """The latest published watermark of every request: durable offset, tail boundary, state."""
    from kvtool.inspect.target import resolve_target
    from kvtool.inspect.watermarks import watermarks_report

    output = output_options.with_legacy_json_flag(as_json)
    output.check()
    emit(watermarks_report(resolve_target(admin, pair, master), namespace, request_id), output)


@_command("prompt")
def prompt_command(
    output_options: OutputOptions,
    admin: AdminOpt = None,
    pair: ReadyFileOpt = None,
    master: MasterOpt = None,
    tokens: Annotated[str | None, typer.Option("--tokens", help="the prompt's token ids, e.g. 1,2,3")] = None,
    text: Annotated[
        str | None, typer.Option("--text", help="the prompt as text (the served model's tokenizer)")
    ] = None,
    file: Annotated[
        Path | None, typer.Option("--file", help="a file of token ids (JSON list or comma/space separated), else text")
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="tokenizer directory for --text \\[default: from --pair]")
    ] = None,
    namespace: NamespaceOpt = None,
    block_size: Annotated[int | None, typer.Option("--block-size", help="\\[default: from --pair]")] = None,
    hash_unit: Annotated[int | None, typer.Option("--hash-unit", help="\\[default: from --pair, else 1]")] = None,
    divergence_grid: Annotated[
        int | None,
        typer.Option(
            "--divergence-grid",
            min=0,
            help="the engines' pointer grid (0: none) \\[default: from --pair, else the connector's, a quarter block]",
        ),
    ] = None,
    cache_salt: Annotated[str | None, typer.Option("--cache-salt", help="the requests' cache_salt, if any")] = None,
    request_id: Annotated[
        list[str] | None,
        typer.Option("--request-id", help="a producer request of this prompt whose watermark to trust (repeatable)"),
    ] = None,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="read and check every stored object")] = True,
    all_boundaries: Annotated[bool, typer.Option("--all-boundaries", help="list every tail boundary")] = False,
    cost: Annotated[
        str | None,
        typer.Option(
            "--cost",
            metavar="LOAD_MS,MB_PER_S,PREFILL_US",
            help='an engine\'s cost model (its "kvtool: cost model" log line): would it take the hit?',
        ),
    ] = None,
    as_json: LegacyJsonFlag = False,
) -> None:
    """Which of a prompt's block and tail keys are stored, the hit a consumer would get now, and why misses miss."""
    from kvtool.inspect.prompt import prompt_report
    from kvtool.inspect.tokens import prompt_tokens
    from kvtool.inspect.target import resolve_target

    output = output_options.with_legacy_json_flag(as_json)
    output.check()
    from kvtool.inspect.cost import parse_cost

    model_costs = parse_cost(cost) if cost is not None else None
    target = resolve_target(admin, pair, master)
    if divergence_grid is not None:
        target = dataclasses.replace(target, divergence_grid=divergence_grid)
    ids = prompt_tokens(tokens, text, file, model or target.model)
    report = prompt_report(
        target, ids, namespace, block_size, hash_unit, cache_salt, request_id or [], verify, all_boundaries, model_costs
    )
    emit(report, output)


@_command("store")
def store_command(
    output_options: OutputOptions,
    admin: AdminOpt = None,
    pair: ReadyFileOpt = None,
    high_watermark: Annotated[
        float | None,
        typer.Option(
            "--eviction-high-watermark", help="the master's --eviction_high_watermark_ratio, if not the default"
        ),
    ] = None,
    as_json: LegacyJsonFlag = False,
) -> None:
    """Capacity, used bytes, key count, evictions and put failures, from the master's metrics."""
    from kvtool.inspect.store import store_report
    from kvtool.inspect.target import resolve_target

    output = output_options.with_legacy_json_flag(as_json)
    output.check()
    emit(store_report(resolve_target(admin, pair).store, high_watermark), output)
