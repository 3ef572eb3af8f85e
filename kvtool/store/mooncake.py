"""The pair's store processes, as command lines and environments: the Mooncake master, the standalone
Mooncake store, and (``--connector lmcache``) LMCache's multiprocess server; and the Mooncake file config
vLLM's in-tree store connector reads. Pure builders; kvtool.pair.launch starts and supervises them."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtool.errors import UserError
from kvtool.procs import LOOPBACK

if TYPE_CHECKING:
    from kvtool.pair.config import ServePairConfig

MiB = 1 << 20
LMCACHE_L1_GIB = 2  # the LMCache server's host memory for KV (its L1 tier)


def vllm_mooncake_file_config(
    master_address: str, global_segment_size: int = 256 * MiB, local_buffer_size: int = 64 * MiB
) -> dict[str, Any]:
    """The JSON that MOONCAKE_CONFIG_PATH names for vLLM's in-tree MooncakeStoreConnector."""
    config: dict[str, Any] = {
        "local_hostname": LOOPBACK,
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": global_segment_size,
        "local_buffer_size": local_buffer_size,
        "protocol": "tcp",
        "device_name": "",
        "master_server_address": master_address,
    }
    if global_segment_size == 0:
        config["mode"] = "standalone-store"  # vLLM refuses a zero segment in its default "embedded" mode
    return config


def mooncake_config_path(cfg: ServePairConfig) -> Path:
    return cfg.log_dir / "mooncake-store.json"


def find_binary(name: str) -> str:
    """A Mooncake binary from the running venv first (not always on PATH), then from PATH."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    found = shutil.which(name)
    if found is None:
        raise UserError(
            f"{name} was not found next to {sys.executable} or on PATH; run scripts/setup "
            "(it installs mooncake-transfer-engine-non-cuda)",
            exit_code=1,
        )
    return found


def master_argv(
    rpc_port: int | str, admin_port: int | str, binary: str = "mooncake_master", host: str = LOOPBACK
) -> list[str]:
    """A master bound to ``host`` (127.0.0.1 unless a multi-host setup names its own address): its RPC port
    (store clients) and its admin port (HTTP metrics and keys)."""
    return [
        binary,
        f"--rpc_address={host}",
        f"--rpc_port={rpc_port}",
        f"--metrics_host={host}",
        f"--metrics_port={admin_port}",
        # Its HTTP metadata server would bind every interface; P2PHANDSHAKE needs none.
        "--enable_http_metadata_server=false",
        "--logtostderr=true",
    ]


def store_argv(cfg: ServePairConfig, binary: str = "mooncake_client") -> list[str]:
    assert cfg.master_address is not None
    return standalone_store_argv(cfg.master_address, cfg.store_port, cfg.store_segment_bytes, binary)


def standalone_store_argv(
    master_address: str, port: int, segment_bytes: int, binary: str = "mooncake_client", host: str = LOOPBACK
) -> list[str]:
    """A standalone store (``mooncake_client``) bound to ``host``, lending ``segment_bytes`` to the store."""
    return [
        binary,
        f"--host={host}",
        f"--port={port}",
        f"--master_server_address={master_address}",
        "--metadata_server=P2PHANDSHAKE",
        "--protocol=tcp",
        f"--global_segment_size={segment_bytes}",
        f"--local_buffer_size={16 * MiB}",
        "--logtostderr=true",
    ]


def mooncake_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["MC_TCP_BIND_ADDRESS"] = LOOPBACK
    return env


def lmcache_argv(cfg: ServePairConfig, binary: str = "lmcache") -> list[str]:
    """LMCache's multiprocess KV server on loopback: chunks of one block (it reuses whole chunks), its
    requests on --store-port and its HTTP admin API (no authentication) on --admin-port, both 127.0.0.1."""
    return [
        binary,
        "server",
        "--host",
        LOOPBACK,
        "--port",
        str(cfg.store_port),
        "--chunk-size",
        str(cfg.effective_block_size),
        "--l1-size-gb",
        str(LMCACHE_L1_GIB),
        "--eviction-policy",
        "LRU",
        "--http-host",
        LOOPBACK,
        "--http-port",
        str(cfg.admin_port),
        "--disable-observability",
        "--disable-metrics",
        # vLLM CPU workers move KV engine-driven; the server's default serves only the server-driven path.
        "--supported-transfer-mode",
        "auto",
    ]


def lmcache_binary() -> str:
    """The ``lmcache`` command of the running venv, or one sentence on how to install it."""
    if importlib.util.find_spec("lmcache") is None:
        raise UserError(
            "--connector lmcache needs LMCache, which the set-up installs only when asked: run "
            "scripts/setup --with-lmcache (it adds lmcache 0.5.6 beside the CPU stack)",
            exit_code=2,
        )
    return find_binary("lmcache")
