"""A producer and a consumer vLLM server sharing KV through a loopback Mooncake store.

Pure builders (kv-transfer configs, argv, env, ready-file content) live here; kvtool.pair.launch starts,
supervises and stops the processes (run_pair, launched_pair), so tests and the bench reuse both.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from connector.config import KVToolConfig, divergence_grid
from kvtool.errors import UserError
from kvtool.pair import profiles
from kvtool.pair.profiles import ConnectorChoice, ConnectorProfile, TransferSettings
from kvtool.pair.ready import ReadyFile
from kvtool.pair.procs import LOOPBACK, ensure_port_free, tcp_port_open
from kvtool.store.mooncake import find_binary, lmcache_binary, mooncake_config_path

StoreChoice = Literal["embedded", "standalone"]
RolesChoice = Literal["pd", "both"]  # pd: kv_producer + kv_consumer; both: kv_both on each engine
Role = Literal["producer", "consumer"]

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
GiB = 1 << 30

CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention backend only takes multiples of 32


class ServePairConfig(BaseModel):
    """Everything `kvtool serve-pair` needs; one object, validated once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Path
    producer_port: int = 8100
    consumer_port: int = 8200
    master_port: int = 50051
    admin_port: int = 9003
    external_master: str | None = None  # host:port of a master kvtool does not start
    store_port: int = 50052  # the standalone mooncake_client's service port
    block_size: int = Field(default=32, gt=0)
    hash_unit: int = Field(default=1, gt=0)
    divergence_grid: int | None = Field(default=None, ge=0)  # None: the connector's auto (a quarter block)
    take_every_hit: bool = False  # the kvtool connector's cost model off (generated models: see PairOptions)
    store: StoreChoice = "embedded"
    connector: ConnectorChoice = "kvtool"
    roles: RolesChoice = "pd"
    log_dir: Path
    ready_file: Path | None = None
    dtype: str = "float32"  # vLLM's "auto" would downcast the float32 test models to bf16
    max_model_len: int = 2048
    kv_cache_gib: float = 1.0  # VLLM_CPU_KVCACHE_SPACE per engine
    memory_utilization: float = 0.3  # --gpu-memory-utilization per engine; two start side by side
    enforce_eager: bool = False
    # vLLM's prefill chunk (--max-num-batched-tokens); None: the preset's, else vLLM's default.
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    segment_bytes: int = Field(default=256 * MiB, gt=0)  # what each engine lends the store (embedded)
    local_buffer_bytes: int = 64 * MiB
    store_segment_bytes: int = 1 * GiB  # what the standalone store holds
    startup_timeout_s: float = 300.0
    # Testing only: a fault plan file (connector/faults.py) the kvtool connectors read while they run.
    fault_control_file: Path | None = None
    # What a model preset needs (kvtool/model.py): extra vLLM flags, and the KV block size the engines
    # end up with when vLLM raises --block-size (a Mamba hybrid aligns it to its state page).
    engine_args: tuple[str, ...] = ()
    saving_engine_args: tuple[str, ...] = ()  # instead of engine_args, for an engine that saves KV
    kv_block_size: int | None = None
    state_model: bool = False  # the model has Mamba state groups (the connector profile may add flags)

    @property
    def effective_block_size(self) -> int:
        """The block size of the engines' KV cache: what stored keys are built with."""
        return self.kv_block_size or self.block_size

    @property
    def effective_divergence_grid(self) -> int:
        """The kvtool connector's pointer grid on these engines (connector.config.divergence_grid)."""
        grid = "auto" if self.divergence_grid is None else self.divergence_grid
        return divergence_grid(KVToolConfig(master_server_address="127.0.0.1:1", divergence_grid=grid),
                               self.effective_block_size)  # fmt: skip

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

    def port(self, role: Role) -> int:
        return self.producer_port if role == "producer" else self.consumer_port

    def base_url(self, role: Role) -> str:
        return f"http://{LOOPBACK}:{self.port(role)}"


# ---- kv-transfer configuration -------------------------------------------------------------


def kvtool_extra_config(
    master_address: str,
    hash_unit: int = 1,
    global_segment_size: int = 256 * MiB,
    local_buffer_size: int = 64 * MiB,
    request_log: Path | None = None,
) -> dict[str, Any]:
    """The kvtool connector's kv_connector_extra_config (validated by connector.config)."""
    settings = TransferSettings("", master_address, hash_unit, global_segment_size, local_buffer_size, request_log)
    return profiles.kvtool_extra_config(settings)


