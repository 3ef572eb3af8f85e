"""Where to inspect: a master's admin URL (``--admin``), or a serve-pair ready file (``--pair``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import UserError
from kvtool.pair.ready import ReadyFile, read_ready_file
from kvtool.store.admin import StoreAdmin, open_admin


@dataclass(frozen=True)
class Target:
    admin: str
    master: str | None = None  # RPC host:port, needed to read object bytes
    model: str | None = None
    block_size: int | None = None
    hash_unit: int | None = None
    divergence_grid: int | None = None  # the pair's pointer grid (its ready file); None: not known

    @property
    def store(self) -> StoreAdmin:
        """The store's admin side at ``admin``."""
        return open_admin(self.admin)


def resolve_target(admin: str | None, pair: Path | None, master: str | None = None) -> Target:
    info: ReadyFile | None = None
    if pair is not None:
        info = read_ready_file(Path(pair))
        if not info.admin:
            raise UserError(
                f"{pair} is not a serve-pair ready file with an admin URL (was the pair started with Mooncake?)"
            )
    admin_url = admin or (info.admin if info is not None else None)
    if not admin_url:
        raise UserError(
            "say which store to inspect: --admin http://HOST:PORT (the master's --metrics_port) or --pair READY_FILE"
        )
    if "://" not in admin_url:
        admin_url = f"http://{admin_url}"  # HOST:PORT, as the master's flags spell it
    if info is None:
        return Target(admin=admin_url, master=master)
    return Target(
        admin=admin_url,
        master=master or info.master,
        model=info.model or None,
        block_size=info.block_size,
        hash_unit=info.hash_unit,
        divergence_grid=info.divergence_grid,
    )


@contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Send fd 2 to /dev/null: the Mooncake client logs through glog before it is initialised, so
    neither GLOG_* variables nor Python logging reach it, and its lines would bury the one-line output."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class ObjectReader:
    """A Mooncake client that lends no memory, for reading object and record bytes, kept quiet."""

    def __init__(self, store) -> None:
        self._store = store

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        with native_stderr_silenced():
            return self._store.get(keys)

    def close(self) -> None:
        with native_stderr_silenced():
            self._store.close()


def open_reader(target: Target) -> ObjectReader:
    if not target.master:
        raise UserError(
            "reading stored objects needs the master's RPC address: give --master HOST:PORT or --pair READY_FILE"
        )
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # keep its transfer engine on loopback
    from connector.config import ConfigError, load_config
    from connector.store.stack import open_store_stack, probe
    from connector.store.store import StoreError

    from kvtool.errors import ServerError

    try:
        config = load_config(
            {"master_server_address": target.master, "global_segment_size": 0, "connect_timeout_s": 5.0}
        )
    except ConfigError as exc:
        raise UserError(f"--master {target.master!r}: {exc}") from None
    # The client's setup holds the GIL while a port that accepts does not answer (an admin port given
    # for the RPC port): asked in a child process first, so that it fails within the time-out.
    why = probe(config)
    if why is not None:
        raise ServerError(f"cannot read objects from the store: {why}; --master takes the master's RPC port")
    try:
        with native_stderr_silenced():
            return ObjectReader(open_store_stack(config, "reader"))
    except StoreError as exc:
        raise ServerError(f"cannot read objects from the store: {exc}") from None
