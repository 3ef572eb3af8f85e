"""Host staging areas for zero-copy transfers: one buffer per direction, registered with the store once,
cut into slots of one object each.

A save copies its blocks into slots of the save area (the only copy the engine's step makes); the put
thread seals them in place and the store reads them from there (``batch_put_from``). A load's objects
are read straight into slots of the load area (``batch_get_into``), checked there and copied into the
KV cache. Free slots are the budget: a save that finds none is dropped, a load waits its turn.

A slot is handed out in a ``Lease`` and comes back when every holder has released it. The store's
time-outs stop waiting for a call, not the call: a call still running in the client library holds
its lease (``store.TimedStore``), so memory the library may still write into or read from is never
handed to another transfer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

SLOT_ALIGN = 64  # bytes: every slot starts on a cache line


@dataclass(frozen=True)
class Region:
    """Bytes of a lease's slot that one transfer reads or writes: where they are, and a view of them."""

    address: int
    view: memoryview  # writable, exactly the transfer's length


class Lease:
    """Slots of a staging area, held until ``release`` has been called once per ``hold`` (and once
    for the taker); then they go back to the area."""

    def __init__(self, memory: torch.Tensor, offsets: list[int], slot_bytes: int, give_back: Callable[[], None]):
        self._memory = memory  # keeps the buffer alive while any holder remains
        self._offsets = offsets
        self.slot_bytes = slot_bytes
        self._give_back = give_back
        self._holders = 1
        self._lock = threading.Lock()
        self._view = memoryview(memory.numpy()).cast("B")

    def __len__(self) -> int:
        return len(self._offsets)

    def region(self, index: int, size: int | None = None) -> Region:
        """The first ``size`` bytes (default: all) of the lease's ``index``-th slot."""
        size = self.slot_bytes if size is None else size
        if not 0 <= size <= self.slot_bytes:
            raise ValueError(f"{size} bytes do not fit a {self.slot_bytes}-byte slot")
        offset = self._offsets[index]
        return Region(self._memory.data_ptr() + offset, self._view[offset : offset + size])

    def hold(self) -> None:
        with self._lock:
            if self._holders == 0:
                raise RuntimeError("a released lease cannot be held again")
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:
                return
            self._holders -= 1
            last = self._holders == 0
        if last:
            self._give_back()

    @property
    def released(self) -> bool:
        with self._lock:
            return self._holders == 0


class StagingArea:
    """``slots`` slots of ``slot_bytes`` (rounded up to ``SLOT_ALIGN``) in one host buffer."""

    def __init__(self, name: str, slot_bytes: int, slots: int):
        if slot_bytes <= 0 or slots <= 0:
            raise ValueError(f"a staging area needs slots of some bytes, not {slots} x {slot_bytes}")
        self.name = name
        self.slot_bytes = -(-slot_bytes // SLOT_ALIGN) * SLOT_ALIGN
        self.slots = slots
        # Pages are touched on first use only; pinned where a GPU copies into it.
        self.memory = torch.empty(self.slot_bytes * slots, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()
        self.oversize = 0  # leases larger than the area, served from a buffer of their own (a metric)

    @property
    def address(self) -> int:
        return self.memory.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.memory.numel()

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def held_bytes(self) -> int:
        return (self.slots - self.free_slots) * self.slot_bytes

    def take(self, count: int, *, partial: bool = False) -> Lease | None:
        """``count`` slots, or None when fewer are free (``partial``: as many as are free, None if none)."""
        if count <= 0:
            return Lease(self.memory, [], self.slot_bytes, lambda: None) if count == 0 and not partial else None
        with self._lock:
            if len(self._free) < count and not (partial and self._free):
                return None
            taken = [self._free.pop() for _ in range(min(count, len(self._free)))]
        offsets = [slot * self.slot_bytes for slot in taken]
        return Lease(self.memory, offsets, self.slot_bytes, lambda: self._put_back(taken))

    def take_oversize(self, count: int, given_back: Callable[[], None] = lambda: None) -> Lease:
        """``count`` slots in a buffer of their own, for a transfer larger than the whole area (it is
        not registered with the store: slower, and on RDMA it fails, which is a miss); ``given_back``
        runs when it is released."""
        self.oversize += 1
        memory = torch.empty(self.slot_bytes * count, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return Lease(memory, [i * self.slot_bytes for i in range(count)], self.slot_bytes, given_back)

    def _put_back(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)
