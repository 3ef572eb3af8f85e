"""`kvtool config`: check a configuration file before deploying it, and show what the connector runs with."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.commands.options import with_options
from kvtool.commands.output import OutputOptions
from kvtool.commands.pairoptions import PairOptions
from kvtool.commands.output import EXIT_CODES_EPILOG, check_writable, emit, user_errors_exit
from kvtool.errors import UserError
from kvtool.files import write_json_atomically
from kvtool.report import Report, ReportTable

config_app = typer.Typer(
    name="config",
    help="Check a configuration file (connector, Mooncake client, pair) and show the connector's effective config.",
    no_args_is_help=True,
)

KindOpt = Annotated[
    str | None,
    typer.Option(
        "--kind",
        help="connector (--kv-transfer-config JSON), extra (its kv_connector_extra_config alone), mooncake "
        "(MOONCAKE_CONFIG_PATH JSON) or pair (serve-pair --config TOML) \\[default: told from the file]",
    ),
]
FileArg = Annotated[Path, typer.Argument(help="the configuration file", show_default=False)]


def _register(name: str):
    def register(fn):
        command = user_errors_exit(with_options(output_options=OutputOptions)(fn))
        return config_app.command(name, epilog=EXIT_CODES_EPILOG)(command)

    return register


def _checked(path: Path, kind: str | None):
    from kvtool.configfile import CONFIG_KINDS, check_config_file

    if kind is not None and kind not in CONFIG_KINDS:
        raise UserError(f"--kind {kind!r} is not one of: {', '.join(CONFIG_KINDS)}")
    checked = check_config_file(path, kind)  # type: ignore[arg-type]
    pair = PairOptions(config_file=path).with_file() if checked.kind == "pair" else None
    if pair is not None:
        _check_pair(path, pair)
    return checked, pair


def _check_pair(path: Path, pair: PairOptions) -> None:
    """What serve-pair would refuse before starting anything, without its I/O (ports in use, a master
    to reach): the pair configuration's values, and the model directory where the file names one."""
    from kvtool.pair.preflight import check_model, check_values

    try:
        cfg = pair.config(generate_model=False, report=lambda _: None, file_hint=False)
        check_values(cfg)
        if pair.model is not None:
            check_model(cfg)
    except UserError as exc:
        message = exc.message if exc.message.startswith(str(path)) else f"{path}: {exc.message}"
        raise UserError(message) from None


@_register("validate")
def validate_command(output_options: OutputOptions, file: FileArg, kind: KindOpt = None) -> None:
    """Check FILE as the component that reads it would: a bad field is named with what it accepts (exit 2)."""
    output_options.check()
    checked, _ = _checked(file, kind)
    rows = [{"file": str(file), "kind": checked.kind, "fields": len(checked.content), "verdict": "valid"}]
    payload = {"file": str(file), "kind": checked.kind, "valid": True, "notes": list(checked.notes)}
    notes: list[Any] = list(checked.notes)
    emit(
        Report(
            [ReportTable("kvtool config validate", ["file", "kind", "fields", "verdict"], rows)],
            notes=notes,
            payload=payload,
        ),
        output_options,
    )


@config_app.command("show", epilog=EXIT_CODES_EPILOG)
@user_errors_exit
def show_command(
    file: Annotated[
        Path | None, typer.Argument(help="a connector, extra, Mooncake or pair file", show_default=False)
    ] = None,
    kind: KindOpt = None,
    output: Annotated[Path | None, typer.Option("--output", help="also write the JSON to this file")] = None,
) -> None:
    """The kvtool connector's effective configuration as JSON, every default filled in: from FILE, or the
    defaults. For a pair file, the pair and what each of its engines gets (its --kv-transfer-config).
    MOONCAKE_CONFIG_PATH, where set, fills in the store's fields the file leaves out, as in the engine."""
    from kvtool.configfile import effective_connector_json

    if output is not None:
        check_writable(output, "--output")
    if file is None:
        from connector.config import load_config

        defaults = load_config({"master_server_address": "127.0.0.1:50051"})
        payload: dict[str, Any] = {"connector": effective_connector_json(defaults)}
    else:
        checked, pair = _checked(file, kind)
        if pair is not None:
            payload = _pair_payload(pair)
        elif checked.connector is not None:
            payload = {"connector": effective_connector_json(checked.connector), "notes": list(checked.notes)}
        else:
            payload = {"kv_transfer_config": checked.content, "notes": list(checked.notes)}
    text = Report([], payload=payload).json_text()
    typer.echo(text, nl=False)
    if output is not None:
        write_json_atomically(output, payload)


def _pair_payload(pair: PairOptions) -> dict[str, Any]:
    from connector.config import load_config
    from kvtool.configfile import effective_connector_json
    from kvtool.pair.engines import kv_transfer_config

    cfg = pair.config(generate_model=False)
    engines: dict[str, Any] = {}
    for role in cfg.engine_names:
        transfer = kv_transfer_config(cfg, role)
        engines[role] = {"kv_transfer_config": transfer}
        if transfer is not None and "kv_connector_module_path" in transfer:
            engines[role]["connector"] = effective_connector_json(load_config(transfer["kv_connector_extra_config"]))
    return {"pair": cfg.model_dump(mode="json"), "engines": engines}
