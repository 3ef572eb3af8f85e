"""`kvtool model`: generate (once) a random-weight model with its tokenizer and print its directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtool.commands.options import with_options
from kvtool.commands.output import OutputOptions, emit, user_errors_exit
from kvtool.errors import UserError
from kvtool.report import Report


@user_errors_exit
@with_options(output=OutputOptions)
def model_command(
    output: OutputOptions,
    preset: Annotated[
        str,
        typer.Option(
            "--preset",
            help="tiny (2-layer Llama, tests), bench (12-layer Llama, TTFT benchmarks), swa (Gemma3, sliding "
            "window + full attention) or mamba (Granite hybrid, Mamba2 + attention)",
        ),
    ] = "tiny",
    size: Annotated[str | None, typer.Option("--size", help="deprecated name of --preset", hidden=True)] = None,
    path: Annotated[
        Path | None,
        typer.Option(
            "--path",
            help="where to write it \\[default: $KVTOOL_HOME/models/<preset>-<architecture>, e.g. tiny-llama]",
        ),
    ] = None,
) -> None:
    """Generate (once) a random-weight model with its tokenizer and print its directory (with
    --format json: one JSON document, its preset and path)."""
    from kvtool.model import PRESETS, ensure_default_model

    if size is not None:
        if preset not in ("tiny", size):
            raise UserError("--size is the old name of --preset; give one of them")
        output.say("--size is deprecated; use --preset")
        preset = size
    if preset not in PRESETS:
        raise UserError(f"--preset {preset!r} is not one of: {', '.join(PRESETS)}")
    output.check()
    directory = ensure_default_model(path, preset=preset)
    found = {"preset": preset, "path": str(directory)}
    emit(Report([], summary=found, payload=found), output)
