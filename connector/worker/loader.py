"""Asynchronous loads: fetched, checked and copied into the KV cache off the engine thread.

vLLM admits a request with an external hit in the state WAITING_FOR_REMOTE_KVS (the connector
returned ``load_kv_async=True``): its blocks are allocated but not cached and not scheduled, and vLLM
frees them (even for an aborted request) only once the connector reports the request received. In
the step that plans the load, ``start`` sends the fetch to a background thread, which reads the
objects, checks every header and checksum, and copies the checked blocks into the request's blocks
(no forward pass touches them: the request is not scheduled, and they hold no cached prefix). At the
end of each later step, ``finish`` reports every load that ended as received; vLLM schedules it in
the next step. A fetch that failed in any way, or did not answer within the load time-out, is reported
as a failed receive: vLLM drops the whole external hit (nothing of it was cached) and recomputes in
those blocks (a check that fails after earlier objects were copied leaves them in the request's own
blocks, which are recomputed with the rest). So a slow load delays only its own request, and a failed
one is a miss that no other request can ever see.

The copy and the time-out are settled under the load's gate: the fetch thread copies only while the
load is not abandoned, and the engine abandons it (reports it failed) only while no copy has begun;
one that has begun is waited for (a host copy: milliseconds, not the store's time), then reported
received. So no byte lands in a block after vLLM was told to recompute it.

Objects are read straight into slots of the load staging area (``staging``), one batch per load,
checked there, and copied into the KV cache from there, each right after its check (its bytes still
in the CPU's cache: 0.80x the raw store's rate where checking all first made 0.78x); the slots are
the byte budget.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial

from ..calls import BoundedCalls, StoreBusy, StoreError
from ..data import BlockTransfer, RequestLoad
from ..core.keys import KeyKind
from ..core.objects import ObjectHeader, ObjectRejected, verify_object
from ..store.staging import Lease, StagingArea
from ..store.store import KVStore


_KIND_NAMES = {KeyKind.BLOCK: "block", KeyKind.TAIL: "tail", KeyKind.STATE: "state"}


@dataclass(frozen=True)
class LoadFailure:
    cause: str  # a metric label: store_error, missing, timeout, no_turn, checksum, ...
    detail: str


@dataclass(frozen=True)
class Fetched:
    """What a fetch brought back: every block's checked payload, or the first failure."""

    payloads: tuple[memoryview, ...] = ()
    failure: LoadFailure | None = None
    seconds: float = 0.0  # the transfer, checks and copy, on the fetch thread
    counts: dict[str, int] | None = None  # what was copied into the KV cache (``_loaded_counts``)


@dataclass
class Delivery:
    """Where a fetch's checked payloads go (the KV cache), and whether all of them went."""

    write: Callable[[BlockTransfer, memoryview], None]
    complete: bool = False


def fetch(
    store: KVStore,
    transfers: tuple[BlockTransfer, ...],
    key_of: Callable[[BlockTransfer], str],
    header_of: Callable[[BlockTransfer], ObjectHeader],
    lease: Lease,
    deliver: Callable[[], AbstractContextManager[Delivery | None]],
) -> Fetched:
    """Read a load's objects into the lease's slots (runs on a background thread), then, inside
    ``deliver``'s context, check each one and hand its payload (a view of its slot) to the delivery
    the context gives, right after its check, while its bytes are still in the CPU's cache. A context
    that gives none (the load was abandoned) makes the fetch a time-out. Pure but for the store."""
    keys = [key_of(t) for t in transfers]
    regions = [lease.region(index) for index in range(len(transfers))]
    try:
        counts = store.get_into(keys, regions, lease)
    except StoreError as exc:
        return Fetched(failure=LoadFailure("store_error", str(exc)))
    payloads = []
    with deliver() as delivery:
        if delivery is None:
            return Fetched(failure=LoadFailure("timeout", "answered after its time-out"))
        for key, transfer, region, count in zip(keys, transfers, regions, counts, strict=True):
            if count <= 0:
                return Fetched(failure=LoadFailure("missing", f"{key} could not be read ({count})"))
            try:
                payload = verify_object(region.view[:count], header_of(transfer))
            except ObjectRejected as exc:
                return Fetched(failure=LoadFailure(exc.cause, f"{key}: {exc}"))
            delivery.write(transfer, payload)
            payloads.append(payload)
        delivery.complete = True
    return Fetched(payloads=tuple(payloads))


