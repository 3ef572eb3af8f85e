"""Which prefix lengths a prompt's stored objects serve, in constant time per length. Pure logic.

``PromptKeys.serves(hit, present)`` answers for one length by walking every block the hit needs and
every candidate end inside its last block: asked for each of a lookup's candidate ends, that is
quadratic in the prompt's blocks and in a block's candidates (at block 256 with hash unit 1, 56 ms of
Python for a 1k-token miss, 0.8 s for 32k tokens at block 32). ``ServedIndex`` answers the same
question for many lengths after one linear pass: per attention group, a running count of the stored
full blocks (a window of blocks is stored when the counts at its ends differ by its width) and, per
block that ends a hit, the first stored object at or after each candidate end inside it.

Its answers are exactly ``serves``'s (a property test holds them side by side).
"""

from __future__ import annotations

import weakref
from bisect import bisect_left
from collections.abc import Sequence
from typing import Protocol

from .groups import CacheGroup, GroupKind
from .keys import KeyKind
from .refs import ObjectRef


class PromptKeys(Protocol):
    """What the index reads of a prompt's keys (``connector.core.prefix.PromptKeys``, which builds and keeps
    one index per stored-key set: named here by what it offers, so neither module needs the other)."""

    tokens: tuple[int, ...]
    block_size: int
    groups: tuple[CacheGroup, ...]

    @property
    def num_full_blocks(self) -> int: ...

    def block_ref(self, index: int, group: int = 0) -> ObjectRef: ...

    def block_refs(self, group: int = 0) -> list[ObjectRef]: ...

    def state_ref(self, end: int, group: int) -> ObjectRef: ...

    def ref_of(self, key: str) -> ObjectRef | None: ...

    def inner_candidates(self, block_index: int) -> list[int]: ...

    def inner_refs(self, end: int, group: int) -> list[ObjectRef]: ...

    def serves(self, hit: int, present: frozenset[str]) -> bool: ...


