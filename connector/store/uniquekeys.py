"""No key twice in one batch: every batched store call asks each key once and hands its answer to
every position that named it.

Mooncake 0.3.13.post1 answers a batch that names a key twice wrong: ``get_batch(["a", "a"])`` and
``batch_get_into(["a", "a", "b"], ...)`` report success at full length for every slot, yet one slot of
the repeated key holds other bytes (see ENVIRONMENT.md; fixed upstream after that release). A batch
gathered across requests repeats keys: two prompts of one scheduler step that share a pointer read
it, and check the object it names, twice. The object checks turn the bad slot into a miss, a hit lost.
``UniqueKeysStore`` wraps any ``KVStore`` so that no batch below it names a key twice; a batch with no
repeat goes through as it came.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from .backend import KVStore, PutOutcome

if TYPE_CHECKING:
    from .staging import Lease, Region

T = TypeVar("T")

logger = logging.getLogger("vllm.kvtool")

# The count a repeated key's region gets when it is too small for the object read into the first
# region that named the key (Mooncake's invalid-parameters code: what a too-small buffer gets there).
TOO_SMALL = -600


def first_of(pairs: Iterable[tuple[str, T]]) -> dict[str, T]:
    """Each key's first value, keys in the order they first appear (pure)."""
    first: dict[str, T] = {}
    for key, value in pairs:
        first.setdefault(key, value)
    return first


def _repeats(keys: Sequence[str]) -> bool:
    return len(set(keys)) != len(keys)


class UniqueKeysStore:
    """A ``KVStore`` whose batched calls reach the wrapped store with each key once (module docstring)."""

    def __init__(self, store: KVStore):
        self._store = store

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not _repeats(keys):
            return self._store.exists(keys)
        unique = list(dict.fromkeys(keys))
        answers = dict(zip(unique, self._store.exists(unique), strict=True))
        return [answers[key] for key in keys]

    def get(self, keys: Sequence[str], object_bytes: int = 0) -> list[bytes | None]:
        if not _repeats(keys):
            return self._store.get(keys, object_bytes)
        unique = list(dict.fromkeys(keys))
        values = dict(zip(unique, self._store.get(unique, object_bytes), strict=True))
        return [values[key] for key in keys]  # the same bytes object for every repeat

    def put(self, key: str, value: bytes) -> PutOutcome:
        return self._store.put(key, value)

    def put_many(self, items: Sequence[tuple[str, bytes]], replace: bool = False) -> PutOutcome:
        """One item per key, the first (as a put of a stored key keeps the stored value)."""
        if not _repeats([key for key, _ in items]):
            return self._store.put_many(items, replace)
        first = first_of(items)
        for key in {key for key, value in items if value != first[key]}:
            logger.debug("kvtool: a batch put named %s twice with different values; the first is put", key)
        return self._store.put_many(list(first.items()), replace)

    def register(self, address: int, nbytes: int) -> None:
        self._store.register(address, nbytes)

    def get_into(self, keys: Sequence[str], regions: Sequence[Region], lease: Lease) -> list[int]:
        """Each key read once, into the first region that names it; a successful read is copied into
        every other region of that key, and a failed or empty one (a count of 0 or less) is every such
        region's answer too."""
        if not _repeats(keys):
            return self._store.get_into(keys, regions, lease)
        first = first_of(zip(keys, regions, strict=True))
        counts = dict(zip(first, self._store.get_into(list(first), list(first.values()), lease), strict=True))
        return [_shared(counts[key], first[key], region) for key, region in zip(keys, regions, strict=True)]

    def put_from(self, items: Sequence[tuple[str, Region]], lease: Lease) -> list[PutOutcome]:
        """Each key put once, from the first region that names it (as a put of a stored key keeps the
        stored value); its outcome is every repeat's."""
        if not _repeats([key for key, _ in items]):
            return self._store.put_from(items, lease)
        first = first_of(items)
        outcomes = dict(zip(first, self._store.put_from(list(first.items()), lease), strict=True))
        return [outcomes[key] for key, _ in items]

    def remove(self, key: str) -> int:
        return self._store.remove(key)

    def close(self) -> None:
        self._store.close()


def _shared(count: int, source: Region, region: Region) -> int:
    """A repeat's answer: ``count`` bytes read into ``source`` copied into ``region`` (the region the
    key was read into answers as read; a failed or empty read is every repeat's answer)."""
    if region is source or count <= 0:
        return count
    if count > len(region.view):
        return TOO_SMALL
    region.view[:count] = source.view[:count]
    return count
