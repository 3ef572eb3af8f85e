"""kvtool's command line."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from kvtool.errors import UserError

app = typer.Typer(
    name="kvtool",
    help="Partial-tail KV offload for vLLM over a Mooncake store: serve a producer/consumer pair, bench, inspect.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

out = Console()
err = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def print_user_error(exc: UserError) -> None:
    # soft_wrap keeps the sentence on one line whatever the terminal width; markup off: paths may hold [].
    err.print(f"error: {exc.message}", style="bold red", soft_wrap=True, markup=False, highlight=False)
    if exc.details:
        err.print(exc.details, style="dim", soft_wrap=True, markup=False, highlight=False)


def user_errors_exit(command: F) -> F:
    """Expected failures leave as one sentence on stderr and an exit code, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except UserError as exc:
            print_user_error(exc)
            raise typer.Exit(exc.exit_code) from None

    return wrapper  # type: ignore[return-value]


def say(message: str) -> None:
    err.print(f"[dim]kvtool:[/dim] {message}", soft_wrap=True, highlight=False)


@app.command("model")
@user_errors_exit
def model_command(
    size: Annotated[
        str, typer.Option("--size", help="tiny (2 layers, tests) or bench (12 layers, TTFT benchmarks)")
    ] = "tiny",
    path: Annotated[
        Path | None,
        typer.Option("--path", help="where to write it \\[default: $KVTOOL_HOME/models/<size>-llama]"),
    ] = None,
) -> None:
    """Generate (once) a random-weight Llama model with its tokenizer and print its directory."""
    from kvtool.model import ensure_default_model

    out.print(str(ensure_default_model(path, preset=size)), soft_wrap=True, highlight=False)


# ---- the pair's flags, shared by serve-pair and bench --launch ------------------------------

ModelFlag = Annotated[
    Path | None,
    typer.Option(help="Hugging Face model directory \\[default: a generated random-weight Llama, see --model-size]"),
]
ModelSizeFlag = Annotated[str, typer.Option(help="preset generated when --model is not given: tiny or bench")]
ProducerPortFlag = Annotated[int, typer.Option(help="producer vLLM server port on 127.0.0.1")]
ConsumerPortFlag = Annotated[int, typer.Option(help="consumer vLLM server port on 127.0.0.1")]
MasterPortFlag = Annotated[int, typer.Option(help="RPC port of the mooncake_master kvtool starts")]
AdminPortFlag = Annotated[
    int, typer.Option(help="the master's metrics/admin HTTP port (with --master: that master's admin port)")
]
MasterFlag = Annotated[
    str | None,
    typer.Option(help="HOST:PORT of a running mooncake_master to use instead of starting one (not supervised)"),
]
StorePortFlag = Annotated[int, typer.Option(help="service port of the standalone store (--store standalone)")]
BlockSizeFlag = Annotated[int, typer.Option(help="vLLM KV block size in tokens (a multiple of 32 on the CPU)")]
HashUnitFlag = Annotated[int, typer.Option(help="tail boundary grid in tokens for the kvtool connector (1 = exact)")]
StoreFlag = Annotated[
    str,
    typer.Option(
        help="embedded: each engine lends 256 MiB of segment memory to the store (stored KV dies with its "
        "engine); standalone: a separate mooncake_client process holds 1 GiB and the engines lend none, "
        "so stored KV outlives a producer restart"
    ),
]
ConnectorFlag = Annotated[
    str,
    typer.Option(
        help="kvtool (partial-tail connector), vllm-mooncake-store (vLLM's in-tree, whole blocks only) or none"
    ),
]
RolesFlag = Annotated[
    str,
    typer.Option(
        help="pd: the producer saves (kv_producer) and the consumer loads (kv_consumer); both: each engine "
        "loads and saves (kv_both). Needs a connector (kvtool or vllm-mooncake-store)"
    ),
]
LogDirFlag = Annotated[
    Path | None,
    typer.Option(help="where the processes' logs go \\[default: ./logs/serve-pair-<timestamp>]"),
]
KvCacheFlag = Annotated[float, typer.Option(help="KV cache per engine, GiB (VLLM_CPU_KVCACHE_SPACE)")]
MemoryUtilizationFlag = Annotated[
    float,
    typer.Option(help="--gpu-memory-utilization per engine; small because two engines start together"),
]
DtypeFlag = Annotated[str, typer.Option(help="vLLM --dtype (float32 keeps logprob comparisons exact)")]
EnforceEagerFlag = Annotated[bool, typer.Option(help="pass --enforce-eager to vLLM (no compilation)")]
StartupTimeoutFlag = Annotated[float, typer.Option(help="seconds to wait for both servers to be healthy")]

CONNECTOR_CHOICES = ("kvtool", "vllm-mooncake-store", "none")
ROLES_CHOICES = ("pd", "both")


