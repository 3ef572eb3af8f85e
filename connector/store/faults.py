"""Fault injection below the store adapter, for the fault suite. Off unless configured.

When ``fault_control_file`` is set, the store backend is wrapped: before each call the wrapper
re-reads the JSON fault plan from that file (when it changed), so a test can switch faults on and off
in a running engine. The faults sit under the store's time-outs and the connector's checks, where
real ones would: a delay is a slow store, a corrupted value is a torn or foreign object, a failed put
is a full store.
Production configurations never set ``fault_control_file``; the connector warns loudly when it is set.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ..calls import StoreError
from .backend import KVStore, PutOutcome

if TYPE_CHECKING:
    from .staging import Lease, Region

_RPC_FAILED = -900
_NOT_FOUND = -704


class FaultPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    delay_s: float = 0.0  # added to every call (a slow store)
    put_delay_s: float = 0.0  # added to puts only (a producer's save stays in flight)
    get_delay_s: float = 0.0  # added to loads only (a slow transfer; lookups still answer)
    fail_exists: bool = False  # existence queries fail (RPC failure)
    fail_get: bool = False  # loads find nothing (the segment's owner is gone)
    corrupt_get: Literal["flip", "truncate", "namespace"] | None = None  # what loads read back
    get_kinds: tuple[Literal["b", "t", "s", "p"], ...] = ("b", "t", "s")  # which objects corrupt_get spoils
    # Which namespaces' objects corrupt_get spoils (empty: all): one TP rank's, to fail that rank only.
    get_namespaces: tuple[str, ...] = ()
    put_outcome: Literal["no_space", "failed"] | None = None
    put_kinds: tuple[Literal["b", "t", "s", "p", "w"], ...] = ("b", "t", "s", "p", "w")  # which put_outcome hits


def _kind_of(key: str) -> str:
    """The kind letter of a key: kvtool/<v>/<ns>/w/... or kvtool/<v>/<ns>/<group>/<kind>/..."""
    parts = key.split("/")
    if len(parts) > 3 and parts[3] == "w":
        return "w"
    return parts[4] if len(parts) > 4 else ""


def corrupt(value: bytes, how: str) -> bytes:
    if not value:
        return value
    if how == "flip":
        return value[:-1] + bytes([value[-1] ^ 0x01])
    if how == "truncate":
        return value[: len(value) // 2]
    # Another namespace: the header's fingerprint (bytes 8..24) is someone else's.
    return value[:8] + bytes(b ^ 0xFF for b in value[8:24]) + value[24:]


def corrupt_in_place(view: memoryview, count: int, how: str) -> int:
    """``corrupt`` on an object read into a region (``count`` bytes of it); the bytes it now holds."""
    if count <= 0:
        return count
    if how == "flip":
        view[count - 1] ^= 0x01
        return count
    if how == "truncate":
        return count // 2
    view[8:24] = bytes(b ^ 0xFF for b in view[8:24])
    return count


def _spoiled(plan: FaultPlan, key: str) -> bool:
    """Whether ``corrupt_get`` spoils the object under ``key``."""
    parts = key.split("/")
    namespace = parts[2] if len(parts) > 2 else ""
    return _kind_of(key) in plan.get_kinds and (not plan.get_namespaces or namespace in plan.get_namespaces)


class FaultyStore:
    """Wraps any ``KVStore``; every call goes through the current fault plan first.

    It sits under the time-outs (``store.open_store`` puts it between the backend and
    ``TimedStore``), where a real fault would: a delay is a slow store, a corrupted value a torn or
    foreign object, a put outcome a full or failing store.
    """

    def __init__(self, store: KVStore, control_file: str):
        self._store = store
        self._control_file = control_file
        self._plan = FaultPlan()
        self._stamp: tuple[int, int, int] | None = None

    def plan(self) -> FaultPlan:
        try:
            info = os.stat(self._control_file)
            stamp = (info.st_mtime_ns, info.st_size, info.st_ino)  # two writes within one tick differ too
        except OSError:
            self._plan, self._stamp = FaultPlan(), None
            return self._plan
        if stamp != self._stamp:
            try:
                with open(self._control_file, encoding="utf-8") as handle:
                    self._plan = FaultPlan(**json.load(handle))
            except (OSError, ValueError, ValidationError):
                self._plan = FaultPlan()  # a half-written or bad plan injects nothing
            self._stamp = stamp
        return self._plan

    def _enter(self, extra_delay_s: float = 0.0) -> FaultPlan:
        plan = self.plan()
        delay = plan.delay_s + extra_delay_s
        if delay:
            time.sleep(delay)
        return plan

    def exists(self, keys: Sequence[str]) -> list[bool]:
        plan = self._enter()
        if plan.fail_exists:
            raise StoreError(f"existence query failed with code {_RPC_FAILED}")
        return self._store.exists(keys)

    def get(self, keys: Sequence[str], object_bytes: int = 0) -> list[bytes | None]:
        plan = self._enter(self.plan().get_delay_s)
        if plan.fail_get:
            return [None] * len(keys)  # what a load finds when the segment's owner is gone
        values = self._store.get(keys, object_bytes)
        if plan.corrupt_get is None:
            return values
        return [
            corrupt(v, plan.corrupt_get) if v is not None and _spoiled(plan, k) else v
            for k, v in zip(keys, values, strict=True)
        ]

    def put(self, key: str, value: bytes) -> PutOutcome:
        plan = self._enter(self.plan().put_delay_s)
        if plan.put_outcome is not None and _kind_of(key) in plan.put_kinds:
            return PutOutcome.NO_SPACE if plan.put_outcome == "no_space" else PutOutcome.FAILED
        return self._store.put(key, value)

    def put_many(self, items: Sequence[tuple[str, bytes]], replace: bool = False) -> PutOutcome:
        plan = self._enter(self.plan().put_delay_s)
        if plan.put_outcome is not None and any(_kind_of(key) in plan.put_kinds for key, _ in items):
            return PutOutcome.NO_SPACE if plan.put_outcome == "no_space" else PutOutcome.FAILED
        return self._store.put_many(items, replace)

    def register(self, address: int, nbytes: int) -> None:
        self._store.register(address, nbytes)

    def get_into(self, keys: Sequence[str], regions: Sequence[Region], lease: Lease) -> list[int]:
        plan = self._enter(self.plan().get_delay_s)
        if plan.fail_get:
            return [_NOT_FOUND] * len(keys)
        counts = self._store.get_into(keys, regions, lease)
        if plan.corrupt_get is None:
            return counts
        return [
            corrupt_in_place(region.view, count, plan.corrupt_get) if _spoiled(plan, key) else count
            for key, region, count in zip(keys, regions, counts, strict=True)
        ]

    def put_from(self, items: Sequence[tuple[str, Region]], lease: Lease) -> list[PutOutcome]:
        plan = self._enter(self.plan().put_delay_s)
        if plan.put_outcome is None:
            return self._store.put_from(items, lease)
        refused = PutOutcome.NO_SPACE if plan.put_outcome == "no_space" else PutOutcome.FAILED
        passed = [(key, region) for key, region in items if _kind_of(key) not in plan.put_kinds]
        stored = iter(self._store.put_from(passed, lease) if passed else [])
        return [refused if _kind_of(key) in plan.put_kinds else next(stored) for key, _ in items]

    def remove(self, key: str) -> int:
        return self._store.remove(key)

    def close(self) -> None:
        self._store.close()
