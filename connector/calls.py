"""Store calls on a bounded set of threads, never waited on past a time-out.

A frozen store (a SIGSTOPped master keeps its connections open) hangs calls inside the client
library, where no Python time-out can cut them. ``BoundedCalls`` lets the caller stop waiting, but the
thread stays stuck until the library returns. So the number of calls in flight (stuck ones included)
is capped: past the cap a new call fails at once with ``StoreError`` (a miss), and nothing queues
behind the stuck threads. When the store comes back, the stuck calls return and free their threads.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class StoreError(Exception):
    """The store could not answer (unreachable, timed out, failed, busy); callers treat it as a miss."""


class StoreTimeout(StoreError):
    """A call did not answer within its time-out (a hung or overloaded store)."""


class StoreBusy(StoreError):
    """Every call slot is taken by calls that have not returned (a hung store)."""


class StoreNotConnected(StoreError):
    """The engine started while the store was unavailable and has not connected yet (``latestore``)."""


class BoundedCalls:
    """Runs calls on at most ``limit`` threads; ``submit`` refuses a call when all are taken."""

    def __init__(self, name: str, limit: int = 4):
        self._name = name
        self._limit = limit
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=limit, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified as calls return (``wait_idle``)
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def submit(self, fn: Callable[[], T], what: str) -> concurrent.futures.Future[T]:
        """Start ``fn`` now on a free thread, or raise ``StoreBusy`` (never queues)."""
        with self._lock:
            if self._in_flight >= self._limit:
                raise StoreBusy(f"{what} not started: {self._in_flight} earlier {self._name} calls have not returned")
            self._in_flight += 1
        try:
            future = self._pool.submit(fn)
        except RuntimeError as exc:  # the pool was shut down
            self._release()
            raise StoreError(f"{what} not started: {exc}") from None
        future.add_done_callback(lambda _: self._release())
        return future

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1
            self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for every call started to return; whether they all did."""
        with self._lock:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout=timeout_s)

    def call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        """Run ``fn`` and wait at most ``timeout_s``; any failure is a ``StoreError``."""
        return result_of(self.submit(fn, what), timeout_s, what)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def result_of(future: concurrent.futures.Future[T], timeout_s: float, what: str) -> T:
    """The future's result within ``timeout_s``; a time-out or any exception becomes a ``StoreError``."""
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise StoreTimeout(f"{what} timed out after {timeout_s:.3g} s") from None
    except StoreError:
        raise
    except Exception as exc:  # the client library raises assorted errors; all are misses
        raise StoreError(f"{what} failed: {exc}") from exc