def build_pair_config(
    *,
    model: Path | None,
    model_size: str,
    producer_port: int,
    consumer_port: int,
    master_port: int,
    admin_port: int,
    master: str | None,
    store_port: int,
    block_size: int,
    hash_unit: int,
    store: str,
    connector: str,
    log_dir: Path | None,
    ready_file: Path | None,
    roles: str = "pd",
    kv_cache_gib: float,
    memory_utilization: float,
    dtype: str,
    enforce_eager: bool,
    startup_timeout: float,
):
    """The ServePairConfig the pair flags describe; a UserError naming the flag for a bad value."""
    from pydantic import ValidationError

    from kvtool.model import ensure_default_model
    from kvtool.serve_pair import ServePairConfig, default_log_dir

    choices = {
        "store": (store, ("embedded", "standalone")),
        "connector": (connector, CONNECTOR_CHOICES),
        "roles": (roles, ROLES_CHOICES),
    }
    for flag, (value, allowed) in choices.items():
        if value not in allowed:
            raise UserError(f"--{flag} {value!r} is not one of: {', '.join(allowed)}")
    if model is None:
        say(f"no --model given; using the generated {model_size} model")
        model = ensure_default_model(preset=model_size)
    chosen_log_dir = (log_dir or default_log_dir()).resolve()
    try:
        return ServePairConfig(
            model=model.expanduser().resolve(),
            producer_port=producer_port,
            consumer_port=consumer_port,
            master_port=master_port,
            admin_port=admin_port,
            external_master=master,
            store_port=store_port,
            block_size=block_size,
            hash_unit=hash_unit,
            store=store,
            connector=connector,
            roles=roles,
            log_dir=chosen_log_dir,
            ready_file=ready_file.resolve() if ready_file else None,
            kv_cache_gib=kv_cache_gib,
            memory_utilization=memory_utilization,
            dtype=dtype,
            enforce_eager=enforce_eager,
            startup_timeout_s=startup_timeout,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        flag = "--" + str(first["loc"][0]).replace("_", "-")
        raise UserError(f"{flag}: {first['msg']}") from None


@app.command("serve-pair")
@user_errors_exit
def serve_pair_command(
    model: ModelFlag = None,
    model_size: ModelSizeFlag = "tiny",
    producer_port: ProducerPortFlag = 8100,
    consumer_port: ConsumerPortFlag = 8200,
    master_port: MasterPortFlag = 50051,
    admin_port: AdminPortFlag = 9003,
    master: MasterFlag = None,
    store_port: StorePortFlag = 50052,
    block_size: BlockSizeFlag = 32,
    hash_unit: HashUnitFlag = 1,
    store: StoreFlag = "embedded",
    connector: ConnectorFlag = "kvtool",
    roles: RolesFlag = "pd",
    log_dir: LogDirFlag = None,
    ready_file: Annotated[
        Path | None,
        typer.Option(help="once all are healthy, write their addresses here as JSON; removed on exit"),
    ] = None,
    smoke: Annotated[
        bool, typer.Option("--smoke", help="run one producer-then-consumer check, print it, stop")
    ] = False,
    kv_cache_gib: KvCacheFlag = 1.0,
    memory_utilization: MemoryUtilizationFlag = 0.3,
    dtype: DtypeFlag = "float32",
    enforce_eager: EnforceEagerFlag = False,
    startup_timeout: StartupTimeoutFlag = 300.0,
) -> None:
    """Start a Mooncake master, a producer and a consumer vLLM server on 127.0.0.1 and keep them running.

    A master (or standalone store) that dies or stops answering its health check is killed and started
    again on the same ports, with back-off. Stops everything on Ctrl-C, on SIGTERM or when an engine
    dies (exit 130 for a signal, 1 for a death).
    """
    from kvtool.launch import run_pair
    from kvtool.smoke import run_smoke

    cfg = build_pair_config(
        model=model,
        model_size=model_size,
        producer_port=producer_port,
        consumer_port=consumer_port,
        master_port=master_port,
        admin_port=admin_port,
        master=master,
        store_port=store_port,
        block_size=block_size,
        hash_unit=hash_unit,
        store=store,
        connector=connector,
        roles=roles,
        log_dir=log_dir,
        ready_file=ready_file,
        kv_cache_gib=kv_cache_gib,
        memory_utilization=memory_utilization,
        dtype=dtype,
        enforce_eager=enforce_eager,
        startup_timeout=startup_timeout,
    )

    def on_ready(info: dict[str, Any]) -> None:
        table = Table(title="kvtool serve-pair")
        table.add_column("process")
        table.add_column("pid", justify="right")
        table.add_column("address")
        table.add_column("log")
        addresses = {
            "master": f"{info['master']} (admin {info['admin']})",
            "store": info.get("store_address") or "",
            "producer": info["producer"],
            "consumer": info["consumer"],
        }
        for name, pid in info["pids"].items():
            table.add_row(name, str(pid), addresses.get(name, ""), str(Path(info["log_dir"]) / f"{name}.log"))
        out.print(table)
        out.print(
            f"model: {info['model']}\nconnector: {info['connector']}  roles: {info['roles']}  "
            f"store: {info['store']}  block size: {info['block_size']}  hash unit: {info['hash_unit']}",
            soft_wrap=True,
            highlight=False,
        )
        if not smoke:
            say("serving; Ctrl-C stops everything")

    code = run_pair(cfg, say, on_ready, smoke=(lambda info: run_smoke(info, out)) if smoke else None)
    if code:
        raise typer.Exit(code)


@app.command("bench")
@user_errors_exit
def bench_command(
    pair: Annotated[
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
            help="sub-block, cross-block, shared-prefix, multi-turn, max-tokens-1, prefix-repetition or "
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
    json_path: Annotated[
        Path | None, typer.Option("--json", help="write the results and configuration as JSON")
    ] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="write a PNG: hits vs ideal, TTFT by connector")] = None,
    trace_block_tokens: Annotated[int, typer.Option(help="tokens one 512-token trace block becomes")] = 16,
    trace_start: Annotated[int, typer.Option(help="first trace line to replay (0-based)")] = 0,
    trace_requests: Annotated[int | None, typer.Option(help="trace requests to replay \\[default: --requests]")] = None,
    prefix_len: Annotated[int, typer.Option(help="prefix-repetition: tokens of each shared prefix")] = 80,
    suffix_len: Annotated[int, typer.Option(help="prefix-repetition: tokens after the prefix")] = 24,
    num_prefixes: Annotated[int, typer.Option(help="prefix-repetition: distinct prefixes")] = 2,
    model: ModelFlag = None,
    model_size: ModelSizeFlag = "tiny",
    producer_port: ProducerPortFlag = 8100,
    consumer_port: ConsumerPortFlag = 8200,
    master_port: MasterPortFlag = 50051,
    admin_port: AdminPortFlag = 9003,
    store_port: StorePortFlag = 50052,
    block_size: BlockSizeFlag = 32,
    hash_unit: HashUnitFlag = 1,
    store: StoreFlag = "embedded",
    connector: ConnectorFlag = "kvtool",
    roles: RolesFlag = "pd",
    log_dir: LogDirFlag = None,
    kv_cache_gib: KvCacheFlag = 1.0,
    memory_utilization: MemoryUtilizationFlag = 0.3,
    dtype: DtypeFlag = "float32",
    enforce_eager: EnforceEagerFlag = False,
    startup_timeout: StartupTimeoutFlag = 300.0,
) -> None:
    """Replay seeded workloads on a producer/consumer pair and report reuse against an ideal oracle.

    Reports per workload and prompt-length bucket: prompt, ideal and hit tokens (block and tail), hit
    rate, efficiency (hit / ideal), consumer TTFT, and answers that differ from a recomputation.
    """
    from pydantic import ValidationError

    from kvtool.bench.command import parse_compare, run_bench
    from kvtool.bench.config import BenchConfig, PrefixRepetitionOptions, TraceOptions

    compared = parse_compare(compare)
    try:
        config = BenchConfig(
            workloads=tuple(workload or ("sub-block",)),
            requests=requests,
            max_tokens=max_tokens,
            seed=seed,
            verify=verify,
            tolerance=tolerance,
            trace=TraceOptions(block_tokens=trace_block_tokens, start=trace_start, requests=trace_requests),
            prefix_repetition=PrefixRepetitionOptions(
                prefix_len=prefix_len, suffix_len=suffix_len, num_prefixes=num_prefixes
            ),
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        field = first["loc"][-1]
        prefix = "trace-" if first["loc"][0] == "trace" else ""
        raise UserError(f"--{prefix}{str(field).replace('_', '-')}: {first['msg']}") from None
    launch_cfg = None
    if launch:
        launch_cfg = build_pair_config(
            model=model,
            model_size=model_size,
            producer_port=producer_port,
            consumer_port=consumer_port,
            master_port=master_port,
            admin_port=admin_port,
            master=None,
            store_port=store_port,
            block_size=block_size,
            hash_unit=hash_unit,
            store=store,
            connector=connector,
            roles=roles,
            log_dir=log_dir,
            ready_file=None,
            kv_cache_gib=kv_cache_gib,
            memory_utilization=memory_utilization,
            dtype=dtype,
            enforce_eager=enforce_eager,
            startup_timeout=startup_timeout,
        )
    run_bench(config, out, say, pair, launch_cfg, compared, json_path, plot)


def _register_inspect() -> None:
    from kvtool.inspect.cli import inspect_app

    app.add_typer(inspect_app, name="inspect")


_register_inspect()


def main() -> None:
    try:
        app()  # standalone: usage errors exit 2, Ctrl-C outside serve-pair's own handling exits 130
    except UserError as exc:  # raised outside a command, e.g. while parsing
        print_user_error(exc)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
