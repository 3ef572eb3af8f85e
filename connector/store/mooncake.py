"""The Mooncake backend of the store interface: ``mooncake.store.MooncakeDistributedStore``, and its
registration (``BACKEND``: its settings section, ``mooncake_config``, its client, its probe).

Plain calls to the client, turned into the interface's answers (existence flags, bytes or None,
put outcomes). Time-outs, the bounded call threads, fault injection and the circuit breaker are not
here: they wrap any ``KVStore`` (``store.TimedStore``, ``faults.FaultyStore``, ``breaker.GuardedStore``),
and ``store.open_store`` stacks them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..calls import BoundedCalls, StoreError
from .backend import Backend, PutOutcome, StoreConfig
from .mooncake_config import (
    CONFIG_PATH_OPTION,
    FIELDS,
    HA_PREFIX,
    NAME,
    MooncakeSettings,
    master_endpoints,
    read_settings,
)
from .segment import Prefault, new_region, prefault_in_background, read_maps

if TYPE_CHECKING:
    from .staging import Lease, Region

logger = logging.getLogger("vllm.kvtool")

# Mooncake error codes seen on these machines (see ENVIRONMENT.md).
_NO_SPACE = -200

# A probe's client tries this many times (each try can pick another local port for the client's own
# server), every master call of each try bounded by ``probe_limits``.
SETUP_TRIES = 3


def probe_limits(config: StoreConfig) -> dict[str, str]:
    """Bounds on a probe client's master calls and tries (read from the environment as a client is set
    up), so that its setup ends within about ``connect_timeout_s``: at Mooncake's defaults a port that
    accepts connections but is no master held a setup 30 s a try, twenty tries. Only the probe's child
    process gets them: the engine's own client keeps Mooncake's defaults (with such a bound on it, CI's
    TP pair met the README's known transport stall; not shown to be the cause, but not kept either)."""
    per_call_ms = max(1000, int(config.connect_timeout_s * 1000 / SETUP_TRIES))
    return {"MC_RPC_TIMEOUT_MS": str(per_call_ms), "MC_STORE_CLIENT_SETUP_RETRIES": str(SETUP_TRIES)}


class MooncakeStore:
    """``KVStore`` over ``mooncake.store.MooncakeDistributedStore``."""

    def __init__(self, config: StoreConfig):
        self._config = config
        self._settings: MooncakeSettings = config.backend  # this backend's own section of the config
        self.prefault: Prefault | None = None  # the lent segment's fault-in (``segment``), where it runs
        # Only the connection runs here under a time-out; every other call is bounded by TimedStore.
        self._setup = BoundedCalls("kvtool-connect", limit=1)
        self._segment: tuple[int, int] | None = None  # where set-up mapped the lent segment, if found
        try:
            self._client = self._setup.call(
                self._connect, config.connect_timeout_s, "connecting to the Mooncake master"
            )
        except BaseException:
            self._setup.shutdown()  # its thread ends (once a setup past its time-out returns): no thread per try
            raise
        if self._segment is not None:  # not for a set-up that outlived its time-out: that client is dropped
            self.prefault = prefault_in_background(self._segment)

    def _connect(self):
        from mooncake.store import MooncakeDistributedStore

        # The client's setup holds the GIL while it waits for a master: for about 90 s where none
        # listens, so the master's port is asked first. A port that accepts and does not answer (a
        # frozen master, another service) still holds it, up to ten minutes: callers ask
        # ``probe_master`` first (an engine's start and its later tries, ``latestore``; ``kvtool inspect``).
        _check_reachable(self._settings.master_server_address, self._config.connect_timeout_s)
        client = MooncakeDistributedStore()
        segment_bytes = self._settings.global_segment_size
        maps_before = read_maps() if self._settings.prefault_segment and segment_bytes else ""
        code = client.setup(
            self._settings.local_hostname,
            self._settings.metadata_server,
            self._settings.global_segment_size,
            self._settings.local_buffer_size,
            self._settings.protocol,
            self._settings.device_name,
            self._settings.master_server_address,
        )
        if code != 0:
            raise StoreError(f"Mooncake setup returned {code} for master {self._settings.master_server_address}")
        if maps_before:
            self._segment = new_region(maps_before, read_maps(), segment_bytes)
            if self._segment is None:
                logger.info("kvtool: the store segment's mapping was not found; its pages fault in as puts come")
        return client

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = self._client.batch_is_exist(list(keys))
        if len(codes) != len(keys):
            raise StoreError(f"existence query answered {len(codes)} of {len(keys)} keys")
        if all(code < 0 for code in codes):
            raise StoreError(f"existence query failed with code {codes[0]}")
        return [code == 1 for code in codes]

    def get(self, keys: Sequence[str], object_bytes: int = 0) -> list[bytes | None]:
        if not keys:
            return []
        # The bytes API fails a batch larger than the client's transfer buffer: split it.
        per_batch = max(1, (self._settings.local_buffer_size // 2) // object_bytes) if object_bytes else len(keys)
        batches = [list(keys[i : i + per_batch]) for i in range(0, len(keys), per_batch)]
        values = [value for batch in batches for value in self._client.get_batch(batch)]
        if len(values) != len(keys):
            raise StoreError(f"object load answered {len(values)} of {len(keys)} keys")
        # The bytes API answers b"" for a missing key and for a failed transfer alike.
        return [bytes(value) if value else None for value in values]

    def put(self, key: str, value: bytes) -> PutOutcome:
        return _outcome(key, self._client.put(key, value))

    def register(self, address: int, nbytes: int) -> None:
        code = self._client.register_buffer(address, nbytes)
        if code != 0:
            raise StoreError(f"Mooncake refused to register {nbytes} bytes of staging memory (code {code})")

    def get_into(self, keys: Sequence[str], regions: Sequence[Region], lease: Lease) -> list[int]:
        if not keys:
            return []
        # No batch limit: the client reads straight into the regions (no transfer buffer in between).
        counts = self._client.batch_get_into(list(keys), [r.address for r in regions], [len(r.view) for r in regions])
        if len(counts) != len(keys):
            raise StoreError(f"object load answered {len(counts)} of {len(keys)} keys")
        return list(counts)

    def put_from(self, items: Sequence[tuple[str, Region]], lease: Lease) -> list[PutOutcome]:
        if not items:
            return []
        keys = [key for key, _ in items]
        codes = self._client.batch_put_from(keys, [r.address for _, r in items], [len(r.view) for _, r in items])
        if len(codes) != len(items):
            raise StoreError(f"batch put answered {len(codes)} of {len(items)} keys")
        return [_outcome(key, code) for key, code in zip(keys, codes, strict=True)]

    def put_many(self, items: Sequence[tuple[str, bytes]], replace: bool = False) -> PutOutcome:
        if not items:
            return PutOutcome.STORED
        # One call and one code for the batch (a key already stored counts as stored, as in put).
        call = self._client.upsert_batch if replace else self._client.put_batch
        code = call([key for key, _ in items], [value for _, value in items])
        if code == 0:
            return PutOutcome.STORED
        logger.debug("kvtool: batch put of %d objects returned %s", len(items), code)
        return PutOutcome.NO_SPACE if code == _NO_SPACE else PutOutcome.FAILED

    def remove(self, key: str) -> int:
        return self._client.remove(key)

    def close(self) -> None:
        if self.prefault is not None:
            self.prefault.cancelled.set()
        client, self._client = self._client, None
        if client is not None:
            try:
                self._setup.call(client.close, 5.0, "closing the store client")
            except StoreError as exc:
                logger.warning("kvtool: %s", exc)
        self._setup.shutdown()


def _outcome(key: str, code: int) -> PutOutcome:
    if code == 0:
        return PutOutcome.STORED
    if code == _NO_SPACE:
        return PutOutcome.NO_SPACE
    logger.debug("kvtool: put of %s returned %s", key, code)
    return PutOutcome.FAILED


def _check_reachable(address: str, timeout_s: float) -> None:
    """The master's RPC port, or for an HA group (``etcd://host:port;host:port``) any of its etcd
    endpoints, accepts a connection; a StoreError otherwise."""
    problems = []
    for host, port in master_endpoints(address):
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return
        except OSError as exc:
            problems.append(f"{host}:{port}: {exc.strerror or exc}")
    raise StoreError(f"the Mooncake master at {address} is not reachable ({'; '.join(problems)})")


_PROBE = """
import json, os, sys
try:
    from mooncake.store import MooncakeDistributedStore
except BaseException as exc:
    print(f"mooncake.store cannot be imported: {exc!r}", file=sys.stderr, flush=True)
    os._exit(4)
code = MooncakeDistributedStore().setup(*json.loads(sys.argv[1]))
os._exit(0 if code == 0 else 3)
"""
_PROBE_SETUP_FAILED = 3  # the child's setup returned an error: the master's answer (or none)
_PROBE_START_S = 10.0  # the child's interpreter and the client library's start, on a busy host


def probe_master(config: StoreConfig) -> str | None:
    """Whether a client set up in a child process reaches the master within ``connect_timeout_s``: None
    if it did, else why not. Its setup holds the child's GIL, never this process's (``latestore``).

    A probe that cannot judge (no child process, a child that cannot import the client library, a bug)
    is logged and answers None: the setup is then made as it was before probes, in the caller's
    process, rather than the engine going without its store for good."""
    address = config.backend.master_server_address
    try:
        _check_reachable(address, config.connect_timeout_s)  # nothing listening: no child needed
    except StoreError as exc:
        return str(exc)
    if address.startswith(HA_PREFIX):
        # A group's etcd endpoint answered. A client's setup finds the leader through etcd, which took
        # 5 to 30 s here after a group started: past any bound a probe could keep, so it is made here as
        # before (the etcd endpoint being a real one is what the group's operator controls).
        return None
    mc = config.backend
    args = [mc.local_hostname, mc.metadata_server, 0, 1 << 20, mc.protocol, mc.device_name, address]  # lends nothing
    env = {**probe_limits(config), **os.environ}  # the operator's settings win
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, json.dumps(args)],
            capture_output=True,
            env=env,
            timeout=config.connect_timeout_s + _PROBE_START_S,
        )
    except subprocess.TimeoutExpired:
        return f"the Mooncake master at {address} accepts connections but did not answer a client's setup"
    except OSError as exc:
        logger.warning("kvtool: no child process for the master probe (%s); the client is set up unprobed", exc)
        return None
    if done.returncode == _PROBE_SETUP_FAILED or done.returncode < 0:  # its setup failed, or died in it
        return f"a client's setup against the Mooncake master at {address} failed (exit {done.returncode})"
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["nothing"]
        logger.warning(
            "kvtool: the master probe could not run (exit %d: %s); the client is set up unprobed",
            done.returncode,
            said[0][:300],
        )
    return None


def _identity(settings: MooncakeSettings) -> tuple:
    """One client per master, transport and lent segment: a process's sides with these in common share it."""
    return (settings.master_server_address, settings.metadata_server, settings.protocol, settings.global_segment_size)


BACKEND = Backend(
    name=NAME,
    settings=MooncakeSettings,
    flat_fields=FIELDS,
    options=(CONFIG_PATH_OPTION,),
    read_settings=read_settings,
    open=MooncakeStore,
    probe=probe_master,
    describe=lambda settings: f"the Mooncake store at {settings.master_server_address}",
    lending_nothing=lambda settings: settings.model_copy(update={"global_segment_size": 0}),
    client_identity=_identity,
)
