"""What each `--connector` choice means, in one place: one profile per connector.

A profile says how an engine is configured for the connector (its kv-transfer config and
environment), whether it needs a Mooncake master, how the bench knows a producer's save is durable,
where the bench reads a consumer's hits, and its colour in plots. serve-pair, launch, bench and
plot ask the profile instead of comparing connector names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from connector.config import KVToolConfig
from connector.store.mooncake_config import FIELDS as MOONCAKE_FIELDS

KVTOOL_CONNECTOR_CLASS = "KVToolConnector"
KVTOOL_CONNECTOR_MODULE = "connector.connector"
VLLM_STORE_CONNECTOR_CLASS = "MooncakeStoreConnector"

# Every --connector choice, declared here only: the CLI, ServePairConfig and the reports take it from
# here, and PROFILES has one entry per choice (a test holds them together).
ConnectorChoice = Literal["kvtool", "vllm-mooncake-store", "lmcache", "none"]

Durability = Literal["signal", "key_count", "settle", "none"]  # save_last_key in the store / master key count quiet
HitSource = Literal["request_log", "usage"]  # the connector's request log / usage.cached_tokens


@dataclass(frozen=True)
class TransferSettings:
    """What an engine's kv-transfer config is built from (serve-pair fills it in)."""

    kv_role: str
    master_address: str | None
    hash_unit: int
    segment_bytes: int
    local_buffer_bytes: int
    request_log: Path | None
    extra: dict[str, Any] | None = None  # further fields of the kvtool connector's config (tests)
    save_answers: bool = False  # the engine also saves prompt + answer at request end (roles both)
    divergence_grid: int | None = None  # the kvtool connector's pointer grid; None: its default (auto)
    take_every_hit: bool = False  # the kvtool connector's cost model off (skip_unprofitable_loads false)
    server_port: int | None = None  # LMCache's multiprocess server, on loopback


@dataclass(frozen=True)
class ConnectorProfile:
    name: str
    uses_store: bool  # needs a Mooncake master (and may take --store standalone, --roles)
    durability: Durability
    hits_from: HitSource
    mooncake_config_file: bool  # reads its Mooncake settings from MOONCAKE_CONFIG_PATH
    color: tuple[int, int, int]
    _transfer: Callable[[TransferSettings], dict[str, Any] | None]
    # vLLM flags its engines get on a model with Mamba state groups (the in-tree store connector's own
    # sub-block hits need sub-block prefix matching; kvtool refuses it, see connector/layout.py).
    state_model_args: tuple[str, ...] = ()
    starts_lmcache: bool = False  # its engines share LMCache's multiprocess server (on --store-port)
    has_divergence_grid: bool = False  # takes --divergence-grid (kvtool's pointers inside stored objects)
    has_roles: bool = True  # takes --roles (no connector: an engine neither saves nor loads)

    def kv_transfer_config(self, settings: TransferSettings) -> dict[str, Any] | None:
        return self._transfer(settings)


def kvtool_extra_config(settings: TransferSettings) -> dict[str, Any]:
    """The kvtool connector's kv_connector_extra_config (validated by connector.config): the store's
    settings in its ``mooncake`` section, kvtool's own at the top level."""
    assert settings.master_address is not None
    store = {
        "master_server_address": settings.master_address,
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "local_hostname": "127.0.0.1",
        "global_segment_size": settings.segment_bytes,
        "local_buffer_size": settings.local_buffer_bytes,
    }
    extra: dict[str, Any] = {"mooncake": store, "hash_unit": settings.hash_unit}
    if settings.request_log is not None:
        extra["request_log"] = str(settings.request_log)
    if settings.save_answers:
        extra["save_answers"] = True
    if settings.divergence_grid is not None:
        extra["divergence_grid"] = settings.divergence_grid
    if settings.take_every_hit:
        extra["skip_unprofitable_loads"] = False
    for name, value in (settings.extra or {}).items():  # a test's further fields, the store's in its section
        (store if name in MOONCAKE_FIELDS else extra)[name] = value
    # Built as the connector will build it: a field it would refuse fails here, before an engine starts.
    # What was set, and only that, is written (the connector fills in its own defaults).
    return KVToolConfig.model_validate(extra).model_dump(mode="json", exclude_unset=True)


# A failed load recomputes instead of failing the request: a store is a cache, not a source of truth.
def _kvtool_transfer(settings: TransferSettings) -> dict[str, Any]:
    return {
        "kv_connector": KVTOOL_CONNECTOR_CLASS,
        "kv_connector_module_path": KVTOOL_CONNECTOR_MODULE,
        "kv_role": settings.kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": kvtool_extra_config(settings),
    }


def _vllm_store_transfer(settings: TransferSettings) -> dict[str, Any]:
    config: dict[str, Any] = {
        "kv_connector": VLLM_STORE_CONNECTOR_CLASS,
        "kv_role": settings.kv_role,
        "kv_load_failure_policy": "recompute",
    }
    if settings.save_answers:  # its own decode-side saves (whole blocks only)
        config["kv_connector_extra_config"] = {"save_decode_cache": True}
    return config


def _lmcache_transfer(settings: TransferSettings) -> dict[str, Any]:
    """LMCache's multiprocess connector (its in-process one moves no KV on the CPU: ENVIRONMENT.md)."""
    assert settings.server_port is not None
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": settings.kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": settings.server_port},
    }


PROFILES: dict[str, ConnectorProfile] = {
    "kvtool": ConnectorProfile(
        "kvtool", True, "signal", "request_log", False, (31, 119, 180), _kvtool_transfer, has_divergence_grid=True
    ),
    "vllm-mooncake-store": ConnectorProfile(
        "vllm-mooncake-store",
        True,
        "key_count",
        "usage",
        True,
        (255, 127, 14),
        _vllm_store_transfer,
        state_model_args=("--prefix-match-unit", "1"),
    ),
    "lmcache": ConnectorProfile(
        "lmcache", False, "settle", "usage", False, (148, 103, 189), _lmcache_transfer, starts_lmcache=True
    ),
    "none": ConnectorProfile(
        "none", False, "none", "usage", False, (44, 160, 44), lambda _settings: None, has_roles=False
    ),
}
CONNECTOR_NAMES: tuple[str, ...] = get_args(ConnectorChoice)


def profile(name: str) -> ConnectorProfile:
    """The profile of a connector name (names are checked at the CLI; a KeyError here is a bug)."""
    return PROFILES[name]
