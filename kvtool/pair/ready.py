"""The ready file: the one contract between `kvtool serve-pair` and whoever uses its pair.

serve-pair writes it (atomically, ``ReadyFileWriter``; its content from ``ready_info``) once every
process is healthy, rewrites it when a supervised process gets a new pid, and removes it on exit.
`kvtool bench --pair`, `kvtool inspect --pair`, the benchmarks and the tests read it with
``read_ready_file``: one typed ``ReadyFile`` from the writer to every reader.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from kvtool.errors import UserError
from kvtool.files import write_json_atomically
from kvtool.pair.config import HA_PREFIX, LOOPBACK, RolesChoice, ServePairConfig, StoreChoice, parse_host_port
from kvtool.pair.engines import request_log_path
from kvtool.pair.profiles import ConnectorChoice


ScalePhase = Literal["working", "done", "failed"]


class ScaleState(BaseModel):
    """How the fleet's last scale request (``kvtool scale``, ``kvtool.pair.scale``) went."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    request: str  # the request's id
    target: int  # the engines it asked for
    state: ScalePhase
    message: str


class ReadyFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    producer: str  # base URLs of the two vLLM servers (a fleet: both its router's)
    consumer: str
    model: str
    block_size: int
    hash_unit: int
    divergence_grid: int | None = None  # the kvtool connector's pointer grid in tokens (0: none)
    max_model_len: int
    connector: ConnectorChoice
    roles: RolesChoice | None = None  # None without a connector
    master: str | None = None  # the master's RPC host:port
    admin: str | None = None  # the master's admin URL (its --metrics_port)
    master_pid: int | None = None  # the master running now; None for one serve-pair does not run
    store: StoreChoice | None = None  # None without a Mooncake store
    store_address: str | None = None
    log_dir: str | None = None
    request_logs: dict[str, str] | None = None  # role -> the kvtool connector's per-request hit log
    pids: dict[str, int] = {}
    restarts: dict[str, int] = {}  # supervised process -> times serve-pair started it again
    # A fleet (serve-pair --engines N): vLLM's router, its policy, and each engine serving now -> its URL.
    router: str | None = None
    router_policy: str | None = None
    engines: dict[str, str] = {}
    scaling: ScaleState | None = None  # the last scale request's outcome (a fleet, since it was asked)

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


# ---- writing ---------------------------------------------------------------------------------


def admin_url_for(cfg: ServePairConfig) -> str | None:
    """The master's admin URL: the one kvtool starts, or with --master that host at --admin-port."""
    if not cfg.uses_mooncake:
        return None
    if cfg.external_master is not None and cfg.external_master.startswith(HA_PREFIX):
        return None  # a group's leader changes: give inspect the leader's --admin
    if cfg.external_master is not None:
        host, _ = parse_host_port(cfg.external_master, "--master")
        return f"http://{host}:{cfg.admin_port}"
    return f"http://{LOOPBACK}:{cfg.admin_port}"


def ready_info(
    cfg: ServePairConfig,
    pids: dict[str, int],
    admin_url: str | None,
    restarts: dict[str, int] | None = None,
    out_of_rotation: frozenset[str] = frozenset(),
    scaling: ScaleState | None = None,
) -> ReadyFile:
    """What the ready file holds (kvtool/pair/ready.py); rewritten whenever a supervised process gets a
    new pid, or a fleet's engine leaves or rejoins the router's rotation (``out_of_rotation``)."""
    router = cfg.router_url
    return ReadyFile(
        producer=router or cfg.base_url("producer"),  # a fleet is asked through its router
        consumer=router or cfg.base_url("consumer"),
        router=router,
        router_policy=cfg.router_policy if cfg.is_fleet else None,
        engines={name: cfg.base_url(name) for name in cfg.engine_names if name in pids and name not in out_of_rotation}
        if cfg.is_fleet
        else {},
        master=cfg.master_address,
        admin=admin_url,
        master_pid=pids.get("master"),  # None when --master names a master kvtool does not run
        model=str(cfg.model),
        block_size=cfg.effective_block_size,
        hash_unit=cfg.hash_unit,
        divergence_grid=cfg.effective_divergence_grid if cfg.profile.has_divergence_grid else None,
        max_model_len=cfg.max_model_len,
        connector=cfg.connector,
        roles=cfg.roles if cfg.uses_mooncake else None,
        store=cfg.store if cfg.uses_mooncake else None,
        store_address=f"{LOOPBACK}:{cfg.store_port}" if cfg.starts_store else None,
        log_dir=str(cfg.log_dir),
        request_logs={role: str(request_log_path(cfg, role)) for role in cfg.engine_names}
        if cfg.profile.hits_from == "request_log"
        else None,
        pids=pids,
        restarts=restarts or {},
        scaling=scaling,
    )


class ReadyFileWriter:
    """Writes the ready file (``kvtool.pair.ready.ReadyFile``) once the pair is healthy, rewrites it
    (atomically) after every restart, removes it when the pair stops."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._build: Callable[[], ReadyFile] | None = None

    def publish(self, build: Callable[[], ReadyFile]) -> ReadyFile:
        with self._lock:
            self._build = build
            return self._write()

    def refresh(self) -> None:
        with self._lock:
            if self._build is not None:  # before publish() the first write will hold the news
                try:
                    self._write()
                except UserError as exc:  # on the supervisor's thread: the pair keeps serving
                    print(f"kvtool: {exc.message}", file=sys.stderr, flush=True)

    def remove(self) -> None:
        with self._lock:
            self._build = None
            if self.path is not None:
                self.path.unlink(missing_ok=True)

    def _write(self) -> ReadyFile:
        assert self._build is not None
        info = self._build()
        if self.path is not None:
            try:
                write_json_atomically(self.path, info.to_json())
            except OSError as exc:
                raise UserError(
                    f"cannot write the ready file {self.path} ({exc.strerror or exc}); give --ready-file a "
                    "writable path",
                    exit_code=1,
                ) from None
        return info
