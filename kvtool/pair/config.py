"""A producer / consumer pair's configuration: ``ServePairConfig``, validated once, and the only
declaration of its choices (connector: ``kvtool.pair.profiles.ConnectorChoice``; store, roles).

The rest of the pair builds on it: ``engines`` (each engine's kv-transfer config, argv and env),
``preflight`` (every foreseeable start-up failure as one sentence), ``launch`` (start, supervise, stop),
``ready`` (the ready file and its writer).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from connector.config import KVToolConfig, divergence_grid
from connector.store.mooncake_config import HA_PREFIX
from connector.store.mooncake_config import master_endpoints as connector_master_endpoints
from kvtool.errors import UserError
from kvtool.pair import profiles
from kvtool.procs import LOOPBACK
from kvtool.pair.profiles import ConnectorChoice, ConnectorProfile

StoreChoice = Literal["embedded", "standalone"]
RolesChoice = Literal["pd", "both"]  # pd: kv_producer + kv_consumer; both: kv_both on each engine
# An engine's name: "producer" and "consumer" in a pair; "engine-0", "engine-1", ... in a fleet.
Role = str
# vLLM's router's policies; kv_aware routes by the KV events each engine publishes (``kv_events_port``).
RouterPolicy = Literal[
    "round_robin", "random", "power_of_two", "consistent_hash", "cache_aware", "sticky_least_loaded", "kv_aware"
]
FLEET_PREFIX = "engine-"

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
GiB = 1 << 30

CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention backend only takes multiples of 32


def flag(default: Any, help_text: str, *, hidden: bool = False, **constraints: Any) -> Any:
    """A field that is also a flag of ``serve-pair`` and ``bench --launch``, named after it
    (``producer_port``: ``--producer-port``), with ``help_text`` as its help: ``kvtool.commands.pairoptions``
    builds the option from the field, so its name, type, default and help are declared here once."""
    shown = "hidden" if hidden else "shown"
    return Field(default=default, description=help_text, json_schema_extra={"flag": shown}, **constraints)


def flag_fields() -> dict[str, Any]:
    """``ServePairConfig``'s fields that are flags (``flag``), in declaration order: name -> field info."""
    return {
        name: info
        for name, info in ServePairConfig.model_fields.items()
        if isinstance(info.json_schema_extra, dict) and "flag" in info.json_schema_extra
    }


