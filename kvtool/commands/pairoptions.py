"""The flags that describe a pair or a fleet (serve-pair, bench --launch), as ``PairOptions``: a
dataclass of Typer options (``kvtool.commands.options.with_options``) that a ``--config`` file may fill
in, and that makes the one ``ServePairConfig`` the launch builds on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, get_args

import typer

from kvtool.commands.output import say
from kvtool.errors import UserError
from kvtool.pair.config import RolesChoice, RouterPolicy, StoreChoice

if TYPE_CHECKING:
    from kvtool.pair.config import ServePairConfig

# ---- the pair: serve-pair and bench --launch ------------------------------------------------

PAIR_PANEL = "Pair (serve-pair, bench --launch)"
ROLES_CHOICES = get_args(RolesChoice)  # declared once, with ServePairConfig
ROUTER_POLICIES = get_args(RouterPolicy)
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
class PairOptions:
    """The flags that describe a producer/consumer pair; ``config`` makes its ServePairConfig."""

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
    producer_port: Annotated[int, _pair("producer vLLM server port on 127.0.0.1")] = 8100
    consumer_port: Annotated[int, _pair("consumer vLLM server port on 127.0.0.1")] = 8200
    master_port: Annotated[int, _pair("RPC port of the mooncake_master kvtool starts")] = 50051
    admin_port: Annotated[
        int, _pair("the master's metrics/admin HTTP port (with --master: that master's admin port)")
    ] = 9003
    master: Annotated[
        str | None,
        _pair(
            "HOST:PORT of a running mooncake_master to use instead of starting one, or etcd://HOST:PORT[;...] of a "
            "master group in high-availability mode (not supervised)"
        ),
    ] = None
    store_port: Annotated[int, _pair("service port of the standalone store (--store standalone)")] = 50052
    block_size: Annotated[int, _pair("vLLM KV block size in tokens (a multiple of 32 on the CPU)")] = 32
    hash_unit: Annotated[int, _pair("tail boundary grid in tokens for the kvtool connector (1 = exact)")] = 1
    divergence_grid: Annotated[
        int | None,
        _pair(
            "pointer grid in tokens inside stored objects (kvtool connector): a prompt that leaves a stored "
            "one finds their common prefix rounded down to it; 1 = exact, 0 = off \\[default: block size / 4]"
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
    connector: Annotated[
        str,
        _pair(
            "kvtool (partial-tail connector), vllm-mooncake-store (vLLM's in-tree, whole blocks only), lmcache "
            "(LMCache's multiprocess server, whole chunks of a block; scripts/setup --with-lmcache) or none"
        ),
    ] = "kvtool"
    roles: Annotated[
        str,
        _pair(
            "pd: the producer saves (kv_producer) and the consumer loads (kv_consumer); both: each engine "
            "loads and saves (kv_both), and saves its answers at request end. Needs a connector (kvtool or "
            "vllm-mooncake-store)"
        ),
    ] = "pd"
    log_dir: Annotated[
        Path | None, _pair("where the processes' logs go \\[default: ./logs/serve-pair-<timestamp>]")
    ] = None
    kv_cache_gib: Annotated[float, _pair("KV cache per engine, GiB (VLLM_CPU_KVCACHE_SPACE)")] = 1.0
    segment_mib: Annotated[
        int,
        _pair("store memory each engine lends with --store embedded, MiB (a small one puts the store under pressure)"),
    ] = 256
    memory_utilization: Annotated[
        float, _pair("--gpu-memory-utilization per engine; small because two engines start together")
    ] = 0.3
    dtype: Annotated[str, _pair("vLLM --dtype (float32 keeps logprob comparisons exact)")] = "float32"
    enforce_eager: Annotated[bool, _pair("pass --enforce-eager to vLLM (no compilation)")] = False
    tensor_parallel_size: Annotated[
        int,
        _pair(
            "vLLM --tensor-parallel-size of each engine; each rank saves and loads its share of the KV under "
            "keys of its own, and a consumer loads what a producer of the same size saved"
        ),
    ] = 1
    attention_backend: Annotated[
        str | None,
        _pair(
            "vLLM --attention-backend (e.g. FLASH_ATTN, TRITON_ATTN); on a GPU the kvtool connector needs it "
            "named, so that its keys carry the KV layout \\[default: vLLM's choice]"
        ),
    ] = None
    max_num_batched_tokens: Annotated[
        int | None,
        _pair(
            "vLLM --max-num-batched-tokens per engine: a prompt longer than it is prefilled in chunks "
            "\\[default: the model preset's, else vLLM's]"
        ),
    ] = None
    startup_timeout: Annotated[float, _pair("seconds to wait for both servers to be healthy")] = 300.0
    config_file: Annotated[
        Path | None,
        _pair(
            "a pair config file (TOML: these flags by name, e.g. configs/cpu-demo/pair.toml); flags given on the "
            "command line win over it, its relative paths are relative to it",
            "--config",
        ),
    ] = None
    engines: Annotated[
        int,
        _pair(
            "a fleet instead of the pair: this many vLLM engines, each kv_both (it saves its prompts and answers "
            "and loads from the store), behind vLLM's router (vllm-router) on --router-port; requests go to the "
            "router. 0: the producer / consumer pair"
        ),
    ] = 0
    engine_port: Annotated[
        list[int] | None,
        _pair("a fleet engine's port, once per engine, in order \\[default: --producer-port + the engine's index]"),
    ] = None
    router_port: Annotated[int, _pair("a fleet's router port on 127.0.0.1 (--engines)")] = 8000
    router_metrics_port: Annotated[int, _pair("a fleet's router Prometheus port on 127.0.0.1")] = 29000
    router_policy: Annotated[
        str,
        _pair(
            "how the router picks an engine: round_robin, random, power_of_two, consistent_hash, cache_aware "
            "(the router's own prefix tree), sticky_least_loaded or kv_aware (what each engine's cache holds, "
            "from the KV events it publishes on --kv-events-port)"
        ),
    ] = "round_robin"
    kv_events_port: Annotated[
        int, _pair("with --router-policy kv_aware: engine i publishes its KV events on 127.0.0.1 at this port + i")
    ] = 5557
    restart_engines: Annotated[
        bool,
        _pair(
            "a fleet's engine that ends or hangs is started again on its port and rejoins the router's rotation "
            "once warm with the store; --no-restart-engines lets it go and the rest serve on",
            "--restart-engines/--no-restart-engines",
        ),
    ] = True
    fault_control_file: Annotated[
        Path | None,
        _pair("testing only: a fault plan file (connector/faults.py) the kvtool connectors re-read", hidden=True),
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

    def with_file(self, given: set[str] = frozenset()) -> PairOptions:  # type: ignore[assignment]
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
            options = TypeAdapter(PairOptions).validate_python(merged)
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
        from kvtool.pair.profiles import CONNECTOR_NAMES
        from kvtool.model import PRESETS

        if self.max_num_batched_tokens is not None and self.model is None and self.preset == "mamba":
            raise UserError("--max-num-batched-tokens: the mamba preset prefills in chunks of its Mamba block (64)")
        if self.model_size is not None and self.model_preset not in ("tiny", self.model_size):
            raise UserError("--model-size is the old name of --model-preset; give one of them")
        choices = {
            "model-preset": (self.preset, tuple(PRESETS)),
            "store": (self.chosen_store, STORE_CHOICES),
            "connector": (self.connector, CONNECTOR_NAMES),
            "roles": (self.roles, ROLES_CHOICES),
            "router-policy": (self.router_policy, ROUTER_POLICIES),
        }
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
        from kvtool.pair.config import ServePairConfig, default_log_dir

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
        try:
            return ServePairConfig(
                model=model.expanduser().resolve(),
                producer_port=self.producer_port,
                consumer_port=self.consumer_port,
                master_port=self.master_port,
                admin_port=self.admin_port,
                external_master=self.master,
                store_port=self.store_port,
                block_size=self.block_size,
                hash_unit=self.hash_unit,
                divergence_grid=self.divergence_grid,
                take_every_hit=takes_every_hit if self.take_every_hit is None else self.take_every_hit,
                store=self.chosen_store,
                connector=self.connector,
                roles=self.roles,
                log_dir=(self.log_dir or default_log_dir()).resolve(),
                ready_file=ready_file.resolve() if ready_file else None,
                kv_cache_gib=self.kv_cache_gib,
                segment_bytes=self.segment_mib << 20,
                memory_utilization=self.memory_utilization,
                dtype=self.dtype,
                enforce_eager=self.enforce_eager,
                tensor_parallel_size=self.tensor_parallel_size,
                attention_backend=self.attention_backend,
                max_num_batched_tokens=self.max_num_batched_tokens,
                startup_timeout_s=self.startup_timeout,
                fault_control_file=self.fault_control_file.resolve() if self.fault_control_file else None,
                engine_args=engine_args,
                saving_engine_args=saving_engine_args,
                kv_block_size=kv_block_size,
                state_model=state_model,
                engines=self.engines,
                engine_ports=tuple(self.engine_port or ()),
                router_port=self.router_port,
                router_metrics_port=self.router_metrics_port,
                router_policy=self.router_policy,
                kv_events_port=self.kv_events_port,
                restart_engines=self.restart_engines,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            name = str(first["loc"][0])
            flag = _FLAG_OF_FIELD.get(name, "--" + name.replace("_", "-"))
            where = f" (given on the command line or in {self.config_file})" if self.config_file and file_hint else ""
            raise UserError(f"{flag}{where}: {first['msg']}") from None
