"""The connector's configuration: one typed, validated object built from ``kv_connector_extra_config``.

A store backend's settings live in its own section (``mooncake``: ``MooncakeSettings``); the same
fields at the top level, as every config before the section wrote them, are still accepted and moved
there. Mooncake settings come from the extra config, or from a Mooncake JSON file named by
``mooncake_config_path``; fields given in the extra config win over the file. The ``MOONCAKE_CONFIG_PATH``
environment variable is read only where the extra config leaves the store's settings to it (neither
``mooncake_config_path`` nor a master address): a stale one never stops an engine whose config is whole.

Every setting is checked where it is read, with exact types (``true`` is no number, ``"2"`` no
timeout): a bad one is one sentence naming the field, its value and what it accepts (``bad_value``).
What only the engine knows is checked where the connector learns it: the block size
(``check_block_size``) and an object's size (the worker's staging areas).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Literal, get_args

from annotated_types import Ge, Gt, MinLen
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

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


logger = logging.getLogger("vllm.kvtool")


class ConfigError(ValueError):
    """A bad connector configuration; the message names the field, its value and what it accepts."""

    @classmethod
    def of(cls, *problems: str) -> ConfigError:
        return cls("kvtool connector config: " + "; ".join(problems))


def bad_value(field: str, value: Any, accepts: str, *, kind: str = "field") -> str:
    """One bad setting as every check says it, the value as the config's JSON writes it: ``field
    'hash_unit' is true; it should be a whole number above 0``."""
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"{kind} {field!r} is {shown}; {accepts}"


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
            size = float(number) * _SIZE_UNITS[unit]
        except (KeyError, ValueError):
            size = -1.0
        if 0 <= size < float("inf"):  # neither negative, nor nan, nor inf ("infGB")
            return int(size)
    raise ValueError(f"{value!r} is not a size; give bytes or a size such as 4GB, 512MB")


class MooncakeSettings(BaseModel):
    """The Mooncake store client's settings: the ``mooncake`` section of the connector config (the same
    fields at the top level are still accepted and moved here)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    master_server_address: str = Field(description="host:port of the mooncake_master RPC")
    metadata_server: str = Field(default="P2PHANDSHAKE", min_length=1)
    local_hostname: str = Field(default="127.0.0.1", min_length=1)
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
        try:
            master_endpoints(value)
        except ValueError as exc:
            raise ValueError(f"it {exc}") from None
        return value

    @field_validator("global_segment_size", "local_buffer_size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int:
        try:
            return parse_size(value)
        except ValueError:
            raise ValueError("it should be a number of bytes or a size such as 4GB or 512MB") from None


MOONCAKE_FIELDS: tuple[str, ...] = tuple(MooncakeSettings.model_fields)


class KVToolConfig(BaseModel):
    # Exact types (a bool is no number, "2" no timeout; an int is a float), finite numbers.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

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
        if not isinstance(section, dict | MooncakeSettings):
            raise ValueError(bad_value("mooncake", section, f"it should be an object of {', '.join(MOONCAKE_FIELDS)}"))
        section = dict(section.model_dump() if isinstance(section, MooncakeSettings) else section)
        for name in _MOONCAKE_FIELDS:
            if name in data:
                value = data.pop(name)
                if name in section and section[name] != value:
                    raise ValueError(
                        bad_value(
                            name, value, f"the mooncake section gives it as {json.dumps(section[name])}; give it once"
                        )
                    )
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
    model_id: str | None = Field(
        default=None, min_length=1, description="model identity in the namespace; default: served model"
    )
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
    request_log: str | None = Field(
        default=None, min_length=1, description="path of a JSONL file of per-request hit details"
    )

    # Testing only: a JSON fault plan (connector/faults.py) re-read while the engine runs.
    fault_control_file: str | None = Field(default=None, min_length=1)

    # Fail-closed time-outs.
    lookup_timeout_s: float = Field(default=2.0, gt=0)
    load_timeout_s: float = Field(default=10.0, gt=0)
    save_timeout_s: float = Field(default=30.0, gt=0)
    connect_timeout_s: float = Field(default=10.0, gt=0)

    # Never a stall: a failing store is skipped for a back-off; saves wait in bounded host memory.
    breaker_failures: int = Field(default=3, gt=0, description="failed store calls in a row that open the breaker")
    breaker_backoff_s: float = Field(default=1.0, gt=0, description="first back-off of an open breaker, doubling")
    breaker_max_backoff_s: float = Field(default=10.0, gt=0)
    # A slow store costs hits, never time: a lookup's store call answered later than this counts toward
    # the breaker like a failure, so a slow store is bypassed. An idle loopback call takes 0.1-2 ms; on a
    # busy 2-core CPU engine (CI) healthy calls took up to 60 ms, behind the engine's steps for the GIL.
    slow_call_ms: float = Field(
        default=150.0, gt=0, description="a scheduler-side store call slower than this counts as failed"
    )
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

    @field_validator("divergence_grid", mode="before")
    @classmethod
    def _grid(cls, value: Any) -> int | str:
        if value == "auto" or (type(value) is int and value >= 0):
            return value
        raise ValueError("it should be 0 (no pointers), a whole number of tokens up to the block size, or 'auto'")

    @model_validator(mode="after")
    def _backoffs_in_order(self) -> KVToolConfig:
        if self.breaker_backoff_s > self.breaker_max_backoff_s:
            raise ValueError(
                bad_value(
                    "breaker_backoff_s",
                    self.breaker_backoff_s,
                    f"the first back-off should be at most breaker_max_backoff_s ({self.breaker_max_backoff_s})",
                )
            )
        return self


def check_block_size(config: KVToolConfig, block_size: int) -> None:
    """The token grids inside a block against the engine's block size, which the connector learns at
    its start (``layout.engine_layout``): a grid as wide as the block has no point inside it (no tails,
    no pointers); a wider one is a mistake."""
    problems = []
    if config.hash_unit > block_size:
        rule = f"it should be at most the engine's block size, {block_size} (tail boundaries lie inside a block)"
        problems.append(bad_value("hash_unit", config.hash_unit, rule))
    if config.divergence_grid != "auto" and config.divergence_grid > block_size:
        rule = f"it should be 0 (no pointers), 'auto', or at most the engine's block size, {block_size}"
        problems.append(bad_value("divergence_grid", config.divergence_grid, rule))
    if problems:
        raise ConfigError.of(*problems)


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


# vLLM's KV transfer roles (its ``kv_role``), declared once for the connector and for kvtool.
KV_PRODUCER, KV_CONSUMER, KV_BOTH = "kv_producer", "kv_consumer", "kv_both"
KV_ROLES = (KV_PRODUCER, KV_CONSUMER, KV_BOTH)
LOADING_ROLES = (KV_CONSUMER, KV_BOTH)  # a connector in these loads from the store
SAVING_ROLES = (KV_PRODUCER, KV_BOTH)  # ... and in these saves to it


MOONCAKE_CONFIG_ENV = "MOONCAKE_CONFIG_PATH"


def load_config(extra_config: dict[str, Any] | None) -> KVToolConfig:
    """Build the validated config; raise ConfigError with one sentence per bad field."""
    if not isinstance(extra_config, dict | None):
        accepts = "it should be an object of the kvtool connector's fields"
        raise ConfigError.of(bad_value("kv_connector_extra_config", extra_config, accepts))
    raw = dict(extra_config or {})
    from_file, source = _store_settings_file(raw)
    section = raw.get("mooncake", {})
    if from_file and isinstance(section, dict):  # the file's fields, under what the extra config gives
        given = {**section, **{name: raw[name] for name in _MOONCAKE_FIELDS if name in raw}}
        raw["mooncake"] = {**{k: v for k, v in from_file.items() if k not in given}, **section}
    try:
        config = KVToolConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError.of(*(_problem(error) for error in exc.errors())) from None
    logger.info("kvtool: the store's settings come from %s", source)
    return config


def _store_settings_file(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The Mooncake fields of the file to read (popping ``mooncake_config_path`` from ``raw``), and
    where the store's settings come from, said in the log. ``MOONCAKE_CONFIG_PATH`` is read only where
    the extra config names no file and no master: then it leaves the store's settings to it."""
    path = raw.pop("mooncake_config_path", None)
    if path is not None:
        if not isinstance(path, str) or not path:
            accepts = "it should be the path of a Mooncake JSON file"
            raise ConfigError.of(bad_value("mooncake_config_path", path, accepts))
        source = f"the extra config, over the file {path} (mooncake_config_path)"
        return _read_mooncake_file(path, "mooncake_config_path", "field"), source
    section = raw.get("mooncake") or {}
    names_master = "master_server_address" in raw or not isinstance(section, dict) or "master_server_address" in section
    path = os.environ.get(MOONCAKE_CONFIG_ENV)
    if names_master or not path:
        return {}, "the extra config" + (f" ({MOONCAKE_CONFIG_ENV} {path} is not read)" if path else "")
    source = f"the file {path} ({MOONCAKE_CONFIG_ENV}; fields in the extra config win)"
    return _read_mooncake_file(path, MOONCAKE_CONFIG_ENV, "environment variable"), source


def _read_mooncake_file(path: str, name: str, kind: str) -> dict[str, Any]:
    """The Mooncake fields of the JSON file ``path``, which the ``kind`` ``name`` gives."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        why = f"it should name a readable Mooncake JSON file ({exc.strerror or exc})"
        raise ConfigError.of(bad_value(name, path, why, kind=kind)) from None
    except ValueError as exc:
        why = f"it should name a Mooncake JSON file (the file is not JSON: {exc})"
        raise ConfigError.of(bad_value(name, path, why, kind=kind)) from None
    fields = {field: data[field] for field in _MOONCAKE_FIELDS if field in data} if isinstance(data, dict) else {}
    if not fields:
        held = "no Mooncake field" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        why = f"it should name a JSON object of {', '.join(_MOONCAKE_FIELDS)} (the file holds {held})"
        raise ConfigError.of(bad_value(name, path, why, kind=kind))
    return fields


_FIELDS = {**KVToolConfig.model_fields, **MooncakeSettings.model_fields}  # by name, the section's too
_ACCEPTED = ", ".join(sorted({*_FIELDS, "mooncake_config_path"} - {"mooncake"}))


def _problem(error: ErrorDetails) -> str:
    """One of pydantic's errors as one sentence: the field, its value and what it accepts."""
    field = ".".join(str(part) for part in error["loc"])
    cause = error.get("ctx", {}).get("error")
    if not field:  # a check of the whole config, which says its sentence itself
        return str(cause or error["msg"])
    if error["type"] == "extra_forbidden":
        return f"unknown field {field!r} (accepted: {_ACCEPTED})"
    info = _FIELDS.get(str(error["loc"][-1]))
    if error["type"] == "missing":
        return f"field {field!r} is missing; give it" + (f": {info.description}" if info and info.description else "")
    if cause is not None:  # a validator of the config's, which says what the field accepts
        return bad_value(field, error["input"], str(cause))
    accepts = (_accepts(str(error["loc"][-1]), info) if info else None) or _pydantic_words(error["msg"])
    return bad_value(field, error["input"], accepts)


def _pydantic_words(message: str) -> str:
    """``Input should be 'tcp' or 'rdma'`` as the rest of the sentence: ``it should be 'tcp' or 'rdma'``."""
    return re.sub(r"^(Input|String|Value) should", "it should", message)


_KINDS: dict[Any, str] = {int: "a whole number", float: "a finite number", bool: "true or false", str: "a string"}
_UNITS = {"_s": " of seconds", "_bytes": " of bytes", "_size": " of bytes", "_tokens": " of tokens"}


def _accepts(name: str, info: FieldInfo) -> str | None:
    """What a plain field accepts, said from its type and bounds (``it should be a finite number of
    seconds above 0``); None for the others, which pydantic's words say (a Literal's choices)."""
    optional = type(None) in get_args(info.annotation)
    kind = next(a for a in get_args(info.annotation) if a is not type(None)) if optional else info.annotation
    if kind not in _KINDS:
        return None
    what = _KINDS[kind]
    if kind in (int, float):
        what += next((unit for suffix, unit in _UNITS.items() if name.endswith(suffix)), "")
    for bound in info.metadata:
        if isinstance(bound, Gt):
            what += f" above {bound.gt}"
        elif isinstance(bound, Ge):
            what += f", {bound.ge} or more"
        elif isinstance(bound, MinLen):
            what = what.replace("a string", "a non-empty string")
    return f"it should be {what}" + (", or null" if optional else "")
