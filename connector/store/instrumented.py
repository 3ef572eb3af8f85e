"""Store calls counted by wrapping the store interface: how many, how many keys or objects, how long.

``InstrumentedStore`` wraps any ``KVStore`` (the connector puts it outside the breaker, so a call's time
is what its caller waited, time-outs and skips included) and counts, per kind of call (``exists``,
``get``, ``put``): ``store_calls_<call>``, ``store_items_<call>`` (keys asked or objects moved) and
``store_call_us_<call>``. Components count what they decide; what the store costs is counted here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from ..counters import Counters
from .store import KVStore, PutOutcome

if TYPE_CHECKING:
    from .staging import Lease, Region

T = TypeVar("T")


class InstrumentedStore:
    """A ``KVStore`` that counts every call it passes on; ``take_stats`` adds the wrapped store's."""

    def __init__(self, store: KVStore, clock: Callable[[], float] = time.perf_counter):
        self._store = store
        self._clock = clock
        self.stats = Counters()

    def _timed(self, call: str, items: int, fn: Callable[[], T]) -> T:
        started = self._clock()
        try:
            return fn()
        finally:
            self.stats.add(f"store_calls_{call}")
            self.stats.add(f"store_items_{call}", items)
            self.stats.add(f"store_call_us_{call}", round((self._clock() - started) * 1e6))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._timed("exists", len(keys), lambda: self._store.exists(keys))

    def get(self, keys: Sequence[str], object_bytes: int = 0) -> list[bytes | None]:
        return self._timed("get", len(keys), lambda: self._store.get(keys, object_bytes))

    def put(self, key: str, value: bytes) -> PutOutcome:
        return self._timed("put", 1, lambda: self._store.put(key, value))

    def put_many(self, items: Sequence[tuple[str, bytes]], replace: bool = False) -> PutOutcome:
        return self._timed("put", len(items), lambda: self._store.put_many(items, replace))

    def register(self, address: int, nbytes: int) -> None:
        self._store.register(address, nbytes)

    def get_into(self, keys: Sequence[str], regions: Sequence[Region], lease: Lease) -> list[int]:
        return self._timed("get", len(keys), lambda: self._store.get_into(keys, regions, lease))

    def put_from(self, items: Sequence[tuple[str, Region]], lease: Lease) -> list[PutOutcome]:
        return self._timed("put", len(items), lambda: self._store.put_from(items, lease))

    def remove(self, key: str) -> int:
        return self._store.remove(key)

    def close(self) -> None:
        self._store.close()

    def take_stats(self) -> dict[str, int]:
        taken = self.stats.take()
        more = getattr(self._store, "take_stats", None)
        for name, value in (more() if more is not None else {}).items():
            taken[name] = taken.get(name, 0) + value
        return taken
