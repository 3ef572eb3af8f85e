"""Waits, before a bench request that reuses earlier ones, until their saves are in the store."""

from __future__ import annotations

import time
from typing import Any

from connector.core.hits import HitDetails
from kvtool.store.admin import open_admin, wait_for_key, wait_for_quiet_key_count
from kvtool.pair.profiles import profile
from kvtool.pair.ready import ReadyFile

KEY_COUNT_QUIET_S = 0.5  # vllm-mooncake-store gives no durability signal: wait for the store to go quiet
SETTLE_S = 1.0  # LMCache gives none and has no master to ask: its saves get this long to land
KEY_COUNT_POLL_S = 0.1


class Durability:
    """Waits, before a request that reuses earlier ones, until their saves are in the store: the
    producer's prompt saves, and (chat) the consumer's answer saves."""

    def __init__(self, pair: ReadyFile, timeout_s: float) -> None:
        self._pair = pair
        self._timeout_s = timeout_s
        self._pending_keys: list[str] = []
        self._pending_unsignalled = False

    def published(self, response: dict[str, Any]) -> int | None:
        """Note a producer response; returns the number of objects it saves when the connector says."""
        details = HitDetails.from_response(response)
        self._expect(details.save_last_key if details else None, signalled=details is not None, details=details)
        return details.save_objects if details else None

    def answered(self, record: HitDetails | None) -> None:
        """Note a consumer request a later request reuses: its answer save, by the kvtool connector's
        ``answer_last_key`` (none: it saved no answer), else by the fallback when the consumer saves
        at all (roles both; a kv_consumer never does)."""
        last_key = record.answer_last_key if record else None
        self._expect(last_key, signalled=record is not None, saves=self._pair.roles == "both", details=record)

    def _expect(
        self, last_key: str | None, signalled: bool, saves: bool = True, details: HitDetails | None = None
    ) -> None:
        """A save to wait for: its last key (on every TP rank) when the connector gives one, else the
        key-count fallback."""
        if last_key:
            self._pending_keys += details.on_every_rank(last_key) if details is not None else [last_key]
        elif not signalled and saves and profile(self._pair.connector).durability in ("key_count", "settle"):
            self._pending_unsignalled = True

    def wait(self) -> tuple[float, bool] | None:
        """Block until pending saves are durable: (milliseconds waited, timed out), None when nothing was pending."""
        if not self._pending_keys and not self._pending_unsignalled:
            return None
        began = time.perf_counter()
        timed_out = False
        if self._pending_unsignalled and profile(self._pair.connector).durability == "settle":
            time.sleep(SETTLE_S)
            self._pending_unsignalled = False
            return (time.perf_counter() - began) * 1000.0, False
        assert self._pair.admin is not None
        for key in self._pending_keys:
            # Puts run in order, so the last key of a save covers the save.
            if not wait_for_key(open_admin(self._pair.admin), key, self._timeout_s):
                timed_out = True
        if self._pending_unsignalled:
            timed_out = not self._wait_key_count_quiet()
        self._pending_keys.clear()
        self._pending_unsignalled = False
        return (time.perf_counter() - began) * 1000.0, timed_out

    def _wait_key_count_quiet(self) -> bool:
        """Fallback without a signal: the master's key count has not changed for KEY_COUNT_QUIET_S."""
        assert self._pair.admin is not None
        admin = open_admin(self._pair.admin)
        return wait_for_quiet_key_count(admin, self._timeout_s, KEY_COUNT_QUIET_S, poll_s=KEY_COUNT_POLL_S)[1]
