"""Asynchronous, batched lookups: the scheduler never waits on the store.

The scheduler asks for a request's stored prefix with ``want``; at the end of its step it calls
``flush``, which sends every prompt asked for since the last batch as one background job (at most two
existence queries in all, ``search.find_stored_prefixes``). Until the job answers, ``poll`` returns
None and vLLM retries the request on a later step (``get_num_new_matched_tokens`` returns None). A
lookup that has not answered within its time-out is a miss (a ``StoreError``); its job may still be
stuck in the store client, so at most one job runs at a time and later requests wait for the next
batch instead of piling up threads.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..store.backend import KVStore
from ..calls import BoundedCalls, StoreError
from ..core.objects import pointer_size
from ..core.prefix import PromptKeys
from ..core.refs import StoredPrefix
from ..core.search import ExistsFn, ReadFn, find_stored_prefixes

Outcome = StoredPrefix | StoreError
T = TypeVar("T")
FindFn = Callable[[list[PromptKeys], ExistsFn, "ReadFn | None", int], list[StoredPrefix]]

# A pointer read gets this share of the lookup's time-out: when it stalls (a first transfer from a
# peer's segment can, see the README's known issues), the lookup still answers, with the hit that
# needs no pointer.
POINTER_READ_SHARE = 0.25


def pointer_reader(store: KVStore, timeout_s: float, block_size: int) -> Callable[[list[str]], list[bytes | None]]:
    """How a lookup reads the pointer records its hit relies on (small objects): within a share of the
    lookup's time budget, on one thread of its own (a read still stuck there fails the next one at
    once), so a slow read costs lookups their pointer hits only, never their other hits or a stall."""
    calls = BoundedCalls("kvtool-pointer-read", limit=1)
    return lambda keys: calls.call(lambda: store.get(keys, pointer_size(block_size)), timeout_s, "pointer read")


@dataclass
class _Pending:
    keys: PromptKeys
    asked_at: float
    wait_s: float  # how long its request may wait for it: the time-out, or less (``want``)
    job: concurrent.futures.Future | None = None
    sent_at: float = 0.0  # when its job was sent
    outcome: Outcome | None = None


class StoreTimer:
    """How long the store call a lookup job is waiting on has been out (0 while the job runs Python).

    A lookup can be late for two reasons: the store is slow, or this process's threads were too busy to
    run the job (a CPU engine's forward pass takes the cores the lookup thread would run on). Only the
    first is the store's fault. Thread-safety: one job runs at a time (``BoundedCalls``), so one thread
    writes ``_since`` at a time; the engine thread only reads it (a float, read whole under the GIL).
    """

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._since: float | None = None

    def wrap(self, fn: Callable[[list[str]], T]) -> Callable[[list[str]], T]:
        def timed(keys: list[str]) -> T:
            self._since = self._clock()
            try:
                return fn(keys)
            finally:
                self._since = None

        return timed

    def in_flight_s(self, now: float) -> float:
        since = self._since
        return 0.0 if since is None else max(0.0, now - since)


class LookupAbandoned(StoreError):
    """A lookup not answered within what its best hit could save: a miss, and a slow store's sign."""


@dataclass
class _Job:
    future: concurrent.futures.Future
    req_ids: list[str] = field(default_factory=list)
    sent_at: float = 0.0


class LookupBatcher:
    def __init__(
        self,
        exists: ExistsFn,
        timeout_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        calls: BoundedCalls | None = None,
        read: ReadFn | None = None,
        extend_min_tokens: int = 1,
        find: FindFn = find_stored_prefixes,
        on_late: Callable[[str, float], None] | None = None,
    ):
        self._find = find  # a consumer's longest stored prefixes; a producer's stored objects
        # Told of each lookup given up on: why, and how long the store call it waits on has been out (0:
        # none is, the job was late for want of CPU). The scheduler reports a slow store to the breaker.
        self._on_late = on_late
        self._timer = StoreTimer(clock)
        self._exists = self._timer.wrap(exists)
        self._read = self._timer.wrap(read) if read is not None else None
        self._extend_min_tokens = extend_min_tokens
        self._timeout_s = timeout_s
        self._clock = clock
        self._calls = calls or BoundedCalls("kvtool-lookup", limit=1)
        self._requests: dict[str, _Pending] = {}
        self._job: _Job | None = None
        self.batches = 0  # jobs sent (a metric)
        self.timeouts = 0
        self.abandoned = 0

    def want(self, req_id: str, keys: PromptKeys, wait_s: float | None = None) -> None:
        """Ask for ``req_id``'s stored prefix (no-op while one is asked for or answered); its request
        waits for it at most ``wait_s`` (what its best hit could save), never past the time-out."""
        if req_id not in self._requests:
            limit = self._timeout_s if wait_s is None else max(0.0, min(wait_s, self._timeout_s))
            self._requests[req_id] = _Pending(keys, self._clock(), limit)

    def poll(self, req_id: str) -> Outcome | None:
        """The lookup's outcome, or None while it is in flight (or not yet sent)."""
        pending = self._requests.get(req_id)
        if pending is None:
            return None
        self._collect()
        if pending.outcome is not None:
            return pending.outcome
        now = self._clock()
        if now - pending.asked_at > self._timeout_s:
            self.timeouts += 1
            pending.outcome = StoreError(f"lookup timed out after {self._timeout_s:.3g} s")
        elif (waited := self._store_wait(pending, now)) > pending.wait_s:
            self.abandoned += 1
            pending.outcome = LookupAbandoned(
                f"the lookup took over {waited * 1e3:.0f} ms, more than the request's best hit could save "
                f"({pending.wait_s * 1e3:.0f} ms)"
            )
        if pending.outcome is not None and self._on_late is not None:
            self._on_late(str(pending.outcome), self._timer.in_flight_s(now))
        return pending.outcome

    def _store_wait(self, pending: _Pending, now: float) -> float:
        """How long ``pending`` has waited on the store: since its job was sent, or, not sent yet, since
        the job still out (which holds it back) was; never the time before it was asked, nor a step
        that kept the engine from sending it (the store is not slow for that)."""
        job = self._job if pending.job is None else None
        sent_at = pending.sent_at if pending.job is not None else (job.sent_at if job is not None else None)
        return 0.0 if sent_at is None else now - max(sent_at, pending.asked_at)

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def flush(self) -> None:
        """Send every waiting prompt as one job, unless a job is still out (they go with the next)."""
        self._collect()
        if self._job is not None:
            return
        waiting = [(rid, p) for rid, p in self._requests.items() if p.job is None and p.outcome is None]
        if not waiting:
            return
        prompts = [p.keys for _, p in waiting]
        try:
            future = self._calls.submit(
                lambda: self._find(prompts, self._exists, self._read, self._extend_min_tokens), "lookup"
            )
        except StoreError as exc:
            for _, pending in waiting:
                pending.outcome = exc
            return
        self.batches += 1
        sent_at = self._clock()
        self._job = _Job(future, [rid for rid, _ in waiting], sent_at)
        for _, pending in waiting:
            pending.job, pending.sent_at = future, sent_at
        self._collect()  # a synchronous executor (tests) has answered already

    def settle(self, budget_s: float) -> float:
        """Send what waits and wait at most ``budget_s`` for the job out to answer; the seconds spent.
        (A lookup answered within the scheduler's step saves its request a step; a slow or hung store
        costs at most the budget.)"""
        start = self._clock()
        self.flush()
        job = self._job
        if job is not None and budget_s > 0:
            concurrent.futures.wait([job.future], timeout=budget_s)
            self._collect()
        return self._clock() - start

    def take_stats(self) -> dict[str, int]:
        """The batches sent, the lookups timed out and given up on since the last call (for the metrics)."""
        counts = (
            ("lookup_batches", self.batches),
            ("lookup_timeouts", self.timeouts),
            ("lookups_abandoned", self.abandoned),
        )
        taken = {name: value for name, value in counts if value}
        self.batches = self.timeouts = self.abandoned = 0
        return taken

    def _collect(self) -> None:
        job = self._job
        if job is None or not job.future.done():
            return
        self._job = None
        try:
            outcomes: list[Outcome] = list(job.future.result())
        except StoreError as exc:
            outcomes = [exc] * len(job.req_ids)
        except Exception as exc:  # noqa: BLE001 - any failure of a lookup is a miss
            outcomes = [StoreError(f"lookup failed: {exc}")] * len(job.req_ids)
        for req_id, outcome in zip(job.req_ids, outcomes, strict=True):
            pending = self._requests.get(req_id)
            # Only the lookup this job was sent for: one forgotten meanwhile and asked again under the same
            # id (another prompt, where vLLM's request ids are not randomized) waits for a job of its own.
            if pending is not None and pending.outcome is None and pending.job is job.future:
                pending.outcome = outcome