def _late(entry: _InFlight, timeout_s: float) -> LoadFailure:
    """Why a started load that did not answer in time failed: its time-out, or slower than recomputing."""
    if entry.limit_s < timeout_s:
        return LoadFailure("slow", f"load took longer than recomputing its tokens ({entry.limit_s * 1e3:.0f} ms)")
    return LoadFailure("timeout", f"load did not answer within {timeout_s:.3g} s")


@dataclass
class _InFlight:
    load: RequestLoad
    deadline: float  # to start, while queued; to answer, once started
    planned: float = 0.0  # when the step that started it began: its request has waited since
    lease: Lease | None = None  # the slots its fetch reads into, once started
    future: concurrent.futures.Future[Fetched] | None = None
    failure: LoadFailure | None = None  # failed before it started
    # The copy into the KV cache against the time-out (module docstring): set under ``gate``.
    gate: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False  # reported failed: no copy may begin
    limit_s: float = 0.0  # how long it may take once started (``Loader._answer_limit_s``)
    applied: bool = False  # copied into the KV cache: reported received, even past the deadline


@dataclass(frozen=True)
class Finished:
    """Loads that ended this step: every one received, some of them failed (with first token, cause)."""

    received: frozenset[str] = frozenset()
    failed: dict[str, tuple[int, LoadFailure]] | None = None


MAX_SAMPLES = 256  # measurements kept for the scheduler side, should it not collect them

# Fetch threads: loads wait on the network with the GIL released, so a few run side by side; more
# only adds threads stuck on a frozen store. Bytes in flight are what bounds loads (``budget_bytes``).
LOAD_THREADS = 4
# A load is never given less than this to answer: its tokens' recompute may be priced at a few ms, while a
# healthy load's transfer, copies and the threads' turns on a busy CPU engine take tens of ms and more (CI
# saw a tensor-parallel pair's loads, four workers on two cores, past 50 ms): only loads slower than this
# are cut short of the load time-out.
SLOW_LOAD_FLOOR_S = 2.0


