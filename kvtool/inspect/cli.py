"""The `kvtool inspect` sub-app: keys, watermarks, prompt, store. Same target and --json flags on each."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import typer

inspect_app = typer.Typer(
    name="inspect",
    help="Look into the store: decoded keys, watermarks, a prompt's boundaries and misses, capacity and evictions.",
    no_args_is_help=True,
)

AdminOpt = Annotated[
    str | None,
    typer.Option("--admin", help="the Mooncake master's admin URL (its --metrics_port), e.g. http://127.0.0.1:9003"),
]
PairOpt = Annotated[
    Path | None, typer.Option("--pair", help="a `kvtool serve-pair --ready-file` to take every address from")
]
MasterOpt = Annotated[
    str | None,
    typer.Option("--master", help="the master's RPC HOST:PORT, to read object bytes \\[default: from --pair]"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]
NamespaceOpt = Annotated[str | None, typer.Option("--namespace", help="a 16-hex kvtool namespace")]


def _show(report, as_json: bool) -> None:
    from kvtool.cli import out

    report.render(out, as_json)


def _command(name: str):
    """Register a subcommand whose expected failures leave as one line (kvtool.cli.user_errors_exit)."""

    def register(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            # Imported at call time: kvtool.cli imports this module to register the sub-app.
            from kvtool.cli import user_errors_exit

            return user_errors_exit(fn)(*args, **kwargs)

        return inspect_app.command(name)(run)

    return register


@_command("keys")
def keys_command(
    admin: AdminOpt = None,
    pair: PairOpt = None,
    kind: Annotated[str | None, typer.Option("--kind", help="block, tail, watermark or foreign")] = None,
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
    as_json: JsonOpt = False,
) -> None:
    """List the store's keys, decoded (kind, namespace, end token or boundary); others are marked foreign."""
    from kvtool.inspect.keys import keys_report
    from kvtool.inspect.target import resolve_target

    target = resolve_target(admin, pair)
    report = keys_report(target.admin, kind, namespace, prefix, limit, offset, block_size or target.block_size, sizes)
    _show(report, as_json)


@_command("watermarks")
def watermarks_command(
    admin: AdminOpt = None,
    pair: PairOpt = None,
    master: MasterOpt = None,
    namespace: NamespaceOpt = None,
    request_id: Annotated[str | None, typer.Option("--request-id", help="only this request")] = None,
    as_json: JsonOpt = False,
) -> None:
    """The latest published watermark of every request: durable offset, tail boundary, state."""
    from kvtool.inspect.target import resolve_target
    from kvtool.inspect.watermarks import watermarks_report

    _show(watermarks_report(resolve_target(admin, pair, master), namespace, request_id), as_json)


@_command("prompt")
def prompt_command(
    admin: AdminOpt = None,
    pair: PairOpt = None,
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
    cache_salt: Annotated[str | None, typer.Option("--cache-salt", help="the requests' cache_salt, if any")] = None,
    request_id: Annotated[
        list[str] | None,
        typer.Option("--request-id", help="a producer request of this prompt whose watermark to trust (repeatable)"),
    ] = None,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="read and check every stored object")] = True,
    all_boundaries: Annotated[bool, typer.Option("--all-boundaries", help="list every tail boundary")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Which of a prompt's block and tail keys are stored, the hit a consumer would get now, and why misses miss."""
    from kvtool.inspect.prompt import prompt_report, prompt_tokens
    from kvtool.inspect.target import resolve_target

    target = resolve_target(admin, pair, master)
    ids = prompt_tokens(tokens, text, file, model or target.model)
    report = prompt_report(
        target, ids, namespace, block_size, hash_unit, cache_salt, request_id or [], verify, all_boundaries
    )
    _show(report, as_json)


@_command("store")
def store_command(
    admin: AdminOpt = None,
    pair: PairOpt = None,
    high_watermark: Annotated[
        float | None,
        typer.Option(
            "--eviction-high-watermark", help="the master's --eviction_high_watermark_ratio, if not the default"
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Capacity, used bytes, key count, evictions and put failures, from the master's metrics."""
    from kvtool.inspect.store import store_report
    from kvtool.inspect.target import resolve_target

    _show(store_report(resolve_target(admin, pair).admin, high_watermark), as_json)
