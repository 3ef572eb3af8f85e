"""The ready file: the one contract between `kvtool serve-pair` and whoever uses its pair.

serve-pair writes it (atomically) once every process is healthy, rewrites it when a supervised
process gets a new pid, and removes it on exit. `kvtool bench --pair`, `kvtool inspect --pair`, the
benchmarks and the tests read it with ``read_ready_file``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from kvtool.errors import UserError


class ReadyFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    producer: str  # base URLs of the two vLLM servers
    consumer: str
    model: str
    block_size: int
    hash_unit: int
    divergence_grid: int | None = None  # the kvtool connector's pointer grid in tokens (0: none)
    max_model_len: int
    connector: str  # kvtool, vllm-mooncake-store, lmcache or none
    roles: str | None = None  # pd or both; None without a connector
    master: str | None = None  # the master's RPC host:port
    admin: str | None = None  # the master's admin URL (its --metrics_port)
    master_pid: int | None = None  # the master running now; None for one serve-pair does not run
    store: str | None = None  # embedded or standalone
    store_address: str | None = None
    log_dir: str | None = None
    request_logs: dict[str, str] | None = None  # role -> the kvtool connector's per-request hit log
    pids: dict[str, int] = {}
    restarts: dict[str, int] = {}  # supervised process -> times serve-pair started it again

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def parse_ready_file(content: Any, source: str) -> ReadyFile:
    """A ready file's content, checked; a UserError naming the field otherwise."""
    if not isinstance(content, dict):
        raise UserError(f"{source} is not a serve-pair ready file (a JSON object)")
    try:
        return ReadyFile.model_validate(content)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise UserError(f"{source} is not a serve-pair ready file: field {first['loc'][0]!r}: {first['msg']}") from None


def read_ready_file(path: Path) -> ReadyFile:
    try:
        content = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UserError(
            f"cannot read the ready file {path} ({exc.strerror or exc}); "
            "start a pair with kvtool serve-pair --ready-file PATH"
        ) from None
    except ValueError:
        raise UserError(f"{path} is not JSON; pass the file kvtool serve-pair --ready-file writes") from None
    return parse_ready_file(content, str(path))
