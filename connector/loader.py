"""Asynchronous loads: fetched and checked off the engine thread, copied into the KV cache on it.

vLLM admits a request with an external hit in the state WAITING_FOR_REMOTE_KVS (the connector
returned ``load_kv_async=True``): its blocks are allocated but not cached and not scheduled. In the
step that plans the load, ``start`` sends the fetch to a background thread, which reads the objects
and checks every header and checksum. At the end of each later step, ``finish`` (on the engine
thread, between forward passes) copies the checked blocks of every fetch that answered into the
KV cache and reports the request as received; vLLM schedules it in the next step. A fetch that failed
in any way, or did not answer within the load time-out, is reported as a failed receive: vLLM drops
the whole external hit (nothing of it was cached) and recomputes. So a slow load delays only its own
request, and a failed one is a miss that no other request can ever see.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass

from .calls import BoundedCalls, StoreError
from .data import BlockTransfer, RequestLoad
from .keys import KeyKind
from .objects import ObjectHeader, ObjectRejected, verify_object
from .store import KVStore


_KIND_NAMES = {KeyKind.BLOCK: "block", KeyKind.TAIL: "tail", KeyKind.STATE: "state"}


@dataclass(frozen=True)
class LoadFailure:
    cause: str  # a metric label: store_error, missing, timeout, busy, checksum, ...
    detail: str


@dataclass(frozen=True)
class Fetched:
    """What a fetch brought back: every block's checked payload, or the first failure."""

    payloads: tuple[memoryview, ...] = ()
    failure: LoadFailure | None = None


def fetch(
    store: KVStore,
    transfers: tuple[BlockTransfer, ...],
    key_of: Callable[[BlockTransfer], str],
    header_of: Callable[[BlockTransfer], ObjectHeader],
    object_bytes: int,
) -> Fetched:
    """Read and check a load's objects (runs on a background thread). Pure but for the store."""
    keys = [key_of(t) for t in transfers]
    try:
        values = store.get(keys, object_bytes)
    except StoreError as exc:
        return Fetched(failure=LoadFailure("store_error", str(exc)))
    payloads = []
    for key, transfer, value in zip(keys, transfers, values, strict=True):
        if value is None:
            return Fetched(failure=LoadFailure("missing", f"{key} could not be read"))
        try:
            payloads.append(verify_object(value, header_of(transfer)))
        except ObjectRejected as exc:
            return Fetched(failure=LoadFailure(exc.cause, f"{key}: {exc}"))
    return Fetched(payloads=tuple(payloads))


@dataclass
class _InFlight:
    load: RequestLoad
    deadline: float
    future: concurrent.futures.Future[Fetched] | None = None
    failure: LoadFailure | None = None  # failed before it started


@dataclass(frozen=True)
class Finished:
    """Loads that ended this step: every one received, some of them failed (with first token, cause)."""

    received: frozenset[str] = frozenset()
    failed: dict[str, tuple[int, LoadFailure]] | None = None


class Loader:
    def __init__(
        self,
        store: KVStore | None,
        *,
        key_of: Callable[[BlockTransfer], str],
        header_of: Callable[[BlockTransfer], ObjectHeader],
        object_bytes: Callable[[], int],
        write_block: Callable[[BlockTransfer, memoryview], None],
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        calls: BoundedCalls | None = None,
    ):
        self._store = store
        self._key_of = key_of
        self._header_of = header_of
        self._object_bytes = object_bytes
        self._write_block = write_block
        self._timeout_s = timeout_s
        self._clock = clock
        self._calls = calls or BoundedCalls("kvtool-load", limit=2)
        self._in_flight: dict[str, _InFlight] = {}

    def start(self, load: RequestLoad) -> None:
        entry = _InFlight(load, self._clock() + self._timeout_s)
        self._in_flight[load.req_id] = entry
        store = self._store
        if store is None:
            entry.failure = LoadFailure("no_store", "the worker has no store connection")
            return
        size = self._object_bytes()
        try:
            entry.future = self._calls.submit(
                lambda: fetch(store, load.transfers, self._key_of, self._header_of, size), "load"
            )
        except StoreError as exc:
            entry.failure = LoadFailure("busy", str(exc))

    def fail(self, load: RequestLoad, cause: str, detail: str) -> None:
        """Report ``load`` as failed at the next ``finish`` without trying it."""
        entry = _InFlight(load, self._clock())
        entry.failure = LoadFailure(cause, detail)
        self._in_flight[load.req_id] = entry

    def finish(self) -> tuple[Finished, dict[str, int]]:
        """Apply every fetch that answered; fail every one past its deadline. Returns what ended and counts."""
        received: set[str] = set()
        failed: dict[str, tuple[int, LoadFailure]] = {}
        counts: dict[str, int] = {}
        now = self._clock()
        for req_id, entry in list(self._in_flight.items()):
            failure = entry.failure
            if failure is None and entry.future is not None and entry.future.done():
                try:
                    fetched = entry.future.result()
                except Exception as exc:  # noqa: BLE001 - a failed fetch is a miss
                    fetched = Fetched(failure=LoadFailure("store_error", f"load failed: {exc}"))
                failure = fetched.failure
                if failure is None:
                    self._apply(entry.load, fetched, counts)
            elif failure is None and now > entry.deadline:
                # The fetch may still be stuck in the client; its answer is dropped when it comes.
                failure = LoadFailure("timeout", f"load did not answer within {self._timeout_s:.3g} s")
            elif failure is None:
                continue
            del self._in_flight[req_id]
            received.add(req_id)
            if failure is not None:
                first = min((t.token_start for t in entry.load.transfers), default=0)
                failed[req_id] = (first, failure)
                counts[f"load_failures_{failure.cause}"] = counts.get(f"load_failures_{failure.cause}", 0) + 1
        return Finished(frozenset(received), failed), counts

    def _apply(self, load: RequestLoad, fetched: Fetched, counts: dict[str, int]) -> None:
        for transfer, payload in zip(load.transfers, fetched.payloads, strict=True):
            self._write_block(transfer, payload)
            kind = f"{_KIND_NAMES[transfer.kind]}_objects_loaded"
            for name, amount in (("objects_loaded", 1), (kind, 1), ("bytes_loaded", len(payload))):
                counts[name] = counts.get(name, 0) + amount
