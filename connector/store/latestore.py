"""A store that connects after the engine started: every call is a miss until it does.

An engine that started while its master was down (restarting, not yet scheduled, its host cut off)
served without the connector for its whole life. ``LateStore`` stands in for the store stack instead:
its calls fail as ``StoreError`` (misses) while a daemon thread tries to open the store, every
``retry_s`` seconds at first and then less often (up to ``max_retry_s``). Buffers registered meanwhile
(the worker's staging areas) are registered with the new client before any call reaches it.

Each try asks ``probe`` first. The Mooncake client's setup holds the GIL while it waits for a master
that accepts connections and does not answer (a frozen one, or another service on its port), which
in the engine's process would stall every stream for as long: the probe makes the same setup in a
child process (``mooncake.probe_master``), so only a master that answered is connected to here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..calls import StoreError, StoreNotConnected
from .backend import KVStore
from .store import ForwardingStore

logger = logging.getLogger("vllm.kvtool")

RETRY_S = 5.0  # the first tries' interval; it doubles after each failed try
MAX_RETRY_S = 60.0


class LateStore(ForwardingStore):
    """A ``KVStore`` whose calls are misses until ``open_store`` succeeds on its thread.

    Thread-safety: any thread may call. ``_store`` is set once (by the connect thread, under ``_lock``)
    and cleared once (by ``close``, under it); callers read it once into a local and use that, so a
    ``close`` between their read and their call is a call on a closed client (a ``StoreError``), never
    an ``AttributeError`` on None. ``_registered`` is only touched under ``_lock``."""

    def __init__(
        self,
        open_store: Callable[[], KVStore],
        probe: Callable[[], str | None] = lambda: None,
        *,
        what: str = "the store",
        retry_s: float = RETRY_S,
        max_retry_s: float = MAX_RETRY_S,
    ):
        self._open_store = open_store
        self._probe = probe  # None when a try may go on, else why not
        self._what = what
        self._retry_s, self._max_retry_s = retry_s, max_retry_s
        self._store: KVStore | None = None
        self._registered: list[tuple[int, int]] = []  # (address, bytes) to register once connected
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.tries = 0  # tries made (a test's and a log's count)
        self._thread = threading.Thread(target=self._connect_loop, name="kvtool-connect-later", daemon=True)
        self._thread.start()

    @property
    def connected(self) -> bool:
        return self._store is not None

    def _connect_loop(self) -> None:
        wait = self._retry_s
        while not self._stop.wait(wait):
            self.tries += 1
            try:
                why = self._try()
            except Exception as exc:  # noqa: BLE001 - a bug costs this try, never the tries after it
                logger.exception("kvtool: trying %s failed", self._what)
                why = f"{type(exc).__name__}: {exc}"
            if why is None:
                logger.warning("kvtool: %s answers now; the connector loads and saves from here on", self._what)
                return
            wait = min(wait * 2, self._max_retry_s)
            logger.info("kvtool: %s still unavailable (%s); next try in %.0f s", self._what, why, wait)

    def _try(self) -> str | None:
        """Connect and register what was registered meanwhile; None once connected, else why not."""
        why = self._probe()
        if why is not None:
            return why
        try:
            store = self._open_store()
        except StoreError as exc:
            return str(exc)
        with self._lock:
            if self._stop.is_set():  # closed while connecting: this client goes too, nothing registered
                store.close()
                return "closed"
            for address, nbytes in self._registered:
                try:
                    store.register(address, nbytes)
                except StoreError as exc:  # as at start: transfers work unregistered (over TCP)
                    logger.warning("kvtool: a staging area was not registered with the store (%s)", exc)
            self._store = store
        return None

    def _live(self) -> KVStore:
        store = self._store
        if store is None:
            raise StoreNotConnected(f"{self._what} is not connected yet (the engine started while it was unavailable)")
        return store

    def register(self, address: int, nbytes: int) -> None:
        with self._lock:
            store = self._store  # read once: a close() after the lock may set it to None
            if store is None:
                if not self._stop.is_set():  # closed: nothing will connect to register it with
                    self._registered.append((address, nbytes))  # registered with the client once it exists
                return
        store.register(address, nbytes)

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            store, self._store = self._store, None
        if store is not None:
            store.close()