class Loader:
    """Starts loads in arrival order while the load area has slots for their objects (one load always
    runs: a load larger than the whole area gets a buffer of its own when none is in flight) and a
    fetch thread is free; the others wait their turn, as the request
    waits for its external tokens in vLLM. A load that cannot start within the load time-out (a hung
    store keeps every thread) or does not answer within it once started fails: a miss, never a hang."""

    def __init__(
        self,
        store: KVStore | None,
        *,
        key_of: Callable[[BlockTransfer], str],
        header_of: Callable[[BlockTransfer], ObjectHeader],
        write_block: Callable[[BlockTransfer, memoryview], None],
        timeout_s: float,
        area: StagingArea | None = None,
        clock: Callable[[], float] = time.monotonic,
        calls: BoundedCalls | None = None,
        copies: Callable[[], AbstractContextManager[None]] | None = None,
    ):
        self._store = store
        self._key_of = key_of
        self._header_of = header_of
        self._write_block = write_block
        self._timeout_s = timeout_s
        self.area = area  # set when the worker knows its block size (register_kv_caches)
        self._clock = clock
        self._calls = calls or BoundedCalls("kvtool-load", limit=LOAD_THREADS)
        # Around a load's copies into the KV cache: on a device, they have completed when it ends
        # (``devicecopy.CopyStream.loading``); on the CPU each copy is done when it returns.
        self._copies = copies or nullcontext
        self._in_flight: dict[str, _InFlight] = {}
        self._queue: deque[_InFlight] = deque()  # planned, waiting for bytes or a thread
        self._oversize_held = 0  # leases of their own, larger than the area, not yet returned
        self._lock = threading.Lock()
        self.queued = 0  # loads that had to wait for their turn (a metric)
        # Of loads applied: (bytes, seconds of the transfer, seconds its request waited), for the cost model.
        self.samples: list[tuple[int, float, float]] = []

    @property
    def held_bytes(self) -> int:
        """Bytes of slots held by fetches started and not yet applied, failed, or returned."""
        with self._lock:
            oversize = self._oversize_held
        return (self.area.held_bytes if self.area is not None else 0) + oversize

    def start(self, load: RequestLoad) -> None:
        if load.req_id in self._in_flight:
            return  # started already (the same step's metadata bound twice): one fetch per load
        now = self._clock()
        entry = _InFlight(load, now + self._timeout_s, planned=now, limit_s=self._answer_limit_s(load))
        self._in_flight[load.req_id] = entry
        if self._store is None or self.area is None:
            entry.failure = LoadFailure("no_store", "the worker has no store connection")
            return
        self._queue.append(entry)
        self._start_queued()
        if entry.future is None and entry.failure is None:
            self.queued += 1

    def _answer_limit_s(self, load: RequestLoad) -> float:
        """How long a started load may take: the load time-out, or, where the scheduler priced its
        tokens' recompute, that (at least ``SLOW_LOAD_FLOOR_S``): a load slower than recomputing is a
        miss, and its request recomputes instead of waiting on."""
        if load.recompute_s is None:
            return self._timeout_s
        return min(self._timeout_s, max(SLOW_LOAD_FLOOR_S, load.recompute_s))

    def _start_queued(self) -> None:
        store, area = self._store, self.area
        while self._queue and store is not None and area is not None:
            entry = self._queue[0]
            count = len(entry.load.transfers)
            lease = area.take(count)
            oversize = lease is None and count > area.slots and not self.held_bytes
            if lease is None and not oversize:
                return  # earlier loads hold the slots: its turn comes when they end
            if oversize:  # larger than the whole area, nothing else in flight: a buffer of its own
                size = count * area.slot_bytes
                with self._lock:
                    self._oversize_held += size
                give_back: Callable[[], None] = partial(self._oversize_done, size)
                fetcher = self._oversize_fetcher(store, entry, area, give_back)
            else:
                assert lease is not None
                give_back, fetcher = lease.release, self._fetcher(store, entry, lease)
            try:
                entry.future = self._calls.submit(fetcher, "load")
            except StoreBusy:  # every thread is stuck on the store: wait for one, within the deadline
                give_back()
                return
            except StoreError as exc:
                give_back()
                entry.failure = LoadFailure("store_error", str(exc))
            else:
                entry.lease = lease  # None for a buffer of its own: its fetch gives that back (below)
            self._queue.popleft()
            entry.deadline = self._clock() + entry.limit_s

    def _oversize_fetcher(
        self, store: KVStore, entry: _InFlight, area: StagingArea, give_back: Callable[[], None]
    ) -> Callable[[], Fetched]:
        """A fetch into a buffer of its own, allocated on the fetch thread (pinned on a GPU host: a large
        ``cudaHostAlloc`` on the engine's thread would stall every stream) and given back once the fetch
        returns (its payloads have been copied into the KV cache by then). A buffer the host cannot give
        is a ``no_memory`` miss."""

        def fetched() -> Fetched:
            try:
                lease = area.take_oversize(len(entry.load.transfers), give_back)
            except (RuntimeError, MemoryError) as exc:
                give_back()
                return Fetched(failure=LoadFailure("no_memory", f"no buffer for a load larger than the area: {exc}"))
            try:
                return self._fetcher(store, entry, lease)()
            finally:
                lease.release()  # a store call still running in the client holds it until it returns

        return fetched

    def _oversize_done(self, size: int) -> None:
        with self._lock:
            self._oversize_held -= size

    def _fetcher(self, store: KVStore, entry: _InFlight, lease: Lease) -> Callable[[], Fetched]:
        def timed() -> Fetched:
            start = time.perf_counter()
            fetched = fetch(
                store,
                entry.load.transfers,
                self._key_of,
                self._header_of,
                lease,
                lambda: _copying(entry, self._write_block, self._copies),
            )
            if fetched.failure is None:
                fetched = replace(fetched, counts=_loaded_counts(entry.load, fetched))
            return replace(fetched, seconds=time.perf_counter() - start)

        return timed

    def _drop(self, entry: _InFlight) -> None:
        """Forget an ended load; its bytes are free once its fetch has returned."""
        del self._in_flight[entry.load.req_id]
        if entry in self._queue:
            self._queue.remove(entry)
        elif entry.future is not None and entry.lease is not None:
            lease = entry.lease
            entry.future.add_done_callback(lambda _: lease.release())  # runs now if it has returned

    def fail(self, load: RequestLoad, cause: str, detail: str) -> None:
        """Report ``load`` as failed at the next ``finish`` without trying it."""
        entry = _InFlight(load, self._clock())
        entry.failure = LoadFailure(cause, detail)
        self._in_flight[load.req_id] = entry

    def finish(self, wait_s: float = 0.0) -> tuple[Finished, dict[str, int]]:
        """Apply every fetch that answered; fail every one past its deadline; start waiting loads whose
        turn came. Returns what ended and counts.

        ``wait_s``: how long to wait first for the fetches in flight (an idle step's: the engine would
        only run empty steps until they answer, and each empty step holds the GIL their threads need)."""
        if wait_s > 0:
            running = [e.future for e in self._in_flight.values() if e.future is not None and not e.future.done()]
            if running:
                concurrent.futures.wait(running, timeout=wait_s)
        received: set[str] = set()
        failed: dict[str, tuple[int, LoadFailure]] = {}
        counts: dict[str, int] = {}
        if self.queued:
            counts["loads_queued"], self.queued = self.queued, 0
        now = self._clock()
        for req_id, entry in list(self._in_flight.items()):
            failure = entry.failure
            if failure is None and entry.future is not None and entry.future.done():
                failure = self._answered(entry, counts)
            elif failure is None and now > entry.deadline:
                if entry.future is None:
                    failure = LoadFailure(
                        "no_turn", f"load could not start within {self._timeout_s:.3g} s (earlier loads hold the store)"
                    )
                elif self._abandon(entry):  # the fetch may still be stuck in the client; its answer is dropped
                    failure = _late(entry, self._timeout_s)
                    if failure.cause == "slow" and self.area is not None:  # the cost model learns it (a bound)
                        nbytes = len(entry.load.transfers) * self.area.slot_bytes
                        self.samples.append((nbytes, entry.limit_s, now - entry.planned))
                else:  # its copy began before the deadline and has ended: it is received
                    entry.future.result()  # returns at once: the copy was the fetch's last step
                    failure = self._answered(entry, counts)
            elif failure is None:
                continue
            self._drop(entry)
            received.add(req_id)
            if failure is not None:
                first = min((t.token_start for t in entry.load.transfers), default=0)
                failed[req_id] = (first, failure)
                counts[f"load_failures_{failure.cause}"] = counts.get(f"load_failures_{failure.cause}", 0) + 1
        self._start_queued()
        return Finished(frozenset(received), failed), counts

    def _answered(self, entry: _InFlight, counts: dict[str, int]) -> LoadFailure | None:
        """A fetch that returned: its failure, or (copied into the KV cache) its counts and sample."""
        assert entry.future is not None
        try:
            fetched = entry.future.result()
        except Exception as exc:  # noqa: BLE001 - a failed fetch is a miss
            fetched = Fetched(failure=LoadFailure("store_error", f"load failed: {exc}"))
        if fetched.failure is not None:
            return fetched.failure
        for name, amount in (fetched.counts or {}).items():
            counts[name] = counts.get(name, 0) + amount
        nbytes = sum(len(p) for p in fetched.payloads)
        self.samples.append((nbytes, fetched.seconds, self._clock() - entry.planned))
        del self.samples[:-MAX_SAMPLES]
        return None

    @staticmethod
    def _abandon(entry: _InFlight) -> bool:
        """Mark a load past its deadline abandoned, unless its copy began (waits for that copy to end)."""
        with entry.gate:
            if entry.applied:
                return False
            entry.abandoned = True
            return True


@contextmanager
def _copying(
    entry: _InFlight,
    write: Callable[[BlockTransfer, memoryview], None],
    copies: Callable[[], AbstractContextManager[None]],
) -> Iterator[Delivery | None]:
    """The load's gate held while its objects are checked and copied: no delivery once it is abandoned;
    ``applied`` once every object was copied and the copies completed (``copies`` ended; a failed
    check, or copies that failed, leave it unset: the load failed)."""
    with entry.gate:
        if entry.abandoned:
            yield None
            return
        delivery = Delivery(write)
        try:
            with copies():
                yield delivery
        except BaseException:
            delivery.complete = False
            raise
        finally:
            entry.applied = delivery.complete


def _loaded_counts(load: RequestLoad, fetched: Fetched) -> dict[str, int]:
    counts: dict[str, int] = {}
    for transfer, payload in zip(load.transfers, fetched.payloads, strict=True):
        kind = f"{_KIND_NAMES[transfer.kind]}_objects_loaded"
        for name, amount in (("objects_loaded", 1), (kind, 1), ("bytes_loaded", len(payload))):
            counts[name] = counts.get(name, 0) + amount
    return counts
