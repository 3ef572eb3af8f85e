"""The flags that describe a pair or a fleet (serve-pair, bench --launch), as ``PairOptions``: a
dataclass of Typer options (``kvtool.commands.options.with_options``) that a ``--config`` file may fill
in, and that makes the one ``ServePairConfig`` the launch builds on.

Most flags are ``ServePairConfig``'s own fields, declared there once with their type, default and help
(``kvtool.pair.config.flag``) and turned into options here (``_field_flags``); a field that is a
``Literal`` is a string flag whose value ``check`` holds to the Literal's choices (one sentence, from
the command line or a ``--config`` file alike).
What is left here are the flags of another shape than their field (``_ShapedFlags``): a model by path
or by preset, a master to use instead of one kvtool starts, sizes in MiB, a port per engine, the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import typer

from kvtool.commands.output import say
from kvtool.errors import UserError
from kvtool.pair.config import MiB, ServePairConfig, StoreChoice, flag_fields

# ---- the pair: serve-pair and bench --launch ------------------------------------------------

PAIR_PANEL = "Pair (serve-pair, bench --launch)"
STORE_CHOICES = get_args(StoreChoice)


# The pair configuration's fields that a flag of another name sets (in other units).
_FLAG_OF_FIELD = {
    "segment_bytes": "--segment-mib",
    "startup_timeout_s": "--startup-timeout",
    "external_master": "--master",
    "engine_ports": "--engine-port",
}
_NOT_IN_FILES = frozenset({"config_file", "model_size", "fault_control_file"})  # flags a pair file cannot set
_PATH_FIELDS = frozenset({"model", "log_dir"})  # relative to the file's directory


def _pair(help_text: str, *names: str, hidden: bool = False) -> Any:
    return typer.Option(*names, help=help_text, rich_help_panel=PAIR_PANEL, hidden=hidden)


@dataclass(frozen=True)
class _ShapedFlags:
    """The pair's flags whose shape is not their ``ServePairConfig`` field's; with the fields' own flags
    (``PairOptions``), ``config`` makes the ServePairConfig."""

    model: Annotated[
        Path | None,
        _pair("Hugging Face model directory \\[default: a generated random-weight Llama, see --model-preset]"),
    ] = None
    model_preset: Annotated[
        str,
        _pair(
            "model generated when --model is not given: tiny (2 layers, tests), bench (12 layers, TTFT), long "
            "(bench's shape, 16k positions: long prompts), swa "
            "(Gemma3-style sliding window + full attention) or mamba (GraniteMoeHybrid-style Mamba2 + attention)"
        ),
    ] = "tiny"
    model_size: Annotated[str | None, _pair("deprecated name of --model-preset", "--model-size", hidden=True)] = None
    master: Annotated[
        str | None,
        _pair(
            "HOST:PORT of a running mooncake_master to use instead of starting one, or etcd://HOST:PORT[;...] of a "
            "master group in high-availability mode (not supervised)"
        ),
    ] = None
    take_every_hit: Annotated[
        bool | None,
        _pair(
            "kvtool connector: take every hit (--take-every-hit), or only hits whose load its cost model predicts "
            "to cost less than the prefill they save (--skip-unprofitable-loads) \\[default: take every hit on the "
            "tiny, swa and mamba models, whose prefill costs microseconds a token, so that reuse shows; judge on "
            "the bench and long models and with --model]",
            "--take-every-hit/--skip-unprofitable-loads",
        ),
    ] = None
    store: Annotated[
        str | None,
        _pair(
            "embedded: each engine lends 256 MiB of segment memory to the store (stored KV dies with its "
            "engine); standalone: a separate mooncake_client process holds 1 GiB and the engines lend none, "
            "so stored KV outlives a producer restart \\[default: embedded for the pair, standalone for a fleet: "
            "there every engine would serve the others' transfers from its own segment, on its own cores]"
        ),
    ] = None
    log_dir: Annotated[
        Path | None, _pair("where the processes' logs go \\[default: ./logs/serve-pair-<timestamp>]")
    ] = None
    segment_mib: Annotated[
        int,
        _pair("store memory each engine lends with --store embedded, MiB (a small one puts the store under pressure)"),
    ] = ServePairConfig.model_fields["segment_bytes"].default // MiB
    startup_timeout: Annotated[float, _pair("seconds to wait for both servers to be healthy")] = (
        ServePairConfig.model_fields["startup_timeout_s"].default
    )
    config_file: Annotated[
        Path | None,
        _pair(
            "a pair config file (TOML: these flags by name, e.g. configs/cpu-demo/pair.toml); flags given on the "
            "command line win over it, its relative paths are relative to it",
            "--config",
        ),
    ] = None
    engine_port: Annotated[
        list[int] | None,
        _pair("a fleet engine's port, once per engine, in order \\[default: --producer-port + the engine's index]"),
    ] = None

    @property
    def chosen_store(self) -> str:
        """--store, or its default: a fleet's engines lend nothing (benchmarks/fleet: with the engines'
        segments a 3-engine fleet's TTFT p50 was 2.3x no connector's, with a standalone store 0.7x)."""
        if self.store is not None:
            return self.store
        return "standalone" if self.engines > 0 and self.connector != "none" else "embedded"

    @property
    def preset(self) -> str:
        return self.model_size if self.model_size is not None else self.model_preset

    def with_file(self, given: set[str] = frozenset()) -> Any:  # type: ignore[assignment]
        """These options with the ``--config`` file's fields filled in, except those in ``given`` (flags
        given on the command line win); a UserError naming a bad field."""
        if self.config_file is None:
            return self
        from pydantic import TypeAdapter, ValidationError

        from kvtool.files import read_config_file

        path = self.config_file
        content = read_config_file(path)
        names = [item.name for item in fields(self) if item.name not in _NOT_IN_FILES]
        values: dict[str, Any] = {}
        for key, value in content.items():
            name = key.replace("-", "_")
            if name not in names:
                accepted = ", ".join(n.replace("_", "-") for n in names)
                raise UserError(f"{path}: unknown field {key!r} (accepted: {accepted})")
            if name not in given:
                values[name] = str(path.parent / value) if name in _PATH_FIELDS and isinstance(value, str) else value
        merged = {**{item.name: getattr(self, item.name) for item in fields(self)}, **values}
        try:
            options = TypeAdapter(type(self)).validate_python(merged)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise UserError(f"{path}: field {str(first['loc'][0]).replace('_', '-')!r}: {first['msg']}") from None
        try:
            options.check()
        except UserError as exc:
            raise UserError(f"{path}: {exc.message}") from None
        return options

    def check(self) -> None:
        """The flags' values, checked without any I/O; a UserError naming the flag."""
        from kvtool.model import PRESETS

        if self.max_num_batched_tokens is not None and self.model is None and self.preset == "mamba":
            raise UserError("--max-num-batched-tokens: the mamba preset prefills in chunks of its Mamba block (64)")
        if self.model_size is not None and self.model_preset not in ("tiny", self.model_size):
            raise UserError("--model-size is the old name of --model-preset; give one of them")
        choices = {"model-preset": (self.preset, tuple(PRESETS)), "store": (self.chosen_store, STORE_CHOICES)}
        choices.update({name.replace("_", "-"): (getattr(self, name), allowed) for name, allowed in _CHOICES.items()})
        for flag, (value, allowed) in choices.items():
            if value not in allowed:
                raise UserError(f"--{flag} {value!r} is not one of: {', '.join(allowed)}")

    def config(
        self,
        ready_file: Path | None = None,
        report: Callable[[str], None] = say,
        generate_model: bool = True,
        file_hint: bool = True,
    ) -> ServePairConfig:
        """The ServePairConfig these flags describe (generating the preset model if --model is not given,
        unless ``generate_model`` is false: then the path it would have). A bad value's message names its
        flag, and with ``file_hint`` the ``--config`` file it may come from."""
        from pydantic import ValidationError

        from kvtool.model import default_model_dir, ensure_default_model
        from kvtool.pair.config import default_log_dir

        self.check()
        if self.model_size is not None:
            report("--model-size is deprecated; use --model-preset")
        model, engine_args, saving_engine_args, kv_block_size, state_model = self.model, (), (), None, False
        takes_every_hit = False  # with --model the cost model judges every hit
        if model is None:
            from kvtool.model import PRESETS

            if generate_model:
                report(f"no --model given; using the generated {self.preset} model")
                model = ensure_default_model(preset=self.preset)
            else:
                model = default_model_dir(self.preset)
            preset = PRESETS[self.preset]
            engine_args = preset.engine_args_for(self.block_size)
            saving_engine_args = preset.engine_args_for(self.block_size, saves=True)
            takes_every_hit = preset.takes_every_hit
            kv_block_size = preset.kv_block_size_for(self.block_size)
            state_model = preset.is_hybrid
        flags = {name: getattr(self, name) for name in flag_fields()}  # the fields' own flags, as given
        if flags["fault_control_file"] is not None:
            flags["fault_control_file"] = flags["fault_control_file"].resolve()
        try:
            return ServePairConfig(
                **flags,
                model=model.expanduser().resolve(),
                external_master=self.master,
                take_every_hit=takes_every_hit if self.take_every_hit is None else self.take_every_hit,
                store=self.chosen_store,
                log_dir=(self.log_dir or default_log_dir()).resolve(),
                ready_file=ready_file.resolve() if ready_file else None,
                segment_bytes=self.segment_mib << 20,
                startup_timeout_s=self.startup_timeout,
                engine_args=engine_args,
                saving_engine_args=saving_engine_args,
                kv_block_size=kv_block_size,
                state_model=state_model,
                engine_ports=tuple(self.engine_port or ()),
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            name = str(first["loc"][0])
            flag = _FLAG_OF_FIELD.get(name, "--" + name.replace("_", "-"))
            where = f" (given on the command line or in {self.config_file})" if self.config_file and file_hint else ""
            raise UserError(f"{flag}{where}: {first['msg']}") from None


# A Literal field's flag -> its choices (``check``).
_CHOICES: dict[str, tuple[str, ...]] = {
    name: get_args(info.annotation) for name, info in flag_fields().items() if get_origin(info.annotation) is Literal
}


def _field_flags() -> list[tuple[str, Any, Any]]:
    """``ServePairConfig``'s ``flag`` fields as dataclass fields whose annotations carry their Typer options
    (a Literal as a string: ``check`` names its choices)."""
    made = []
    for name, info in flag_fields().items():
        option = _pair(info.description or "", hidden=info.json_schema_extra["flag"] == "hidden")  # type: ignore[index]
        kind = str if name in _CHOICES else info.annotation
        made.append((name, Annotated[kind, option], dataclasses.field(default=info.default)))
    return made


PairOptions = dataclasses.make_dataclass("PairOptions", _field_flags(), bases=(_ShapedFlags,), frozen=True)
PairOptions.__module__ = __name__
PairOptions.__doc__ = """The flags that describe a producer/consumer pair or a fleet: ``ServePairConfig``'s flag fields
and the shaped flags (``_ShapedFlags``); ``config`` makes its ServePairConfig."""