def request_log_path(cfg: ServePairConfig, role: Role) -> Path:
    """Where the kvtool connector of ``role`` writes its per-request hit details (JSON lines)."""
    return cfg.log_dir / f"{role}-requests.jsonl"


def kv_role_for(cfg: ServePairConfig, role: Role) -> str:
    """vLLM's kv_role of an engine: with roles "both" each engine loads and saves (kv_both)."""
    if cfg.roles == "both":
        return "kv_both"
    return "kv_producer" if role == "producer" else "kv_consumer"


def kv_transfer_config(cfg: ServePairConfig, role: Role) -> dict[str, Any] | None:
    settings = TransferSettings(
        kv_role_for(cfg, role),
        cfg.master_address,
        cfg.hash_unit,
        cfg.engine_segment_bytes,
        cfg.local_buffer_bytes,
        request_log_path(cfg, role),
        {"fault_control_file": str(cfg.fault_control_file)} if cfg.fault_control_file else None,
        # With roles "both" the decoding engine saves its answers, so a chat's next turn reuses them.
        save_answers=cfg.roles == "both",
        divergence_grid=cfg.divergence_grid,
        take_every_hit=cfg.take_every_hit,
        server_port=cfg.store_port if cfg.starts_lmcache else None,
    )
    return cfg.profile.kv_transfer_config(settings)


# ---- process command lines -----------------------------------------------------------------


def engine_argv(cfg: ServePairConfig, role: Role, python: str = sys.executable) -> list[str]:
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(cfg.model),
        "--host",
        LOOPBACK,
        "--port",
        str(cfg.port(role)),
        "--block-size",
        str(cfg.block_size),
        "--max-model-len",
        str(cfg.max_model_len),
        "--dtype",
        cfg.dtype,
        "--gpu-memory-utilization",
        str(cfg.memory_utilization),
        "--enable-prompt-tokens-details",
    ]
    if cfg.enforce_eager:
        argv.append("--enforce-eager")
    transfer = kv_transfer_config(cfg, role)
    saves = transfer is not None and kv_role_for(cfg, role) != "kv_consumer"
    argv += cfg.saving_engine_args if saves and cfg.saving_engine_args else cfg.engine_args
    if cfg.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]  # the last one given wins
    if cfg.state_model:
        argv += cfg.profile.state_model_args
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    return argv


def cpu_halves(cpus: list[int] | None = None) -> tuple[str, str]:
    """OMP core lists for the producer and the consumer: two disjoint halves of the usable cores."""
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < 2:
        return "all", "all"
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


def engine_env(cfg: ServePairConfig, role: Role, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    producer_cpus, consumer_cpus = cpu_halves()
    env.update(
        {
            # Without these vLLM's and Mooncake's sockets advertise the machine's LAN address.
            "VLLM_HOST_IP": LOOPBACK,
            "MC_TCP_BIND_ADDRESS": LOOPBACK,
            "VLLM_CPU_KVCACHE_SPACE": f"{cfg.kv_cache_gib:g}",
            "VLLM_CPU_OMP_THREADS_BIND": producer_cpus if role == "producer" else consumer_cpus,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p),
        }
    )
    if cfg.starts_lmcache:
        env["PYTHONHASHSEED"] = "0"  # LMCache keys chunks by Python's hash(): both engines must agree
    if cfg.profile.mooncake_config_file:
        env["MOONCAKE_CONFIG_PATH"] = str(mooncake_config_path(cfg))
    else:
        # The kvtool connector also reads this file; one inherited from the shell must not change its config.
        env.pop("MOONCAKE_CONFIG_PATH", None)
    return env


# ---- checks before starting ----------------------------------------------------------------


