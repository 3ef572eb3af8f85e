"""The connector's configuration: one typed, validated object built from ``kv_connector_extra_config``.

The store backend's settings are its own section, named after it and typed by it
(``store.backends.BACKENDS``: ``config.backend``); the same fields at the top level, as every config
before the section wrote them, are still accepted and moved there, and the backend's own options
(a settings file) are read by the backend (``Backend.read_settings``).

Every setting is checked where it is read, with exact types (``true`` is no number, ``"2"`` no
timeout): a bad one is one sentence naming the field, its value and what it accepts (``bad_value``).
What only the engine knows is checked where the connector learns it: the block size
(``check_block_size``) and an object's size (the worker's staging areas).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Literal, get_args

from annotated_types import Ge, Gt, MinLen
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from .configerrors import ConfigError, bad_value
from .store.backends import BACKENDS, DEFAULT_BACKEND, BackendSettings

logger = logging.getLogger("vllm.kvtool")


EXTEND_MIN_TOKENS = 16  # extend_min_tokens' default


class KVToolConfig(BaseModel):
    # Exact types (a bool is no number, "2" no timeout; an int is a float), finite numbers.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    # The store: its backend (``store.backends.BACKENDS``) and that backend's own section, given in the
    # config under the backend's name (``"mooncake": {...}`` for the default).
    store_backend: str = Field(default=DEFAULT_BACKEND, description="the store backend")
    backend: BackendSettings  # type: ignore[valid-type]

    @model_validator(mode="before")
    @classmethod
    def _backend_section(cls, data: Any) -> Any:
        """The backend's section, given under its name, becomes ``backend``; its fields at the top level
        (every config before the section) go into it, and one given both ways with different values is
        refused."""
        if not isinstance(data, dict):
            return data
        if "backend" in data:  # the field is the section's type; a config names the section by its backend
            raise ValueError(
                f"unknown field 'backend' (the store's settings go in its backend's section, {_ACCEPTED_SECTIONS})"
            )
        name = data.get("store_backend", DEFAULT_BACKEND)
        backend = BACKENDS.get(name) if isinstance(name, str) else None
        if backend is None:  # no section to read: this alone is what is wrong
            raise ValueError(bad_value("store_backend", name, _known_backends()))
        data = dict(data)
        section = data.pop(backend.name, {})
        if not isinstance(section, dict | backend.settings):
            accepts = f"it should be an object of {', '.join(backend.flat_fields)}"
            raise ValueError(bad_value(backend.name, section, accepts))
        section = dict(section.model_dump() if isinstance(section, BaseModel) else section)
        for name in backend.flat_fields:
            if name in data:
                value = data.pop(name)
                if name in section and section[name] != value:
                    given = json.dumps(section[name])
                    raise ValueError(
                        bad_value(name, value, f"the {backend.name} section gives it as {given}; give it once")
                    )
                section[name] = value
        data["backend"] = section
        return data

    @model_serializer(mode="wrap")
    def _section_by_name(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Written as a config gives it: the backend's section under the backend's name, in its place."""
        data = handler(self)
        return {(self.store_backend if key == "backend" else key): value for key, value in data.items()}

    def with_backend(self, **changes: Any) -> KVToolConfig:
        """This config with some of its backend section's fields changed."""
        return self.model_copy(update={"backend": self.backend.model_copy(update=changes)})

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


_ACCEPTED_SECTIONS = " or ".join(f'"{name}": {{...}}' for name in BACKENDS)


def _known_backends() -> str:
    return f"it should be one of {', '.join(json.dumps(name) for name in BACKENDS)}"


def load_config(extra_config: dict[str, Any] | None) -> KVToolConfig:
    """Build the validated config; raise ConfigError with one sentence per bad field."""
    if not isinstance(extra_config, dict | None):
        accepts = "it should be an object of the kvtool connector's fields"
        raise ConfigError.of(bad_value("kv_connector_extra_config", extra_config, accepts))
    raw = dict(extra_config or {})
    name = raw.get("store_backend", DEFAULT_BACKEND)
    backend = BACKENDS.get(name) if isinstance(name, str) else None
    source = backend.read_settings(raw) if backend is not None else "the extra config"
    try:
        config = KVToolConfig.model_validate(raw)
    except ValidationError as exc:
        section = backend.name if backend is not None else "backend"
        raise ConfigError.of(*(_problem(error, section) for error in exc.errors())) from None
    logger.info("kvtool: the store's settings come from %s", source)
    return config


# Every field by name, the backends' sections' too; what the top level accepts.
_FIELDS = {
    **KVToolConfig.model_fields,
    **{name: info for backend in BACKENDS.values() for name, info in backend.settings.model_fields.items()},
}
_ACCEPTED = ", ".join(
    sorted(
        {*KVToolConfig.model_fields, *(n for b in BACKENDS.values() for n in (b.name, *b.flat_fields, *b.options))}
        - {"backend"}
    )
)


def _problem(error: ErrorDetails, section: str) -> str:
    """One of pydantic's errors as one sentence: the field, its value and what it accepts; a field of
    the backend's section named as the config writes it (``mooncake.protocol``)."""
    loc = [section if index == 0 and part == "backend" else str(part) for index, part in enumerate(error["loc"])]
    field = ".".join(loc)
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