class ServePairConfig(BaseModel):
    """Everything `kvtool serve-pair` needs; one object, validated once. The fields declared with ``flag``
    are the command's flags too; the others are set from flags of another shape (``--master``,
    ``--segment-mib``, ``--startup-timeout``, ``--engine-port``, the model's) or from the model preset."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Path
    producer_port: int = flag(8100, "producer vLLM server port on 127.0.0.1", ge=1, le=65535)
    consumer_port: int = flag(8200, "consumer vLLM server port on 127.0.0.1", ge=1, le=65535)
    master_port: int = flag(50051, "RPC port of the mooncake_master kvtool starts", ge=1, le=65535)
    admin_port: int = flag(
        9003, "the master's metrics/admin HTTP port (with --master: that master's admin port)", ge=1, le=65535
    )
    external_master: str | None = None  # host:port of a master kvtool does not start, or etcd://... of an HA group
    store_port: int = flag(50052, "service port of the standalone store (--store standalone)", ge=1, le=65535)
    block_size: int = flag(32, "vLLM KV block size in tokens (a multiple of 32 on the CPU)", gt=0)
    hash_unit: int = flag(1, "tail boundary grid in tokens for the kvtool connector (1 = exact)", gt=0)
    divergence_grid: int | None = flag(
        None,
        "pointer grid in tokens inside stored objects (kvtool connector): a prompt that leaves a stored one finds "
        "their common prefix rounded down to it; 1 = exact, 0 = off \\[default: block size / 4]",
        ge=0,
    )
    take_every_hit: bool = False  # the kvtool connector's cost model off (generated models: see PairOptions)
    store: StoreChoice = "embedded"
    connector: ConnectorChoice = flag(
        "kvtool",
        "kvtool (partial-tail connector), vllm-mooncake-store (vLLM's in-tree, whole blocks only), lmcache "
        "(LMCache's multiprocess server, whole chunks of a block; scripts/setup --with-lmcache) or none",
    )
    roles: RolesChoice = flag(
        "pd",
        "pd: the producer saves (kv_producer) and the consumer loads (kv_consumer); both: each engine loads and "
        "saves (kv_both), and saves its answers at request end. Needs a connector (kvtool or vllm-mooncake-store)",
    )
    log_dir: Path
    ready_file: Path | None = None
    dtype: str = flag("float32", "vLLM --dtype (float32 keeps logprob comparisons exact)")
    max_model_len: int = Field(default=2048, gt=0)
    kv_cache_gib: float = flag(1.0, "KV cache per engine, GiB (VLLM_CPU_KVCACHE_SPACE)")
    memory_utilization: float = flag(
        0.3, "--gpu-memory-utilization per engine; small because two engines start together", gt=0, le=1
    )
    enforce_eager: bool = flag(False, "pass --enforce-eager to vLLM (no compilation)")
    tensor_parallel_size: int = flag(
        1,
        "vLLM --tensor-parallel-size of each engine; each rank saves and loads its share of the KV under keys of "
        "its own, and a consumer loads what a producer of the same size saved",
        ge=1,
    )
    attention_backend: str | None = flag(
        None,
        "vLLM --attention-backend (e.g. FLASH_ATTN, TRITON_ATTN); on a GPU the kvtool connector needs it named, "
        "so that its keys carry the KV layout \\[default: vLLM's choice]",
    )
    max_num_batched_tokens: int | None = flag(
        None,
        "vLLM --max-num-batched-tokens per engine: a prompt longer than it is prefilled in chunks \\[default: the "
        "model preset's, else vLLM's]",
        gt=0,
    )
    segment_bytes: int = Field(default=256 * MiB, gt=0)  # what each engine lends the store (embedded)
    local_buffer_bytes: int = Field(default=64 * MiB, gt=0)
    store_segment_bytes: int = Field(default=1 * GiB, gt=0)  # what the standalone store holds
    startup_timeout_s: float = Field(default=300.0, gt=0)
    fault_control_file: Path | None = flag(
        None, "testing only: a fault plan file (connector/store/faults.py) the kvtool connectors re-read", hidden=True
    )
    # What a model preset needs (kvtool/model.py): extra vLLM flags, and the KV block size the engines
    # end up with when vLLM raises --block-size (a Mamba hybrid aligns it to its state page).
    engine_args: tuple[str, ...] = ()
    saving_engine_args: tuple[str, ...] = ()  # instead of engine_args, for an engine that saves KV
    kv_block_size: int | None = None
    state_model: bool = False  # the model has Mamba state groups (the connector profile may add flags)
    engines: int = flag(
        0,
        "a fleet instead of the pair: this many vLLM engines, each kv_both (it saves its prompts and answers and "
        "loads from the store), behind vLLM's router (vllm-router) on --router-port; requests go to the router. "
        "0: the producer / consumer pair",
        ge=0,
    )
    engine_ports: tuple[int, ...] = ()  # engine i listens on engine_ports[i], or on producer_port + i
    router_port: int = flag(8000, "a fleet's router port on 127.0.0.1 (--engines)", ge=1, le=65535)
    router_metrics_port: int = flag(29000, "a fleet's router Prometheus port on 127.0.0.1", ge=1, le=65535)
    router_policy: RouterPolicy = flag(
        "round_robin",
        "how the router picks an engine: round_robin, random, power_of_two, consistent_hash, cache_aware (the "
        "router's own prefix tree), sticky_least_loaded or kv_aware (what each engine's cache holds, from the KV "
        "events it publishes on --kv-events-port)",
    )
    kv_events_port: int = flag(
        5557,
        "with --router-policy kv_aware: engine i publishes its KV events on 127.0.0.1 at this port + i",
        ge=1,
        le=65535,
    )
    restart_engines: bool = flag(
        True,
        "a fleet's engine that ends or hangs is started again on its port and rejoins the router's rotation once "
        "warm with the store (kvtool.pair.members); --no-restart-engines lets it go and the rest serve on",
    )

    @property
    def effective_block_size(self) -> int:
        """The block size of the engines' KV cache: what stored keys are built with."""
        return self.kv_block_size or self.block_size

    @property
    def effective_divergence_grid(self) -> int:
        """The kvtool connector's pointer grid on these engines (connector.config.divergence_grid)."""
        grid = "auto" if self.divergence_grid is None else self.divergence_grid
        return divergence_grid(
            KVToolConfig(master_server_address="127.0.0.1:1", divergence_grid=grid), self.effective_block_size
        )

    @property
    def uses_mooncake(self) -> bool:
        return self.profile.uses_store

    @property
    def profile(self) -> ConnectorProfile:
        return profiles.profile(self.connector)

    @property
    def starts_master(self) -> bool:
        return self.uses_mooncake and self.external_master is None

    @property
    def starts_store(self) -> bool:
        return self.uses_mooncake and self.store == "standalone"

    @property
    def starts_lmcache(self) -> bool:
        """LMCache's multiprocess server (on --store-port), which its connector's engines share."""
        return self.profile.starts_lmcache

    @property
    def master_address(self) -> str | None:
        if not self.uses_mooncake:
            return None
        return self.external_master or f"{LOOPBACK}:{self.master_port}"

    @property
    def engine_segment_bytes(self) -> int:
        # With a standalone store the engines only use it; its owner outlives a producer restart.
        return 0 if self.store == "standalone" else self.segment_bytes

    @property
    def is_fleet(self) -> bool:
        return self.engines > 0

    @property
    def engine_names(self) -> tuple[Role, ...]:
        """Every engine, in start order: a fleet's engine-0, engine-1, ...; a pair's producer and consumer."""
        if self.is_fleet:
            return tuple(f"{FLEET_PREFIX}{index}" for index in range(self.engines))
        return ("producer", "consumer")

    @property
    def saves_answers(self) -> bool:
        """Each engine saves prompt + answer at request end (kv_both): with roles "both", and in a fleet."""
        return self.roles == "both" or self.is_fleet

    @property
    def router_url(self) -> str | None:
        return f"http://{LOOPBACK}:{self.router_port}" if self.is_fleet else None

    def port(self, role: Role) -> int:
        if role.startswith(FLEET_PREFIX):
            index = int(role.removeprefix(FLEET_PREFIX))
            return self.engine_ports[index] if self.engine_ports else self.producer_port + index
        return self.producer_port if role == "producer" else self.consumer_port

    def base_url(self, role: Role) -> str:
        return f"http://{LOOPBACK}:{self.port(role)}"

    @property
    def publishes_kv_events(self) -> bool:
        """Each engine publishes its KV events, for the router's kv_aware policy."""
        return self.is_fleet and self.router_policy == "kv_aware"

    def kv_events_endpoint(self, role: Role) -> str:
        """Where a fleet engine publishes its KV events (ZMQ, loopback): kv_events_port + its index."""
        return f"tcp://{LOOPBACK}:{self.kv_events_port + self.engine_names.index(role)}"


def master_endpoints(address: str, flag: str) -> list[tuple[str, int]]:
    """Where to reach a master given with ``flag``: its RPC ``host:port``, or the etcd endpoints of an HA
    group (``etcd://host:port;host:port``); a UserError naming the flag otherwise."""
    try:
        return connector_master_endpoints(address)
    except ValueError as exc:
        raise UserError(f"{flag} {address!r} {exc}") from None


def parse_host_port(address: str, flag: str) -> tuple[str, int]:
    """One master's RPC ``host:port`` given with ``flag``; a UserError naming the flag otherwise."""
    endpoints = master_endpoints(address, flag)
    if address.startswith(HA_PREFIX):
        raise UserError(f"{flag} {address!r} names an HA group; give one master's HOST:PORT, like 127.0.0.1:50051")
    return endpoints[0]


def default_log_dir() -> Path:
    return Path.cwd() / "logs" / f"serve-pair-{datetime.now():%Y%m%d-%H%M%S}"


Reporter = Callable[[str], None]
