"""The configuration files an operator deploys, told apart and checked (``kvtool config``). Pure but for
reading the file.

Four kinds:

- ``connector``: vLLM's ``--kv-transfer-config`` (JSON with ``kv_connector``); for the kvtool connector
  its ``kv_connector_extra_config`` is checked as the connector checks it (``connector.config``).
- ``extra``: a kvtool connector's ``kv_connector_extra_config`` alone (JSON).
- ``mooncake``: a Mooncake client file (``MOONCAKE_CONFIG_PATH``, JSON), as vLLM's in-tree store
  connector and the kvtool connector read it.
- ``pair``: a ``kvtool serve-pair --config`` file (TOML): the pair's flags, by name (checked where the
  flags are declared, ``kvtool.commands.pairoptions.PairOptions.with_file``).

A bad file is one ``UserError`` sentence naming the field and what it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from connector.config import KV_ROLES, ConfigError, KVToolConfig, load_config
from connector.store.mooncake_config import FIELDS as MOONCAKE_FIELDS
from connector.store.mooncake_config import parse_size
from kvtool.errors import UserError
from kvtool.files import read_config_file
from kvtool.pair.profiles import KVTOOL_CONNECTOR_CLASS, KVTOOL_CONNECTOR_MODULE

ConfigKind = Literal["connector", "extra", "mooncake", "pair"]
CONFIG_KINDS: tuple[str, ...] = get_args(ConfigKind)

# vLLM 0.32's KVTransferConfig fields (tests/unit/test_configfile.py holds this list to vLLM's).
KV_TRANSFER_FIELDS = (
    "kv_connector",
    "engine_id",
    "kv_buffer_device",
    "kv_role",
    "kv_port",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "enable_permute_local_kv",
    "kv_load_failure_policy",
)
LOAD_FAILURE_POLICIES = ("recompute", "fail")
# What a Mooncake client file may hold: vLLM's in-tree reader's fields and the kvtool connector's.
MOONCAKE_FILE_FIELDS = (
    *MOONCAKE_FIELDS,
    "mode",
    "enable_offload",
    "tenant_id",
)
MOONCAKE_MODES = ("embedded", "standalone-store")
# Fields that make a JSON object a kvtool extra config rather than a Mooncake file.
_KVTOOL_ONLY = frozenset(KVToolConfig.model_fields) - {"backend"}  # the section is named "mooncake" in a file


@dataclass(frozen=True)
class CheckedConfig:
    """A configuration file that passed its checks: its kind, what it holds, and what to say about it."""

    path: Path
    kind: ConfigKind
    content: dict[str, Any]
    notes: tuple[str, ...] = ()
    connector: KVToolConfig | None = None  # the kvtool connector's effective config, where the file has one


def detect_kind(path: Path, content: dict[str, Any]) -> ConfigKind:
    """Which kind of file this is, from its suffix and its fields."""
    if Path(path).suffix == ".toml":
        return "pair"
    if "kv_connector" in content:
        return "connector"
    if _KVTOOL_ONLY & set(content) or "mooncake" in content:
        return "extra"
    if set(content) & set(MOONCAKE_FILE_FIELDS):
        return "mooncake"
    raise UserError(
        f"{path}: cannot tell which kind of configuration it is (no kv_connector, no kvtool or Mooncake field); "
        f"name it with --kind ({', '.join(CONFIG_KINDS)})"
    )


def check_config_file(path: Path, kind: ConfigKind | None = None) -> CheckedConfig:
    """Read, tell apart (or take ``kind``) and check a configuration file."""
    content = read_config_file(path)
    kind = kind or detect_kind(path, content)
    if kind == "connector":
        return _check_transfer(path, content)
    if kind == "extra":
        return CheckedConfig(path, kind, content, connector=_connector_config(path, content))
    if kind == "mooncake":
        return _check_mooncake(path, content)
    # A pair file holds the pair's flags: kvtool.commands.pairoptions.PairOptions.with_file checks it.
    return CheckedConfig(path, kind, content)


def _connector_config(path: Path, extra: Any, where: str = "") -> KVToolConfig:
    if not isinstance(extra, dict):
        raise UserError(f"{path}: {where or 'the file'} must be an object of the kvtool connector's fields")
    try:
        return load_config(extra)
    except ConfigError as exc:
        raise UserError(f"{path}: {where + ': ' if where else ''}{exc}") from None


def _check_transfer(path: Path, content: dict[str, Any]) -> CheckedConfig:
    unknown = sorted(set(content) - set(KV_TRANSFER_FIELDS))
    if unknown:
        accepted = ", ".join(KV_TRANSFER_FIELDS)
        raise UserError(f"{path}: unknown field {unknown[0]!r} of a kv-transfer config (accepted: {accepted})")
    role = content.get("kv_role")
    if role not in KV_ROLES:
        raise UserError(f"{path}: field 'kv_role' is {role!r}; use one of {', '.join(KV_ROLES)}")
    policy = content.get("kv_load_failure_policy", "recompute")
    if policy not in LOAD_FAILURE_POLICIES:
        raise UserError(f"{path}: field 'kv_load_failure_policy' is {policy!r}; use recompute")
    if content["kv_connector"] != KVTOOL_CONNECTOR_CLASS:
        note = f"a {content['kv_connector']} config: vLLM's own fields checked, its extra config is that connector's"
        return CheckedConfig(path, "connector", content, notes=(note,))
    module = content.get("kv_connector_module_path")
    if module != KVTOOL_CONNECTOR_MODULE:
        raise UserError(
            f"{path}: field 'kv_connector_module_path' is {module!r}; the kvtool connector loads from "
            f"{KVTOOL_CONNECTOR_MODULE!r} (with the repository on PYTHONPATH)"
        )
    notes = []
    if policy != "recompute":
        notes.append("kv_load_failure_policy 'fail' is changed to 'recompute': a failed load is a miss")
    connector = _connector_config(path, content.get("kv_connector_extra_config", {}), "kv_connector_extra_config")
    return CheckedConfig(path, "connector", content, tuple(notes), connector)


def _check_mooncake(path: Path, content: dict[str, Any]) -> CheckedConfig:
    unknown = sorted(set(content) - set(MOONCAKE_FILE_FIELDS))
    if unknown:
        accepted = ", ".join(MOONCAKE_FILE_FIELDS)
        raise UserError(f"{path}: unknown field {unknown[0]!r} of a Mooncake client file (accepted: {accepted})")
    mode = content.get("mode", "embedded")
    if mode not in MOONCAKE_MODES:
        raise UserError(f"{path}: field 'mode' is {mode!r}; use one of {', '.join(MOONCAKE_MODES)}")
    try:  # absent: both readers' default, which lends memory
        segment = parse_size(content["global_segment_size"]) if "global_segment_size" in content else None
    except ValueError as exc:
        raise UserError(f"{path}: field 'global_segment_size': {exc}") from None
    if (mode == "standalone-store") != (segment == 0):
        raise UserError(
            f"{path}: mode {mode!r} needs global_segment_size "
            + ("0 (the standalone store lends the memory)" if mode == "standalone-store" else "above 0")
        )
    fields = {name: content[name] for name in MOONCAKE_FIELDS if name in content}
    if "master_server_address" not in fields:
        raise UserError(f"{path}: field 'master_server_address' is missing; give the master's host:port")
    connector = _connector_config(path, {"mooncake": fields})
    return CheckedConfig(path, "mooncake", content, connector=connector)


def effective_connector_json(config: KVToolConfig) -> dict[str, Any]:
    """The kvtool connector's configuration with every default filled in, as ``config show`` prints it."""
    return config.model_dump(mode="json")
