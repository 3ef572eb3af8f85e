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

from .backend import KVStore
from .calls import BoundedCalls, StoreError
from .objects import pointer_size
from .prefix import PromptKeys
from .search import ExistsFn, ReadFn, StoredPrefix, find_stored_prefixes

Outcome = StoredPrefix | StoreError
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
    job: concurrent.futures.Future | None = None
    outcome: Outcome | None = None


@dataclass
class _Job:
    future: concurrent.futures.Future
    req_ids: list[str] = field(default_factory=list)


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
    ):
        self._find = find  # a consumer's longest stored prefixes; a producer's stored objects
        self._exists = exists
        self._read = read
        self._extend_min_tokens = extend_min_tokens
        self._timeout_s = timeout_s
        self._clock = clock
        self._calls = calls or BoundedCalls("kvtool-lookup", limit=1)
        self._requests: dict[str, _Pending] = {}
        self._job: _Job | None = None
        self.batches = 0  # jobs sent (a metric)
        self.timeouts = 0

    def want(self, req_id: str, keys: PromptKeys) -> None:
        """Ask for ``req_id``'s stored prefix (no-op while one is asked for or answered)."""
        if req_id not in self._requests:
            self._requests[req_id] = _Pending(keys, self._clock())

    def poll(self, req_id: str) -> Outcome | None:
        """The lookup's outcome, or None while it is in flight (or not yet sent)."""
        pending = self._requests.get(req_id)
        if pending is None:
            return None
        self._collect()
        if pending.outcome is None and self._clock() - pending.asked_at > self._timeout_s:
            self.timeouts += 1
            pending.outcome = StoreError(f"lookup timed out after {self._timeout_s:.3g} s")
        return pending.outcome

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
        self._job = _Job(future, [rid for rid, _ in waiting])
        for _, pending in waiting:
            pending.job = future
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
        """The batches sent and the lookups timed out since the last call (counters for the metrics)."""
        taken = {
            name: value
            for name, value in (("lookup_batches", self.batches), ("lookup_timeouts", self.timeouts))
            if value
        }
        self.batches = self.timeouts = 0
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
