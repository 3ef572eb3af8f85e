"""Files kvtool writes whole or not at all, and configuration files it reads (TOML or JSON)."""

from __future__ import annotations

import json
import os
import threading
import tomllib
from pathlib import Path
from typing import Any

from kvtool.errors import UserError


def write_json_atomically(path: Path, content: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        staging.write_text(json.dumps(content, indent=2) + "\n")
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)  # no staging file left behind by a write or rename that failed
        raise


def read_config_file(path: Path) -> dict[str, Any]:
    """The file's content: TOML for ``.toml``, JSON otherwise; a UserError if unreadable or not an object."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror or exc}); give the path of a configuration file") from None
    try:
        content = tomllib.loads(text) if Path(path).suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        what = "TOML" if Path(path).suffix == ".toml" else "JSON"
        raise UserError(f"{path} is not valid {what}: {exc}") from None
    if not isinstance(content, dict):
        raise UserError(f"{path} must hold an object (a table of fields), not {type(content).__name__}")
    return content
