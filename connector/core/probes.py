"""Which candidate ends a lookup asks the store about, block by block. Pure logic.

A prefix may end at any token: inside a block, a stored prompt's tail (on the hash-unit grid) or a
pointer (on the divergence grid) may hold it, so a block has up to ``block_size - 1`` candidate ends
(255 at block 256 and hash unit 1), each a key hashed in Python and asked of the master. Most are
never needed: a save puts a pointer at every grid point strictly inside each object (and, with lead
pointers, at its block's first token), keyed by the prefix the object holds. So for any stored object
that shares a prompt's prefix past the block's first pointer, that pointer's key is stored; and the
object ends before the next grid point after the last pointer found. A block's *sentinels* (its tails
up to its first pointer, every pointer) answer what it holds in a handful of keys, and the tails past
the last pointer found, up to the grid's next point, finish the search with the pointer round that
follows (``search._settle_pointers``): the same hit as every candidate (a property test holds them
side by side), from a quarter of the keys at block 256.

``search`` decides when to ask what; this module says what each choice asks.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from .groups import GroupKind
from .prefix import PromptKeys

# The first query asks for the first block's candidate ends too, for the batch's first prompts while
# their count (ends times cache groups) stays within this many (a few dozen keys, hashed and asked, cost
# less than a second round trip): at block 32 and hash unit 1, one group, 31 ends, so a batch of one or
# two new requests; never the 255 ends of block 256. In a larger batch a second query is likely anyway
# (any prompt leaving a stored one inside a later block needs it), and every prompt's first-block keys
# cost hashing and asking for nothing where its first block is stored (a hit or a longer miss).
FIRST_BLOCK_PROBE_MAX = 64
# A block with more candidate ends than this is asked by its sentinels (``block_sentinels``) where the
# lookup can read pointers: at hash unit 1, blocks of 128 tokens and more. Below it every candidate is
# asked: a few dozen keys cost less than the pointer round a sentinel hit may add.
SPARSE_BLOCK_MIN = 64


def first_block_probes(prompts: Sequence[PromptKeys]) -> list[bool]:
    """Which prompts' first query asks for their first block's candidates (``FIRST_BLOCK_PROBE_MAX``)."""
    budget, chosen = FIRST_BLOCK_PROBE_MAX, []
    for keys in prompts:
        if not budget:
            chosen.append(False)  # its candidates are not even listed: most of a batch's prompts
            continue
        cost = len(keys.inner_candidates(0)) * len(keys.groups)
        chosen.append(cost <= budget)
        budget -= cost if cost <= budget else 0
    return chosen


def first_block_sentinels(keys: PromptKeys) -> list[int] | None:
    """The few ends inside the prompt's first block whose keys tell whether anything stored there
    shares a prefix with it: its tail boundaries up to the block's first pointer, and that pointer.
    Every stored tail or block longer than that pointer's end has the pointer (a save puts one at each
    grid point strictly inside an object, and at its first token with lead pointers), keyed by the
    prefix it shares; so where none of these keys and no first block is stored, the prompt is a miss
    in one query, however many candidate ends its first block has (255 at block 256). None where no
    pointer stands inside the first block (no grid, a grid as wide as the block, only state groups):
    then only every candidate answers. A pointer lost (a failed put, evicted before its object) costs
    a hit, never a wrong one: what a lookup finds is still checked end to end."""
    if not keys.grid or all(group.kind is GroupKind.STATE for group in keys.groups):
        return None
    pointers = keys.pointer_ends(0, keys.block_size - 1)
    if not pointers:
        return None
    first_pointer = pointers[0]
    return [end for end in keys.inner_candidates(0) if end <= first_pointer]


def all_full(keys: PromptKeys) -> bool:
    """Every cache group keeps every block (no state, no window): a stored block serves its end."""
    return all(group.kind is GroupKind.FULL for group in keys.groups)


def sparse(keys: PromptKeys, block: int, can_read: bool) -> bool:
    """Whether ``block`` is asked by its sentinels rather than by every candidate end: a block of many
    candidates, on a model whose groups all keep every block (a state or a window needs objects the
    pointers of full attention do not stand for), with pointers inside it and a lookup that reads them."""
    if not can_read or not keys.grid or not all_full(keys):
        return False
    candidates = keys.inner_candidates(block)
    return len(candidates) > SPARSE_BLOCK_MIN and bool(_pointers(keys, block))


def block_sentinels(keys: PromptKeys, block: int) -> list[int]:
    """The ends asked inside a sparse ``block``: its tails up to its first pointer, every pointer (a
    grid point's tail with it), and the prompt's own end where it lies in the block (a repeated prompt
    is then a hit without a pointer round)."""
    candidates, pointers = keys.inner_candidates(block), _pointers(keys, block)
    ends = set(candidates[: bisect_right(candidates, pointers[0])]) | set(pointers)
    if len(keys.tokens) in candidates:
        ends.add(len(keys.tokens))
    return sorted(ends)


def past_pointer_ends(keys: PromptKeys, block: int, found: frozenset[str], asked: Sequence[int]) -> list[int]:
    """The tail ends of a sparse ``block`` not asked yet where a stored object sharing the prompt may end:
    past the last pointer found in every group, up to the grid's next point after the last found in
    any. An object sharing the prompt further ends there (it would have the next pointer otherwise);
    the pointer read may reach it, or stop short where the object the pointer names leaves the prompt
    (a later prompt took the pointer over). None where a group found no pointer: nothing there goes
    past the tails asked up to the first one."""
    pointers = _pointers(keys, block)
    last_found = []
    for group in keys.groups:
        held = [end for end in pointers if keys.pointer_ref(end, group.index).key in found]
        if not held:
            return []
        last_found.append(held[-1])
    low, high = min(last_found), max(last_found)
    after = [end for end in pointers if end > high]
    upto = after[0] if after else (block + 1) * keys.block_size - 1
    candidates, asked_set = keys.inner_candidates(block), set(asked)
    start, stop = bisect_right(candidates, low), bisect_right(candidates, upto)
    return [end for end in candidates[start:stop] if end not in asked_set]


def _pointers(keys: PromptKeys, block: int) -> list[int]:
    return keys.pointer_ends(block, min(len(keys.tokens), (block + 1) * keys.block_size - 1))
