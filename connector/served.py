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

from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .groups import CacheGroup, GroupKind

if TYPE_CHECKING:  # prefix.py uses this module; these names are only annotations here
    from .prefix import ObjectRef, PromptKeys


class ServedIndex:
    """``keys.serves(hit, present)`` for any ``hit``, built lazily from one pass over the prompt."""

    def __init__(self, keys: PromptKeys, present: frozenset[str]):
        self._keys = keys
        self._present = present
        self._counts: dict[int, list[int]] = {}  # group -> stored full blocks among the first i
        self._inner: dict[tuple[int, int], tuple[list[int], list[ObjectRef | None]]] = {}

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
        if last < keys.num_full_blocks and counts[last + 1] > counts[last]:
            return True  # that block is stored whole (no ref built: this runs for every candidate end)
        return self.last_object(group, hit) is not None

    def last_object(self, group: CacheGroup, hit: int) -> ObjectRef | None:
        """What ``PromptKeys._last_object`` returns: the full block holding token ``hit - 1``, else the
        first stored tail or pointer at or after ``hit`` inside that block."""
        keys = self._keys
        index = (hit - 1) // keys.block_size
        if index < keys.num_full_blocks:
            counts = self._block_counts(group.index)
            if counts[index + 1] > counts[index]:
                return keys.block_ref(index, group.index)
        if hit % keys.block_size == 0:
            return None  # every candidate end inside the block lies before its end
        ends, first_stored = self._inner_index(group.index, index)
        position = bisect_left(ends, hit)
        return first_stored[position] if position < len(ends) else None

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
            counts = [0]
            for index in range(self._keys.num_full_blocks):
                counts.append(counts[-1] + (self._keys.block_key(index, group) in self._present))
            self._counts[group] = counts
        return counts

    def _inner_index(self, group: int, block: int) -> tuple[list[int], list[ObjectRef | None]]:
        """The candidate ends inside ``block`` and, for each, the first stored object at or after it."""
        found = self._inner.get((group, block))
        if found is None:
            ends = self._keys.inner_candidates(block)
            first_stored: list[ObjectRef | None] = [None] * (len(ends) + 1)
            for position in range(len(ends) - 1, -1, -1):
                stored = next((ref for ref in self._keys._inner_refs(ends[position], group)
                               if ref.key in self._present), None)  # fmt: skip
                first_stored[position] = stored if stored is not None else first_stored[position + 1]
            found = self._inner[(group, block)] = (ends, first_stored[: len(ends)])
        return found
