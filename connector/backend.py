"""The store interface every backend implements (Mooncake in connector/mooncake.py) and every
extra wraps (time-outs, the circuit breaker, fault injection). No imports of its own: backends and
wrappers depend on it, never the other way."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Protocol


class PutOutcome(str, Enum):
    STORED = "stored"
    NO_SPACE = "no_space"
    FAILED = "failed"


class KVStore(Protocol):
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get(self, keys: Sequence[str], object_bytes: int = 0) -> list[bytes | None]:
        """Objects for ``keys``; None where the key is missing or its transfer failed.

        ``object_bytes`` (the expected size of each) lets the store split a large batch."""
        ...

    def put(self, key: str, value: bytes) -> PutOutcome: ...

    def put_many(self, items: Sequence[tuple[str, bytes]], replace: bool = False) -> PutOutcome:
        """Put several small objects in one call; one outcome for all (STORED: every one is stored).
        ``replace``: a key already stored takes the new value (else the first put wins)."""
        ...

    def remove(self, key: str) -> int: ...

    def close(self) -> None: ...
