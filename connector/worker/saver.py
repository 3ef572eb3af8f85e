"""Saves in the background, in bounded memory, one batch put per save.

The worker copies a save's blocks into slots of the save staging area in the step that computed them
(so preemption or block reuse cannot change what is stored) and hands them here. The area's slots are
the budget: a save that does not fit keeps only the leading objects that do (a prefix is still a valid
prefix), and one that fits nothing is dropped; either way it is counted and the engine never waits.
One thread puts the saves in order: first the pending watermark record, then one existence query for
the save's objects (objects already stored are not sent again), then checksums and headers written
in place and one zero-copy batch put of the rest, straight from the slots, then the pointers to the
objects stored, then the final watermark record (each object's outcome).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..calls import StoreError
from ..data import RequestSave
from ..core.keys import KeyKind
from ..counters import Counters, WarnOnce
from .devicecopy import Fence
from ..core.objects import ObjectHeader, seal_object
from ..store.refusals import Refusals
from ..store.staging import Lease, Region, StagingArea
from ..store.store import KVStore, PutOutcome
from ..core.watermarks import SEQ_FINAL, SEQ_PENDING, ObjectProgress, WatermarkRecord, watermark

logger = logging.getLogger("vllm.kvtool")

DROPPED_BUDGET = "dropped_budget"  # not copied: the save budget was full
DROPPED_SHUTDOWN = "dropped_shutdown"  # not tried: the engine shut down first
# A put the store refused for lack of space is tried again after each of these pauses (its master evicts
# in the background, above 90% of its capacity): under pressure a save loses its later objects less often.
NO_SPACE_RETRY_DELAYS_S = (0.05, 0.2)
FINAL_RECORD_RETRY_S = 1.5  # a save's final record, refused once, is put again after this (past a breaker's 1 s)
# Once such a second try failed too, the store is taken for down: final records are not tried twice
# for this long (each try holds the put thread, and the saves queued behind it, for the pause).
FINAL_RECORD_RETRY_PAUSE_S = 30.0


@dataclass(frozen=True)
class ObjectCopy:
    """One object of a save, copied into a staging slot, waiting for its put."""

    transfer_number: int  # index in the save's transfers
    key: str
    region: Region  # the whole object: room for the header, then the payload
    # (key, record) of its pointers, put once it is stored: built on the put thread (an 8k-token save has
    # about a thousand, 3 ms of encoding that the engine's step does not pay).
    pointers: Callable[[], tuple[tuple[str, bytes], ...]] = tuple
    # The header to seal it with (checksum and header, ``objects.seal_object``) on the put thread, so
    # that the engine's step made the copy alone; None when the region holds a sealed object.
    header: ObjectHeader | None = None

    @property
    def nbytes(self) -> int:
        return len(self.region.view)


class SaveJob:
    """One request's save: its objects' progress in prompt order (full blocks, then the tail)."""

    def __init__(
        self,
        save: RequestSave,
        copies: list[ObjectCopy],
        watermark_key: Callable[[int], str],
        lease: Lease,
        copied: Fence | None = None,
        stored_keys: tuple[str | None, ...] = (),
    ):
        self.save = save
        # On a device the copies were queued on a stream: the put thread waits for them (``devicecopy``).
        self.copied = copied
        self.copies = copies
        self.watermark_key = watermark_key
        self.lease = lease  # the slots the copies are in; released once their put has returned
        self._lease_released = False
        self.objects = [
            ObjectProgress(o.kind, o.token_start, o.token_end, "present", o.group) for o in save.already_stored
        ]
        self._index: list[int] = []
        copied = {c.transfer_number for c in copies}
        for number, transfer in enumerate(save.transfers):
            self._index.append(len(self.objects))
            outcome = "pending" if number in copied else DROPPED_BUDGET
            self.objects.append(
                ObjectProgress(transfer.kind, transfer.token_start, transfer.token_end, outcome, transfer.group)
            )
        order = sorted(range(len(self.objects)), key=lambda i: _put_order(self.objects[i]))
        position = {old: new for new, old in enumerate(order)}
        self.objects = [self.objects[i] for i in order]
        self._index = [position[i] for i in self._index]
        # The objects found stored before (``already_stored``), asked about again: (position, key).
        self.rechecked = [(position[i], key) for i, key in enumerate(stored_keys) if key is not None]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.copies)

    def release_lease(self) -> None:
        """The put thread's hold on the slots, given up once (a store call still running holds its own)."""
        if not self._lease_released:
            self._lease_released = True
            self.lease.release()

    def record(self) -> WatermarkRecord:
        save = self.save
        return watermark(
            save.req_id,
            save.tag,
            save.prompt_tokens,
            self.objects,
            time.time(),
            save.last_block_key,
            save.tail_key,
            save.state_groups,
        )

    def settle(self, transfer_number: int, outcome: str) -> None:
        index = self._index[transfer_number]
        self.objects[index] = replace(self.objects[index], outcome=outcome)

    def in_put_order(self) -> list[ObjectCopy]:
        """Copies in the order the watermark reads them (blocks by position, then the tail)."""
        return sorted(self.copies, key=lambda c: self._index[c.transfer_number])


