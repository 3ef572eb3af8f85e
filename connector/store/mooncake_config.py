"""The Mooncake backend's settings: the ``mooncake`` section of the connector config and the Mooncake
JSON file that may fill it. The client and the backend's registration are ``mooncake.py``.

Mooncake settings come from the extra config, or from a Mooncake JSON file named by
``mooncake_config_path``; fields given in the extra config win over the file. The
``MOONCAKE_CONFIG_PATH`` environment variable is read only where the extra config leaves the store's
settings to it (neither ``mooncake_config_path`` nor a master address): a stale one never stops an
engine whose config is whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..configerrors import ConfigError, bad_value

NAME = "mooncake"
CONFIG_ENV = "MOONCAKE_CONFIG_PATH"
CONFIG_PATH_OPTION = "mooncake_config_path"
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
        "it copy instead of faulting (connector/store/segment.py); the segment is then resident from the start",
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


FIELDS: tuple[str, ...] = tuple(MooncakeSettings.model_fields)


def read_settings(raw: dict[str, Any]) -> str:
    """Merge the Mooncake file ``raw`` names (``mooncake_config_path``, popped), or else the one
    ``MOONCAKE_CONFIG_PATH`` names where the extra config names no master, under what the extra config
    gives; returns where the store's settings come from, for the log."""
    from_file, source = _settings_file(raw)
    section = raw.get(NAME, {})
    if from_file and isinstance(section, dict):  # the file's fields, under what the extra config gives
        given = {**section, **{name: raw[name] for name in FIELDS if name in raw}}
        raw[NAME] = {**{k: v for k, v in from_file.items() if k not in given}, **section}
    return source


def _settings_file(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    path = raw.pop(CONFIG_PATH_OPTION, None)
    if path is not None:
        if not isinstance(path, str) or not path:
            raise ConfigError.of(bad_value(CONFIG_PATH_OPTION, path, "it should be the path of a Mooncake JSON file"))
        source = f"the extra config, over the file {path} ({CONFIG_PATH_OPTION})"
        return _read_file(path, CONFIG_PATH_OPTION, "field"), source
    section = raw.get(NAME) or {}
    names_master = "master_server_address" in raw or not isinstance(section, dict) or "master_server_address" in section
    path = os.environ.get(CONFIG_ENV)
    if names_master or not path:
        return {}, "the extra config" + (f" ({CONFIG_ENV} {path} is not read)" if path else "")
    source = f"the file {path} ({CONFIG_ENV}; fields in the extra config win)"
    return _read_file(path, CONFIG_ENV, "environment variable"), source


def _read_file(path: str, name: str, kind: str) -> dict[str, Any]:
    """The Mooncake fields of the JSON file ``path``, which the ``kind`` ``name`` gives."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        why = f"it should name a readable Mooncake JSON file ({exc.strerror or exc})"
        raise ConfigError.of(bad_value(name, path, why, kind=kind)) from None
    except ValueError as exc:
        why = f"it should name a Mooncake JSON file (the file is not JSON: {exc})"
        raise ConfigError.of(bad_value(name, path, why, kind=kind)) from None
    fields = {field: data[field] for field in FIELDS if field in data} if isinstance(data, dict) else {}
    if not fields:
        held = "no Mooncake field" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        why = f"it should name a JSON object of {', '.join(FIELDS)} (the file holds {held})"
        raise ConfigError.of(bad_value(name, path, why, kind=kind))
    return fields
