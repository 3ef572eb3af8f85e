"""The store interface the connector needs, and its Mooncake implementation.

Four calls: batched existence, batched get, put of immutable objects, close. Every call runs under a
time-out on a bounded set of threads (``calls.BoundedCalls``), so a slow or wedged store becomes a
``StoreError`` (a miss to the caller), and calls that hang never pile up threads or a queue.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence
from enum import Enum
from typing import Protocol

from .calls import BoundedCalls, StoreError
from .config import KVToolConfig

__all__ = ["KVStore", "MooncakeStore", "PutOutcome", "SharedStore", "StoreError"]

logger = logging.getLogger("vllm.kvtool")

# Mooncake error codes seen on these machines (see ENVIRONMENT.md).
_NO_SPACE = -200
_NOT_FOUND = -704


class PutOutcome(str, Enum):
    STORED = "stored"
    NO_SPACE = "no_space"
    FAILED = "failed"


class KVStore(Protocol):
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get(self, keys: Sequence[str], object_bytes: int = 0) -> list[bytes | None]:
        """Objects for ``keys``; None where the key is missing or its transfer failed.

        ``object_bytes`` (the expected size of each) lets the store split a large batch."""
        ...

    def put(self, key: str, value: bytes) -> PutOutcome: ...

    def close(self) -> None: ...


class MooncakeStore:
    """``KVStore`` over ``mooncake.store.MooncakeDistributedStore``."""

    def __init__(self, config: KVToolConfig):
        self._config = config
        self._calls = BoundedCalls("kvtool-store", limit=4)
        self._client = self._calls.call(self._connect, config.connect_timeout_s, "connecting to the Mooncake master")
        if config.fault_control_file:
            from .faults import FaultyClient

            logger.warning(
                "kvtool: FAULT INJECTION is on (%s); never use this in production", config.fault_control_file
            )
            self._client = FaultyClient(self._client, config.fault_control_file)

    def _connect(self):
        from mooncake.store import MooncakeDistributedStore

        # The client's setup holds the GIL while it retries an absent master for about 90 s, so
        # no Python-side time-out can cut it short: ask the master's port first.
        _check_reachable(self._config.master_server_address, self._config.connect_timeout_s)

        client = MooncakeDistributedStore()
        code = client.setup(
            self._config.local_hostname,
            self._config.metadata_server,
            self._config.global_segment_size,
            self._config.local_buffer_size,
            self._config.protocol,
            self._config.device_name,
            self._config.master_server_address,
        )
        if code != 0:
            raise StoreError(f"Mooncake setup returned {code} for master {self._config.master_server_address}")
        return client

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = self._calls.call(
            lambda: self._client.batch_is_exist(list(keys)), self._config.lookup_timeout_s, "existence query"
        )
        if len(codes) != len(keys):
            raise StoreError(f"existence query answered {len(codes)} of {len(keys)} keys")
        if all(code < 0 for code in codes):
            raise StoreError(f"existence query failed with code {codes[0]}")
        return [code == 1 for code in codes]

    def get(self, keys: Sequence[str], object_bytes: int = 0) -> list[bytes | None]:
        if not keys:
            return []
        # The bytes API fails a batch larger than the client's transfer buffer: split it.
        per_batch = max(1, (self._config.local_buffer_size // 2) // object_bytes) if object_bytes else len(keys)
        batches = [list(keys[i : i + per_batch]) for i in range(0, len(keys), per_batch)]
        values = self._calls.call(
            lambda: [value for batch in batches for value in self._client.get_batch(batch)],
            self._config.load_timeout_s,
            "object load",
        )
        if len(values) != len(keys):
            raise StoreError(f"object load answered {len(values)} of {len(keys)} keys")
        # The bytes API answers b"" for a missing key and for a failed transfer alike.
        return [bytes(value) if value else None for value in values]

    def put(self, key: str, value: bytes) -> PutOutcome:
        code = self._calls.call(lambda: self._client.put(key, value), self._config.save_timeout_s, "object put")
        if code == 0:
            return PutOutcome.STORED
        if code == _NO_SPACE:
            return PutOutcome.NO_SPACE
        logger.debug("kvtool: put of %s returned %s", key, code)
        return PutOutcome.FAILED

    def remove(self, key: str) -> int:
        return self._calls.call(lambda: self._client.remove(key), self._config.save_timeout_s, "object remove")

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                self._calls.call(client.close, 5.0, "closing the store client")
            except StoreError as exc:
                logger.warning("kvtool: %s", exc)
        self._calls.shutdown()


def _check_reachable(address: str, timeout_s: float) -> None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise StoreError(f"the Mooncake master at {address} is not reachable ({exc.strerror or exc})") from None


_shared_lock = threading.Lock()
_shared: dict[tuple, tuple[MooncakeStore, int]] = {}


class SharedStore:
    """A handle on the process's one Mooncake client for a configuration.

    vLLM may run the scheduler side and the worker side in one process; they share a client (and
    its segment) instead of lending the store memory twice.
    """

    def __init__(self, config: KVToolConfig):
        self._id = (config.master_server_address, config.metadata_server, config.protocol, config.global_segment_size)
        with _shared_lock:
            store, users = _shared.get(self._id, (None, 0))
            if store is None:
                store = MooncakeStore(config)
            _shared[self._id] = (store, users + 1)
        self._store: MooncakeStore | None = store

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._live().exists(keys)

    def get(self, keys: Sequence[str], object_bytes: int = 0) -> list[bytes | None]:
        return self._live().get(keys, object_bytes)

    def put(self, key: str, value: bytes) -> PutOutcome:
        return self._live().put(key, value)

    def _live(self) -> MooncakeStore:
        if self._store is None:
            raise StoreError("the store client is closed")
        return self._store

    def close(self) -> None:
        if self._store is None:
            return
        self._store = None
        with _shared_lock:
            store, users = _shared[self._id]
            if users > 1:
                _shared[self._id] = (store, users - 1)
                return
            del _shared[self._id]
        store.close()
