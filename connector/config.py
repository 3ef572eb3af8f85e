"""The connector's configuration: one typed, validated object built from ``kv_connector_extra_config``.

A store backend's settings live in its own section (``mooncake``: ``MooncakeSettings``); the same
fields at the top level, as every config before the section wrote them, are still accepted and moved
there. Mooncake settings come from the extra config, or from a Mooncake JSON file named by
``mooncake_config_path`` (or the ``MOONCAKE_CONFIG_PATH`` environment variable); fields given in the
extra config win over the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_MOONCAKE_FIELDS = (
    "local_hostname",
    "metadata_server",
    "master_server_address",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "device_name",
    "prefault_segment",
)


class ConfigError(ValueError):
    """A bad connector configuration; the message names the field and what it accepts."""


EXTEND_MIN_TOKENS = 16  # extend_min_tokens' default


HA_PREFIX = "etcd://"  # a master group in high-availability mode, named by its etcd endpoints


def master_endpoints(address: str) -> list[tuple[str, int]]:
    """Where to reach a master: its RPC ``host:port``, or each etcd endpoint of a high-availability group
    (``etcd://host:port;host:port``). Raises ValueError saying what it accepts."""
    parts = address.removeprefix(HA_PREFIX).split(";") if address.startswith(HA_PREFIX) else [address]
    endpoints = []
    for part in parts:
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                "is not HOST:PORT or etcd://HOST:PORT[;HOST:PORT] (an HA group); give it like 127.0.0.1:50051"
            )
        endpoints.append((host, int(port)))
    return endpoints


_SIZE_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}


def parse_size(value: Any) -> int:
    """Bytes from a whole number or a size string as Mooncake's files write them ("4GB", "512 MB", "1.5gb";
    binary units: a KB is 1024 bytes). Raises ValueError naming what it accepts."""
    if isinstance(value, bool):
        raise ValueError("must be a number of bytes or a size such as 4GB")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "").removesuffix("ib").removesuffix("b")
        number = text.rstrip("kmgt")
        unit = (text[len(number) :] + "b") if text[len(number) :] else ""
        try:
            return int(float(number) * _SIZE_UNITS[unit])
        except (KeyError, ValueError):
            pass
    raise ValueError(f"{value!r} is not a size; give bytes or a size such as 4GB, 512MB")


