"""A circuit breaker around the store: after repeated failures, calls are skipped for a back-off.

``CircuitBreaker`` is pure (the clock is injected). ``GuardedStore`` wraps any ``KVStore``: while the
breaker is open every call fails at once with ``StoreError`` (a miss, no time spent), and each
outcome of a call that did run is recorded. After the back-off one call is let through (half-open):
success closes the breaker, failure opens it again with a doubled back-off.

A call that answers, but slower than ``slow_call_s``, counts as a failure too (a store that answers
slowly taxes every request by its latency, while each call succeeds): the store is bypassed until a
trial call answers quickly again. A lookup the scheduler gave up waiting for is reported the same way
(``report_slow``). Every opening is logged with its cause and counted (``breaker_opened``, and
``store_bypassed_slow`` when slowness opened it).
"""

from __future__ import annotations

import logging
import threading
import time

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..calls import StoreBusy, StoreError, StoreNotConnected, StoreTimeout
from ..counters import Counters
from .store import KVStore, PutOutcome

if TYPE_CHECKING:
    from .staging import Lease, Region

logger = logging.getLogger("vllm.kvtool")


@dataclass(frozen=True)
class BreakerPolicy:
    failures_to_open: int = 3  # consecutive failed calls that open the breaker
    backoff_s: float = 1.0  # first back-off; doubles on each failed trial
    max_backoff_s: float = 10.0


