"""The store interface the connector needs, and how a store is put together.

Batched existence, batched get, puts of immutable records, zero-copy batches of objects between the
store and registered staging memory (``register``, ``get_into``, ``put_from``), remove, close. A backend
(``backends.BACKENDS``, chosen by the config's ``store_backend``) makes the calls; extras wrap
the interface: fault injection for tests (``faults.FaultyStore``), time-outs on a bounded set of
threads (``TimedStore``: a slow or wedged store becomes a ``StoreError``, a miss to the caller, and
calls that hang never pile up threads or a queue), no key twice in one batch
(``uniquekeys.UniqueKeysStore``: the default backend's client answers a repeated key wrong), and the circuit
breaker (``breaker.GuardedStore``).

``open_store`` stacks them, from the bottom: the backend (``SharedStore``: the process's one client),
``FaultyStore`` (tests only: its faults stand for the backend's), ``UniqueKeysStore``, ``TimedStore``.
Every caller's batch thus reaches the backend with each key once; a test's wrapper that emulates
the client (its wrong answer to a repeated key, say) goes under the guard, where the client is; and
the copies into a repeated key's other regions run within the timed call, while its lease is held. The
connector puts ``breaker.GuardedStore`` and ``instrumented.InstrumentedStore`` above the stack.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from typing import TYPE_CHECKING, TypeVar

from ..calls import BoundedCalls, StoreError, result_of
from .backend import KVStore, PutOutcome
from .backends import BACKENDS
from ..config import KVToolConfig
from .uniquekeys import UniqueKeysStore

if TYPE_CHECKING:
    from .staging import Lease, Region

T = TypeVar("T")

__all__ = ["KVStore", "PutOutcome", "SharedStore", "StoreError", "TimedStore", "open_store"]

logger = logging.getLogger("vllm.kvtool")

CLOSE_WAIT_S = 1.0  # closing waits this long for calls still running (``TimedStore.close``)
# Calls a store stack runs at once. It must take every call its users' threads can make together, and
# a spare for one call abandoned at its time-out: a call refused for want of a slot (``StoreBusy``)
# counts as a hung store and opens the breaker. The scheduler side's callers are its lookup thread
# and its pointer reads; the worker's are its fetch threads and its put thread, five, so the worker's
# stack takes more (``stack.WORKER_STORE_CALLS``).
CALL_THREADS = 4


class TimedStore:
    """Any ``KVStore`` with every call on a bounded set of threads under its time-out (``calls``).

    A call past its time-out is a ``StoreTimeout``; when every thread is held by a hung call, a new
    call fails at once (``StoreBusy``) instead of queueing.
    """

    def __init__(self, store: KVStore, config: KVToolConfig, limit: int = CALL_THREADS):
        self._store = store
        self._config = config
        self._calls = BoundedCalls("kvtool-store", limit=limit)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return self._calls.call(lambda: self._store.exists(keys), self._config.lookup_timeout_s, "existence query")

    def get(self, keys: Sequence[str], object_bytes: int = 0) -> list[bytes | None]:
        if not keys:
            return []
        return self._calls.call(lambda: self._store.get(keys, object_bytes), self._config.load_timeout_s, "object load")

    def put(self, key: str, value: bytes) -> PutOutcome:
        return self._calls.call(lambda: self._store.put(key, value), self._config.save_timeout_s, "object put")

    def put_many(self, items: Sequence[tuple[str, bytes]], replace: bool = False) -> PutOutcome:
        return self._calls.call(lambda: self._store.put_many(items, replace), self._config.save_timeout_s, "batch put")

    def register(self, address: int, nbytes: int) -> None:
        self._calls.call(lambda: self._store.register(address, nbytes), self._config.connect_timeout_s, "registration")

    def get_into(self, keys: Sequence[str], regions: Sequence[Region], lease: Lease) -> list[int]:
        if not keys:
            return []
        fetch = lambda: self._store.get_into(keys, regions, lease)  # noqa: E731
        return self._holding(lease, fetch, self._config.load_timeout_s, "object load")

    def put_from(self, items: Sequence[tuple[str, Region]], lease: Lease) -> list[PutOutcome]:
        if not items:
            return []
        put = lambda: self._store.put_from(items, lease)  # noqa: E731
        return self._holding(lease, put, self._config.save_timeout_s, "batch put")

    def _holding(self, lease: Lease, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        """``fn`` under the time-out, its lease held until it returns: the client library may still
        write into (or read from) the regions of a call the caller stopped waiting for."""
        lease.hold()
        try:
            future = self._calls.submit(fn, what)
        except BaseException:
            lease.release()
            raise
        future.add_done_callback(lambda _: lease.release())
        return result_of(future, timeout_s, what)

    def remove(self, key: str) -> int:
        return self._calls.call(lambda: self._store.remove(key), self._config.save_timeout_s, "object remove")

    def close(self) -> None:
        self._calls.shutdown()
        if not self._calls.wait_idle(CLOSE_WAIT_S):
            # A call past its time-out still runs inside the client library: closing the client under it
            # could crash the engine's process. Left open, it goes with the process.
            logger.warning(
                "kvtool: %d store calls have not returned; the store client is left open until the process exits",
                self._calls.in_flight,
            )
            return
        self._store.close()


def open_store(config: KVToolConfig, *, shared: bool = False, call_threads: int = CALL_THREADS) -> TimedStore:
    """The configured backend, with fault injection when a test configured it, each key once per
    batch, under time-outs (``call_threads`` calls at once).

    ``shared``: one backend client per process and configuration (vLLM may run the scheduler and
    the worker side in one process; they then share a client and its segment instead of lending the
    store memory twice). Raises ``StoreError`` when the backend cannot be reached.
    """
    backend: KVStore = SharedStore(config) if shared else BACKENDS[config.store_backend].open(config)
    if config.fault_control_file:
        from .faults import FaultyStore

        logger.warning("kvtool: FAULT INJECTION is on (%s); never use this in production", config.fault_control_file)
        backend = FaultyStore(backend, config.fault_control_file)
    return TimedStore(UniqueKeysStore(backend), config, limit=call_threads)


_shared_lock = threading.Lock()
_shared: dict[tuple, tuple[KVStore, int]] = {}


class ForwardingStore:
    """A ``KVStore`` that hands every call to the store ``_live`` gives (or raises from it)."""

    def _live(self) -> KVStore:
        raise NotImplementedError

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._live().exists(keys)

    def get(self, keys: Sequence[str], object_bytes: int = 0) -> list[bytes | None]:
        return self._live().get(keys, object_bytes)

    def put(self, key: str, value: bytes) -> PutOutcome:
        return self._live().put(key, value)

    def put_many(self, items: Sequence[tuple[str, bytes]], replace: bool = False) -> PutOutcome:
        return self._live().put_many(items, replace)

    def register(self, address: int, nbytes: int) -> None:
        self._live().register(address, nbytes)

    def get_into(self, keys: Sequence[str], regions: Sequence[Region], lease: Lease) -> list[int]:
        return self._live().get_into(keys, regions, lease)

    def put_from(self, items: Sequence[tuple[str, Region]], lease: Lease) -> list[PutOutcome]:
        return self._live().put_from(items, lease)

    def remove(self, key: str) -> int:
        return self._live().remove(key)


class SharedStore(ForwardingStore):
    """A handle on the process's one backend client for a configuration."""

    def __init__(self, config: KVToolConfig):
        backend = BACKENDS[config.store_backend]
        self._id = (backend.name, *backend.client_identity(config.backend))
        with _shared_lock:
            store, users = _shared.get(self._id, (None, 0))
            if store is None:
                store = backend.open(config)
            _shared[self._id] = (store, users + 1)
        self._store: KVStore | None = store

    def _live(self) -> KVStore:
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