class MooncakeSettings(BaseModel):
    """The Mooncake store client's settings: the ``mooncake`` section of the connector config (the same
    fields at the top level are still accepted and moved here)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    master_server_address: str = Field(min_length=3, description="host:port of the mooncake_master RPC")
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = ""
    global_segment_size: int = Field(default=256 << 20, ge=0, description="bytes this engine lends the store")
    local_buffer_size: int = Field(default=64 << 20, gt=0, description="client transfer buffer, bytes")
    prefault_segment: bool = Field(
        default=True,
        description="fault the lent segment's pages in at start-up, on a background thread, so that puts into "
        "it copy instead of faulting (connector/segment.py); the segment is then resident from the start",
    )

    @field_validator("master_server_address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        """host:port of one master, or etcd://host:port[;host:port...] of a high-availability group."""
        master_endpoints(value)
        return value

    @field_validator("global_segment_size", "local_buffer_size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int:
        return parse_size(value)


MOONCAKE_FIELDS: tuple[str, ...] = tuple(MooncakeSettings.model_fields)


class KVToolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # The store: its backend (connector/store.py BACKENDS) and that backend's own section.
    store_backend: Literal["mooncake"] = "mooncake"
    mooncake: MooncakeSettings

    @model_validator(mode="before")
    @classmethod
    def _flat_store_fields(cls, data: Any) -> Any:
        """Mooncake's fields at the top level (every config before the ``mooncake`` section) go into it;
        one given both ways with different values is refused."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        section = data.get("mooncake", {})
        section = dict(section.model_dump() if isinstance(section, MooncakeSettings) else section or {})
        for name in _MOONCAKE_FIELDS:
            if name in data:
                value = data.pop(name)
                if name in section and section[name] != value:
                    raise ValueError(f"{name} is given at the top level and in the mooncake section, differently")
                section[name] = value
        data["mooncake"] = section
        return data

    def with_mooncake(self, **changes: Any) -> KVToolConfig:
        """This config with some of the Mooncake section's fields changed."""
        return self.model_copy(update={"mooncake": self.mooncake.model_copy(update=changes)})

    # Keys and hashing.
    hash_unit: int = Field(default=1, gt=0, description="tail boundary grid, tokens")
    divergence_grid: int | Literal["auto"] = Field(
        default="auto",
        description="pointer grid inside stored objects, tokens: pointers at the grid's multiples inside them "
        "carry the object's token ids, so a prompt that leaves a stored one past a grid point finds their exact "
        "common prefix; a finer grid tells more stored prompts apart; 0 turns pointers off; auto: see "
        "divergence_grid()",
    )
    extend_min_tokens: int = Field(
        default=EXTEND_MIN_TOKENS,
        ge=1,
        description="where the grid is wider than this, saves also put a lead pointer at each object's first "
        "token, and a hit through it is taken only when it reuses at least this many tokens of that block "
        "(loading a block to save a few tokens of prefill costs more than it saves)",
    )
    skip_unprofitable_loads: bool = Field(
        default=True,
        description="take a hit only when its load is predicted to cost less than the prefill it saves (fitted "
        "from the engine's own load and forward-pass times); a partial block that does not pay is dropped",
    )
    model_id: str | None = Field(default=None, description="model identity in the namespace; default: served model")
    weights_digest: str = Field(default="", description="optional weights digest folded into the namespace")

    # A decoding engine (kv_consumer or kv_both) also saves, at request end, the KV of prompt + answer:
    # the blocks not yet stored and the exact tail, so that a chat's next turn reuses the answer too.
    save_answers: bool = Field(default=False, description="save prompt + generated tokens at request end")

    # vLLM resets its caches on pause (pause_generation, sleep) with clear_cache, the step before a weight
    # update: stop sharing KV through the store from then on (the safe default), or keep sharing (an engine
    # paused or put to sleep whose weights never change).
    on_cache_reset: Literal["stop_sharing", "keep_sharing"] = Field(
        default="stop_sharing",
        description="what a reset of vLLM's caches (pause or sleep with clear_cache, a weight update) does: "
        "stop_sharing (no lookup, load or save until the engine restarts) or keep_sharing (weights never change)",
    )

    # Observability: one JSON line per finished request with its hit details (for kvtool bench).
    request_log: str | None = Field(default=None, description="path of a JSONL file of per-request hit details")

    # Testing only: a JSON fault plan (connector/faults.py) re-read while the engine runs.
    fault_control_file: str | None = None

    # Fail-closed time-outs.
    lookup_timeout_s: float = Field(default=2.0, gt=0)
    load_timeout_s: float = Field(default=10.0, gt=0)
    save_timeout_s: float = Field(default=30.0, gt=0)
    connect_timeout_s: float = Field(default=10.0, gt=0)

    # Never a stall: a failing store is skipped for a back-off; saves wait in bounded host memory.
    breaker_failures: int = Field(default=3, gt=0, description="failed store calls in a row that open the breaker")
    breaker_backoff_s: float = Field(default=1.0, gt=0, description="first back-off of an open breaker, doubling")
    breaker_max_backoff_s: float = Field(default=10.0, gt=0)
    save_buffer_bytes: int = Field(
        default=256 << 20,
        gt=0,
        description="the save staging area (resident): host copies of saves waiting for their puts, at most; "
        "beyond, dropped",
    )
    load_buffer_bytes: int = Field(
        default=256 << 20,
        gt=0,
        description="fetched objects of loads in flight, at most; a load that does not fit waits its turn "
        "(one load always runs)",
    )
    shutdown_drain_s: float = Field(default=10.0, ge=0, description="how long shutdown lets queued saves finish")

    @field_validator("divergence_grid")
    @classmethod
    def _grid(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be 0 (no pointers), a positive number of tokens, or auto")
        return value


def lead_pointers(config: KVToolConfig, block_size: int) -> bool:
    """Whether saves put a lead pointer at each object's first token too (``has_lead_pointers``)."""
    return has_lead_pointers(divergence_grid(config, block_size), config.extend_min_tokens)


def has_lead_pointers(grid: int, extend_min_tokens: int = EXTEND_MIN_TOKENS) -> bool:
    """Where the grid's first point inside a block lies further than ``extend_min_tokens``: so that a
    prompt leaving a stored one between the two still reuses the exact common prefix (past that point
    it finds the grid's pointer)."""
    return grid > extend_min_tokens


def divergence_grid(config: KVToolConfig, block_size: int) -> int:
    """The divergence grid in tokens (0: no pointers). ``auto`` is a quarter block: 3 pointer keys per
    stored block, which is 4 keys in the master where there was 1 (each costs the master about 850
    bytes of memory whatever the block's size; benchmarks/divergence-index), for divergence points
    found within block_size / 4 tokens; 1 finds every one exactly, for a key per token."""
    if config.divergence_grid != "auto":
        return config.divergence_grid
    return max(1, block_size // AUTO_POINTERS_GRID_DIVISOR)


AUTO_POINTERS_GRID_DIVISOR = 4


def load_config(extra_config: dict[str, Any] | None) -> KVToolConfig:
    """Build the validated config; raise ConfigError with one sentence per bad field."""
    raw = dict(extra_config or {})
    file_path = raw.pop("mooncake_config_path", None) or os.environ.get("MOONCAKE_CONFIG_PATH")
    merged: dict[str, Any] = dict(raw)
    if file_path:  # the file's fields, under what the extra config gives (flat or in its section)
        given = {**(raw.get("mooncake") or {}), **{name: raw[name] for name in _MOONCAKE_FIELDS if name in raw}}
        from_file = {k: v for k, v in _read_mooncake_file(Path(file_path)).items() if k not in given}
        if from_file:
            merged["mooncake"] = {**from_file, **(raw.get("mooncake") or {})}
    try:
        return KVToolConfig(**merged)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"]) or "(config)"
            if error["type"] == "extra_forbidden":
                accepted = ", ".join(
                    sorted({*KVToolConfig.model_fields, *MooncakeSettings.model_fields} - {"mooncake"})
                )
                problems.append(f"unknown field {field!r} (accepted: {accepted})")
            else:
                problems.append(f"field {field!r}: {error['msg']}")
        raise ConfigError("kvtool connector config: " + "; ".join(problems)) from None


def _read_mooncake_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read Mooncake config file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Mooncake config file {path} must hold a JSON object")
    return {name: data[name] for name in _MOONCAKE_FIELDS if name in data}