class ServedIndex:
    """``keys.serves(hit, present)`` for any ``hit``, built lazily from one pass over the prompt."""

    def __init__(self, keys: PromptKeys, present: frozenset[str]):
        # A proxy: ``keys`` keeps this index (``PromptKeys.served``), and a reference back would make
        # every prompt's keys a cycle, freed only by the collector's full passes (pauses of tens of
        # milliseconds on the engine's process, and its memory held until then).
        self._keys = weakref.proxy(keys)
        self._present = present
        self._counts: dict[int, list[int]] = {}  # group -> stored full blocks among the first i
        self._inner: dict[tuple[int, int], tuple[list[int], list[ObjectRef | None]]] = {}
        # (group, block) -> the stored tails and pointers inside it, when every stored key is one this
        # prompt built (what a lookup asked): read off the stored keys instead of each candidate end.
        self._stored_inner = _stored_inner(keys, present)
        self._reach: dict[int, int] = {}  # block -> ``_reach_inside``

    def serves(self, hit: int) -> bool:
        keys = self._keys
        if hit <= 0 or hit > len(keys.tokens):
            return False
        return all(self._group_serves(group, hit) for group in keys.groups)

    def longest(self, ends: Sequence[int]) -> tuple[int, int]:
        """The longest served end, and the longest one short of the whole prompt (what a load may claim):
        the ends are tried from the longest down, and the search stops at the first served one short of
        the prompt."""
        keys = self._keys
        length = len(keys.tokens)
        # A full-attention group needs every block before the hit's last one: no end past the block
        # after its leading stored run can be served.
        full = [g.index for g in keys.groups if g.kind is GroupKind.FULL]
        reach = min(((self._leading_run(g) + 1) * keys.block_size for g in full), default=length)
        longest = 0
        for end in sorted({end for end in ends if end <= reach}, reverse=True):
            if end % keys.block_size and end > self._reach_inside((end - 1) // keys.block_size):
                continue  # an attention group holds nothing at or past it in its block
            if self.serves(end):
                longest = max(longest, end)
                if end < length:
                    return longest, end
        return longest, 0

    def _group_serves(self, group: CacheGroup, hit: int) -> bool:
        keys = self._keys
        if group.kind is GroupKind.STATE:
            return keys.state_ref(hit, group.index).key in self._present
        last = (hit - 1) // keys.block_size  # the block holding token hit - 1
        first = group.first_needed_block(hit)
        counts = self._block_counts(group.index)
        if first < last and counts[last] - counts[first] != last - first:
            return False
        if self._holds_block(group.index, last):
            return True  # that block is stored whole (no ref built: this runs for every candidate end)
        return self.last_object(group, hit) is not None

    def last_object(self, group: CacheGroup, hit: int) -> ObjectRef | None:
        """What ``PromptKeys._last_object`` returns: the full block holding token ``hit - 1``, else the
        first stored tail or pointer at or after ``hit`` inside that block."""
        keys = self._keys
        index = (hit - 1) // keys.block_size
        if self._holds_block(group.index, index):
            return keys.block_ref(index, group.index)
        if hit % keys.block_size == 0:
            return None  # every candidate end inside the block lies before its end
        ends, first_stored = self._inner_index(group.index, index)
        position = bisect_left(ends, hit)
        return first_stored[position] if position < len(ends) else None

    def _reach_inside(self, block: int) -> int:
        """A bound on the ends inside ``block`` that every attention group may serve: per group, the last
        stored tail or pointer there (the last candidate end, where the stored keys are not all known:
        ``_inner_index``), none where it holds the block whole. ``serves`` says which ends are served."""
        reach = self._reach.get(block)
        if reach is not None:
            return reach
        keys = self._keys
        reach = (block + 1) * keys.block_size
        for group in keys.groups:
            if group.kind is GroupKind.STATE or self._holds_block(group.index, block):
                continue
            ends, _ = self._inner_index(group.index, block)
            reach = min(reach, ends[-1] if ends else 0)
        self._reach[block] = reach
        return reach

    def _holds_block(self, group: int, block: int) -> bool:
        """Whether ``group`` holds full block ``block`` of the prompt."""
        counts = self._block_counts(group)
        return block < self._keys.num_full_blocks and counts[block + 1] > counts[block]

    def _leading_run(self, group: int) -> int:
        """How many leading full blocks ``group`` holds."""
        counts = self._block_counts(group)
        run = 0
        while run < len(counts) - 1 and counts[run + 1] > counts[run]:
            run += 1
        return run

    def _block_counts(self, group: int) -> list[int]:
        counts = self._counts.get(group)
        if counts is None:
            counts, present = [0], self._present
            for ref in self._keys.block_refs(group):
                counts.append(counts[-1] + (ref.key in present))
            self._counts[group] = counts
        return counts

    def _inner_index(self, group: int, block: int) -> tuple[list[int], list[ObjectRef | None]]:
        """Ends inside ``block`` and, for each, the first stored object at or after it: the stored ends
        only where the stored keys are known (``_stored_inner``), else every candidate end."""
        found = self._inner.get((group, block))
        if found is None and self._stored_inner is not None:
            stored = self._stored_inner.get((group, block), {})
            ends = sorted(stored)
            found = self._inner[(group, block)] = (ends, [stored[end] for end in ends])
        if found is None:
            ends = self._keys.inner_candidates(block)
            first_stored: list[ObjectRef | None] = [None] * (len(ends) + 1)
            for position in range(len(ends) - 1, -1, -1):
                stored = next(
                    (ref for ref in self._keys.inner_refs(ends[position], group) if ref.key in self._present), None
                )
                first_stored[position] = stored if stored is not None else first_stored[position + 1]
            found = self._inner[(group, block)] = (ends, first_stored[: len(ends)])
        return found


def _stored_inner(keys: PromptKeys, present: frozenset[str]) -> dict[tuple[int, int], dict[int, ObjectRef]] | None:
    """(group, block) -> end -> the stored tail (else pointer) ending there, read off ``present``; None
    when a stored key is not one ``keys`` has built (it may still be one of its candidates: the caller
    walks them)."""
    found: dict[tuple[int, int], dict[int, ObjectRef]] = {}
    for key in present:
        ref = keys.ref_of(key)
        if ref is None:
            return None
        if ref.kind is KeyKind.TAIL or ref.kind is KeyKind.POINTER:
            at = found.setdefault((ref.group, ref.block_index), {})
            if ref.kind is KeyKind.TAIL or ref.token_end not in at:  # a tail first, as ``inner_refs`` has it
                at[ref.token_end] = ref
    return found
