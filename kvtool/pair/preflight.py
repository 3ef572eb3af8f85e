"""Every foreseeable start-up failure of a pair as one ``UserError`` sentence, before anything starts."""

from __future__ import annotations

from kvtool.errors import UserError
from kvtool.pair.config import CPU_BLOCK_MULTIPLE, HA_PREFIX, ServePairConfig, master_endpoints
from kvtool.pair.engines import is_cpu_vllm
from kvtool.procs import ensure_port_free, tcp_port_open
from kvtool.pair.router import router_binary
from kvtool.store.mooncake import find_binary, lmcache_binary


def preflight(cfg: ServePairConfig) -> None:
    """Turn every foreseeable start-up failure into one UserError sentence before anything starts."""
    check_model(cfg)
    ports = check_values(cfg)
    for port, flag in ports:
        ensure_port_free(port, flag)

    if cfg.external_master is not None:
        endpoints = master_endpoints(cfg.external_master, "--master")
        if not any(tcp_port_open(port, host) for host, port in endpoints):
            group = cfg.external_master.startswith(HA_PREFIX)
            what = "etcd endpoint of the master group" if group else "Mooncake master"
            raise UserError(f"no {what} answers at {cfg.external_master}; start one or drop --master")
    if cfg.starts_master:
        find_binary("mooncake_master")
    if cfg.starts_store:
        find_binary("mooncake_client")
    if cfg.starts_lmcache:
        lmcache_binary()
    if cfg.is_fleet:
        router_binary()


def check_fleet(cfg: ServePairConfig) -> None:
    """A fleet's own settings: two engines or more, a port for each, a connector that runs kv_both."""
    if cfg.engine_ports and len(cfg.engine_ports) != cfg.engines:
        raise UserError(
            f"--engine-port is given {len(cfg.engine_ports)} time(s) for --engines {cfg.engines}; give one "
            "port per engine, or none (then engine i listens on --producer-port + i)"
        )
    if not cfg.is_fleet:
        return
    if cfg.engines < 2:
        raise UserError(f"--engines {cfg.engines} is no fleet; give 2 or more (or leave it out for the pair)")


def check_model(cfg: ServePairConfig) -> None:
    """The model directory exists and holds a Hugging Face config."""
    if not cfg.model.exists():
        raise UserError(f"model path {cfg.model} does not exist; pass a Hugging Face model directory with --model")
    if not (cfg.model / "config.json").is_file():
        raise UserError(f"{cfg.model} has no config.json; --model must name a Hugging Face model directory")


def check_values(cfg: ServePairConfig) -> list[tuple[int, str]]:
    """The checks that need no I/O (``kvtool config validate`` runs them too); the ports the pair will
    bind, each with its flag."""
    if is_cpu_vllm() and cfg.block_size % CPU_BLOCK_MULTIPLE:
        raise UserError(
            f"--block-size {cfg.block_size} is not supported by vLLM's CPU attention backend; "
            f"use a multiple of {CPU_BLOCK_MULTIPLE}"
        )
    if is_cpu_vllm() and (cfg.kv_cache_gib < 1 or not float(cfg.kv_cache_gib).is_integer()):
        raise UserError(
            f"--kv-cache-gib {cfg.kv_cache_gib:g} cannot be given to vLLM's CPU backend, which takes whole "
            "GiB (VLLM_CPU_KVCACHE_SPACE); use a whole number, 1 or more"
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

    check_fleet(cfg)
    if cfg.is_fleet:
        flag = "--engine-port" if cfg.engine_ports else "--producer-port (+ the engine's index)"
        ports = [(cfg.port(name), f"{flag} of {name}") for name in cfg.engine_names]
        ports += [(cfg.router_port, "--router-port"), (cfg.router_metrics_port, "--router-metrics-port")]
        if cfg.publishes_kv_events:
            ports += [
                (cfg.kv_events_port + index, "--kv-events-port (+ the engine's index)") for index in range(cfg.engines)
            ]
    else:
        ports = [(cfg.producer_port, "--producer-port"), (cfg.consumer_port, "--consumer-port")]
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
    return ports