def _is_cpu_vllm() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _parse_host_port(address: str, flag: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{flag} {address!r} is not HOST:PORT; give it like 127.0.0.1:50051")
    return host, int(port)


def preflight(cfg: ServePairConfig) -> None:
    """Turn every foreseeable start-up failure into one UserError sentence before anything starts."""
    if not cfg.model.exists():
        raise UserError(f"model path {cfg.model} does not exist; pass a Hugging Face model directory with --model")
    if not (cfg.model / "config.json").is_file():
        raise UserError(f"{cfg.model} has no config.json; --model must name a Hugging Face model directory")
    if _is_cpu_vllm() and cfg.block_size % CPU_BLOCK_MULTIPLE:
        raise UserError(
            f"--block-size {cfg.block_size} is not supported by vLLM's CPU attention backend; "
            f"use a multiple of {CPU_BLOCK_MULTIPLE}"
        )
    if cfg.hash_unit > cfg.block_size:
        raise UserError(
            f"--hash-unit {cfg.hash_unit} is larger than --block-size {cfg.block_size}; use 1..{cfg.block_size}"
        )
    if not cfg.profile.has_roles and cfg.store == "standalone":
        raise UserError("--store standalone needs a connector; drop it or pick --connector kvtool")
    if not cfg.profile.has_roles and cfg.roles != "pd":
        raise UserError(
            f"--roles {cfg.roles} needs a connector; drop it or pick --connector kvtool or vllm-mooncake-store"
        )

    ports: list[tuple[int, str]] = [
        (cfg.producer_port, "--producer-port"),
        (cfg.consumer_port, "--consumer-port"),
    ]
    if cfg.starts_master:
        ports += [(cfg.master_port, "--master-port"), (cfg.admin_port, "--admin-port")]
    if cfg.starts_store or cfg.starts_lmcache:
        ports.append((cfg.store_port, "--store-port"))
    if cfg.starts_lmcache:
        ports.append((cfg.admin_port, "--admin-port"))  # LMCache's HTTP admin API
    seen: dict[int, str] = {}
    for port, flag in ports:
        if port in seen:
            raise UserError(f"{seen[port]} and {flag} are both {port}; give each its own port")
        seen[port] = flag
    for port, flag in ports:
        ensure_port_free(port, flag)

    if cfg.external_master is not None:
        host, port = _parse_host_port(cfg.external_master, "--master")
        if not tcp_port_open(port, host):
            raise UserError(f"no Mooncake master answers at {cfg.external_master}; start one or drop --master")
    if cfg.starts_master:
        find_binary("mooncake_master")
    if cfg.starts_store:
        find_binary("mooncake_client")
    if cfg.starts_lmcache:
        lmcache_binary()


# ---- ready file ----------------------------------------------------------------------------


def admin_url_for(cfg: ServePairConfig) -> str | None:
    """The master's admin URL: the one kvtool starts, or with --master that host at --admin-port."""
    if not cfg.uses_mooncake:
        return None
    if cfg.external_master is not None:
        host, _ = _parse_host_port(cfg.external_master, "--master")
        return f"http://{host}:{cfg.admin_port}"
    return f"http://{LOOPBACK}:{cfg.admin_port}"


def ready_info(
    cfg: ServePairConfig, pids: dict[str, int], admin_url: str | None, restarts: dict[str, int] | None = None
) -> ReadyFile:
    """What the ready file holds (kvtool/pair/ready.py); rewritten whenever a supervised process gets a
    new pid."""
    return ReadyFile(
        producer=cfg.base_url("producer"),
        consumer=cfg.base_url("consumer"),
        master=cfg.master_address,
        admin=admin_url,
        master_pid=pids.get("master"),  # None when --master names a master kvtool does not run
        model=str(cfg.model),
        block_size=cfg.effective_block_size,
        hash_unit=cfg.hash_unit,
        divergence_grid=cfg.effective_divergence_grid if cfg.profile.has_divergence_grid else None,
        max_model_len=cfg.max_model_len,
        connector=cfg.connector,
        roles=cfg.roles if cfg.uses_mooncake else None,
        store=cfg.store if cfg.uses_mooncake else None,
        store_address=f"{LOOPBACK}:{cfg.store_port}" if cfg.starts_store else None,
        log_dir=str(cfg.log_dir),
        request_logs={role: str(request_log_path(cfg, role)) for role in ("producer", "consumer")}
        if cfg.profile.hits_from == "request_log"
        else None,
        pids=pids,
        restarts=restarts or {},
    )


def write_json_atomically(path: Path, content: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    staging.write_text(json.dumps(content, indent=2) + "\n")
    os.replace(staging, path)


def default_log_dir() -> Path:
    return Path.cwd() / "logs" / f"serve-pair-{datetime.now():%Y%m%d-%H%M%S}"


Reporter = Callable[[str], None]