class CircuitBreaker:
    """Closed -> (``failures_to_open`` failures in a row, or one hung call) -> open for a back-off -> one trial call."""

    def __init__(self, policy: BreakerPolicy = BreakerPolicy(), clock: Callable[[], float] = time.monotonic):
        self._policy = policy
        self._clock = clock
        self._failures = 0
        self._open_until: float | None = None
        self._backoff = policy.backoff_s
        self._trial = False  # a call is out after the back-off; others still skip
        self._lock = threading.Lock()
        self.opened = 0  # times it opened (a metric)
        # When slowness (not errors) opened it (``report_slow``), until a call closes it: for the log.
        self.bypassed_at: float | None = None

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open_until is not None and (self._trial or self._clock() < self._open_until)

    def allow(self) -> bool:
        """Whether a call may run now. After the back-off, exactly one trial call is allowed."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._trial or self._clock() < self._open_until:
                return False
            self._trial = True
            return True

    def record_success(self) -> bool:
        """Record a call that worked; True when it closed an open breaker."""
        with self._lock:
            was_open = self._open_until is not None
            self._failures = 0
            self._open_until = None
            self._trial = False
            self._backoff = self._policy.backoff_s
            self.bypassed_at = None
            return was_open

    def record_failure(self, *, hung: bool = False) -> bool:
        """Record a failed call; True when this failure opened the breaker.

        ``hung`` (a time-out, or no free call slot) opens it at once: every later call would wait too."""
        with self._lock:
            if self._open_until is not None:
                if not self._trial:
                    return False  # a call started before it opened; already counted
                # The trial failed: open again for twice as long.
                self._backoff = min(self._backoff * 2, self._policy.max_backoff_s)
                self._open_until = self._clock() + self._backoff
                self._trial = False
                self.opened += 1
                return True
            self._failures += 1
            if self._failures < self._policy.failures_to_open and not hung:
                return False
            self._open_until = self._clock() + self._backoff
            self.opened += 1
            return True

    def seconds_left(self) -> float:
        with self._lock:
            return max(0.0, self._open_until - self._clock()) if self._open_until is not None else 0.0


def report_slow(breaker: CircuitBreaker, stats: Counters, name: str, what: str, cause: str) -> None:
    """A store that answered (or would answer) slower than a caller could wait: a failure for the
    breaker, counted, and logged when it bypasses the store."""
    stats.add(f"store_slow_{what}")
    if breaker.record_failure():
        if breaker.bypassed_at is None:
            breaker.bypassed_at = time.monotonic()
        stats.add("breaker_opened")
        stats.add("store_bypassed_slow")
        logger.warning(
            "kvtool: %s: the store is slow (%s); bypassing it (lookups are misses, nothing waits) for %.1f s, "
            "then trying one call",
            name,
            cause,
            breaker.seconds_left(),
        )


class GuardedStore:
    """A ``KVStore`` whose calls go through a circuit breaker; counts what it skipped and why.

    ``slow_call_s``: a call that answers later than this counts as a failure (None: only errors do).
    Thread-safety: any thread may call; the breaker and the counters hold their own locks."""

    def __init__(
        self,
        store: KVStore,
        breaker: CircuitBreaker,
        name: str,
        slow_call_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._store = store
        self.breaker = breaker
        self._name = name
        self._slow_call_s = slow_call_s
        self._clock = clock
        self.stats = Counters()

    def take_stats(self) -> dict[str, int]:
        return self.stats.take()

    def _run(self, what: str, fn):
        if not self.breaker.allow():
            self.stats.add(f"breaker_skipped_{what}")
            raise StoreError(f"the store is bypassed; {what} skipped for {self.breaker.seconds_left():.1f} s more")
        started = self._clock()
        try:
            result = fn()
        except StoreError as exc:
            self._failed(what, exc)
            raise
        except Exception:
            # Not the store's answer (a bug on the way to it): still a failed call, so that a trial call
            # ending this way does not leave the breaker waiting for its outcome for good.
            self.stats.add(f"store_errors_{what}")
            self.breaker.record_failure()
            raise
        took = self._clock() - started
        if self._slow_call_s is not None and took > self._slow_call_s:
            cause = f"{what} answered in {took * 1e3:.0f} ms, over slow_call_ms {self._slow_call_s * 1e3:.0f}"
            report_slow(self.breaker, self.stats, self._name, what, cause)
            return result  # its answer is good: the caller uses it
        bypassed_at = self.breaker.bypassed_at
        if self.breaker.record_success():
            if bypassed_at is not None:
                bypassed_s = time.monotonic() - bypassed_at
                answer = f"{what} in {took * 1e3:.1f} ms"
                logger.warning(
                    "kvtool: %s: the store answers quickly again (%s) after %.1f s bypassed; store calls resume",
                    self._name,
                    answer,
                    bypassed_s,
                )
            else:
                logger.warning("kvtool: %s: the store answers again; store calls resume", self._name)
        return result

    def _failed(self, what: str, exc: StoreError) -> None:
        self.stats.add(f"store_errors_{what}")
        if self.breaker.record_failure(hung=isinstance(exc, StoreTimeout | StoreBusy)):
            self.stats.add("breaker_opened")
            # Not yet connected: said once at start and once when it connects, not at every back-off.
            log = logger.debug if isinstance(exc, StoreNotConnected) else logger.warning
            log(
                "kvtool: %s: the store failed %s (%s); skipping store calls for %.1f s",
                self._name,
                what,
                exc,
                self.breaker.seconds_left(),
            )

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._run("exists", lambda: self._store.exists(keys))

    def get(self, keys: Sequence[str], object_bytes: int = 0) -> list[bytes | None]:
        return self._run("get", lambda: self._store.get(keys, object_bytes))

    def put(self, key: str, value: bytes) -> PutOutcome:
        return self._run("put", lambda: self._store.put(key, value))

    def put_many(self, items: Sequence[tuple[str, bytes]], replace: bool = False) -> PutOutcome:
        return self._run("put", lambda: self._store.put_many(items, replace))

    def register(self, address: int, nbytes: int) -> None:
        self._store.register(address, nbytes)

    def get_into(self, keys: Sequence[str], regions: Sequence[Region], lease: Lease) -> list[int]:
        return self._run("get", lambda: self._store.get_into(keys, regions, lease))

    def put_from(self, items: Sequence[tuple[str, Region]], lease: Lease) -> list[PutOutcome]:
        return self._run("put", lambda: self._store.put_from(items, lease))

    def close(self) -> None:
        self._store.close()