class Saver:
    def __init__(self, store: KVStore, *, area: StagingArea, drain_timeout_s: float):
        self._store = store
        self.area = area
        self._drain_timeout_s = drain_timeout_s
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._stop_by: float | None = None  # after this, the put thread drops what is left
        self._unsaved: collections.deque[str] = collections.deque()  # ``take_unsaved``; the put thread appends
        self._retry_failed_at: float | None = None  # a final record's second try failed then (``_store_down``)
        self.stats = Counters()
        self._warn_once = WarnOnce(logger)
        self._refusals = Refusals(store.exists)  # full, or not ready: what a refusal for space means
        self._thread = threading.Thread(target=self._loop, name="kvtool-put", daemon=True)
        self._thread.start()

    # -- admission (engine thread) ------------------------------------------------------------------

    def admit(self, num_objects: int) -> Lease | None:
        """Slots for as many leading objects of a save (in put order) as are free now; None if none."""
        lease = self.area.take(num_objects, partial=True)
        fits = len(lease) if lease is not None else 0
        if fits < num_objects:
            self.stats.add("save_objects_dropped_budget", num_objects - fits)
            if fits == 0:
                self.stats.add("saves_dropped_budget")
            self._warn_once(
                "budget",
                f"kvtool: the save area ({self.area.nbytes} bytes) is full (the store is slow or down); "
                "dropping objects of saves until it drains",
            )
        return lease

    def submit(self, job: SaveJob) -> None:
        """Queue a save whose copies were made in the slots ``admit`` gave."""
        self._queue.put(job)

    @property
    def held_bytes(self) -> int:
        return self.area.held_bytes

    # -- the put thread -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._run(job)
            except Exception:  # noqa: BLE001 - a bug must cost this save, never every later one
                logger.exception("kvtool: a save failed unexpectedly; it is dropped")
                self.stats.add("saves_crashed")
                self.note_unsaved(job.save)
            finally:
                job.release_lease()  # a no-op when _run gave it up

    def _run(self, job: SaveJob) -> None:
        if job.copied is not None:
            job.copied.wait()
        try:
            self._put_record(job, SEQ_PENDING)
            copies = job.in_put_order()
            answers = self._present([c.key for c in copies] + [key for _, key in job.rechecked])
            present = answers[: len(copies)] if answers is not None else [False] * len(copies)
            self._recheck(job, answers[len(copies) :] if answers is not None else None)
            stopping = self._stopping()
            sent = [c for c, found in zip(copies, present, strict=True) if not found and not stopping]
            outcomes = dict(zip((c.key for c in sent), self._put_batch(sent, job.lease), strict=True))
        finally:
            job.release_lease()  # a put still running in the client holds it until it returns
        pointers: list[tuple[str, bytes]] = []
        for copy, found in zip(copies, present, strict=True):
            outcome = "present" if found else DROPPED_SHUTDOWN if stopping else outcomes[copy.key].value
            if outcome == PutOutcome.STORED.value:
                self.stats.add("bytes_saved", copy.nbytes)
                pointers += copy.pointers()
            job.settle(copy.transfer_number, outcome)
            self.stats.add(f"saves_{outcome}")
        if any(o.outcome not in ("present", PutOutcome.STORED.value) for o in job.objects):
            self.note_unsaved(job.save)  # a put failed, objects past the budget, or one gone since its lookup
        job.copies = []
        if pointers and not self._stopping():
            self._put_pointers(pointers)
        self._put_record(job, SEQ_FINAL)

    def _put_batch(self, copies: list[ObjectCopy], lease: Lease) -> list[PutOutcome]:
        """Seal the copies in place and put them in one zero-copy batch; an outcome per copy."""
        for copy in copies:
            if copy.header is not None:
                seal_object(copy.header, copy.region.view)
        outcomes = self._put_from(copies, lease)
        # A full store refuses puts until its master has evicted, which it does in the background: the
        # refused objects are tried again after a pause (on this thread; the engine never waits).
        for delay_s in NO_SPACE_RETRY_DELAYS_S:
            refused = [index for index, outcome in enumerate(outcomes) if outcome is PutOutcome.NO_SPACE]
            if not refused or self._stopping():
                break
            time.sleep(delay_s)
            self.stats.add("puts_retried_no_space", len(refused))
            for index, outcome in zip(refused, self._put_from([copies[i] for i in refused], lease), strict=True):
                outcomes[index] = outcome
        return self._judged([c.key for c in copies], outcomes)

    def _judged(self, keys: list[str], outcomes: list[PutOutcome]) -> list[PutOutcome]:
        """The outcomes, with refusals for space told apart (full, or not ready: ``refusals``)."""
        for key, outcome in zip(keys, outcomes, strict=True):
            if outcome is PutOutcome.STORED:
                self._refusals.stored(key)
        refused = outcomes.count(PutOutcome.NO_SPACE)
        if not refused:
            return outcomes
        kind = self._refusals.judge(refused)
        return [kind if outcome is PutOutcome.NO_SPACE else outcome for outcome in outcomes]

    def _put_from(self, copies: list[ObjectCopy], lease: Lease) -> list[PutOutcome]:
        try:
            return self._store.put_from([(c.key, c.region) for c in copies], lease) if copies else []
        except StoreError as exc:
            self._warn_once("put", f"kvtool: put failed, that prefix stays a miss: {exc}")
            return [PutOutcome.FAILED] * len(copies)

    def _put_pointers(self, pointers: list[tuple[str, bytes]]) -> None:
        """Point to the save's stored objects from the divergence points inside them: one batch put, after
        the objects (a pointer is never stored before its object). A pointer already stored is replaced:
        the object it names may be gone (evicted), this one is not, and any object a pointer names holds
        the same prefix. A failed batch is only shorter hits for prompts that leave these ones there."""
        try:
            outcome = self._store.put_many(pointers, replace=True)
        except StoreError as exc:
            self._warn_once("put", f"kvtool: put failed, that prefix stays a miss: {exc}")
            outcome = PutOutcome.FAILED
        if outcome is PutOutcome.NO_SPACE:
            outcome = self._refusals.judge(len(pointers))
        self.stats.add(f"pointers_{outcome.value}", len(pointers))

    def _present(self, keys: list[str]) -> list[bool] | None:
        """Which keys are stored; None when the store did not answer (a put of a present key is a no-op)."""
        try:
            return self._store.exists(keys) if keys else []
        except StoreError:
            return None

    def _recheck(self, job: SaveJob, found: list[bool] | None) -> None:
        """Objects found stored before the save and not stored now (evicted since) are ``gone``; not
        answered, ``unchecked``: either way not durable, so the watermark stops before them."""
        answers: list[bool | None] = list(found) if found is not None else [None] * len(job.rechecked)
        for (index, _), stored in zip(job.rechecked, answers, strict=True):
            if not stored:
                outcome = "gone" if stored is not None else "unchecked"
                job.objects[index] = replace(job.objects[index], outcome=outcome)
                self.stats.add(f"saves_{outcome}")

    def _put_record(self, job: SaveJob, seq: int) -> None:
        if self._stopping() or job.save.checkpoint:
            return
        outcome = self._put(job.watermark_key(seq), job.record().encode())
        if outcome is not PutOutcome.FAILED:
            self._retry_failed_at = None  # the store answers again: a later failure gets its second try
        elif seq == SEQ_FINAL and not self._stopping() and not self._store_down():
            # The final record says the save ended (readers wait for it): one put that stalled just before
            # (Mooncake TCP's first transfer to a segment, 30 s) opens the breaker, which skipped it. Once
            # more, past the breaker's first back-off, on this thread (the engine never waits for it).
            time.sleep(FINAL_RECORD_RETRY_S)
            outcome = self._put(job.watermark_key(seq), job.record().encode())
            self._retry_failed_at = time.monotonic() if outcome is PutOutcome.FAILED else None
        self.stats.add(f"watermarks_{outcome.value}")

    def _store_down(self) -> bool:
        """A final record's second try failed within ``FINAL_RECORD_RETRY_PAUSE_S``."""
        failed = self._retry_failed_at
        return failed is not None and time.monotonic() - failed < FINAL_RECORD_RETRY_PAUSE_S

    def _put(self, key: str, value: bytes) -> PutOutcome:
        try:
            outcome = self._store.put(key, value)
        except StoreError as exc:
            self._warn_once("put", f"kvtool: put failed, that prefix stays a miss: {exc}")
            return PutOutcome.FAILED
        return self._judged([key], [outcome])[0]

    def _stopping(self) -> bool:
        return self._stop_by is not None and time.monotonic() > self._stop_by

    # -- helpers ------------------------------------------------------------------------------------

    def take_stats(self) -> dict[str, int]:
        return self.stats.take()

    def note_unsaved(self, save: RequestSave) -> None:
        """A prompt save that left objects unstored (any thread): ``take_unsaved`` reports its request."""
        if save.is_prompt_save:
            self._unsaved.append(save.req_id)

    def take_unsaved(self) -> frozenset[str]:
        """Requests whose prompt save, since the last call, left objects unstored (``note_unsaved``)."""
        taken = set()
        while self._unsaved:
            taken.add(self._unsaved.popleft())
        return frozenset(taken)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Let queued saves finish for at most the drain time-out, then drop the rest (logged)."""
        limit = self._drain_timeout_s if timeout_s is None else timeout_s
        self._stop_by = time.monotonic() + limit
        self._queue.put(None)
        self._thread.join(timeout=limit + 1.0)
        left = self.held_bytes
        dropped = self.stats.get(f"saves_{DROPPED_SHUTDOWN}", 0)
        if self._thread.is_alive() or dropped:
            logger.warning(
                "kvtool: shutdown after %.3g s of draining saves: %d objects dropped, %d bytes not put",
                limit,
                dropped,
                left,
            )


def _put_order(obj: ObjectProgress) -> tuple[bool, int, int]:
    """Blocks by position (every group's block k before block k + 1), then tails, then states."""
    return (obj.kind is not KeyKind.BLOCK, obj.token_end, obj.group)
