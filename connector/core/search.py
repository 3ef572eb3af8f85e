"""Finding the longest stored prefix of prompts, to the token. Pure logic.

The store is consulted through an ``exists`` callable (and a ``read`` callable for pointer records), so
the rules here are tested without one. ``connector.core.prefix`` says which keys a prompt has and what each
cache group needs for a hit; this module asks which are stored, settles the pointers a hit relies on,
and extends the hit through the token ids pointer records carry, to the exact point where the prompt
leaves a stored one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..calls import StoreError
from .groups import GroupKind
from .hashing import block_hashes, tail_hash
from .keys import KeyKind, decode_key, object_key
from .objects import ObjectRejected, PointerRecord, verify_pointer
from .prefix import PromptKeys, plan_save
from .refs import ObjectRef, StoredPrefix
from .probes import all_full, block_sentinels, first_block_probes, first_block_sentinels, past_pointer_ends, sparse

ExistsFn = Callable[[list[str]], list[bool]]
ReadFn = Callable[[list[str]], list["bytes | None"]]  # small objects (pointer records) by key
POINTER_ROUNDS = 2  # at most this many (read, exists) rounds settle a lookup's pointers


def _nothing_in_first_block(keys: PromptKeys, found: frozenset[str]) -> bool:
    """Whether the first query's answer shows nothing stored sharing the prompt's first block
    (``first_block_sentinels``), so that no second query is needed for it."""
    sentinels = first_block_sentinels(keys)
    if sentinels is None:
        return False
    return not any(ref.key in found for ref in keys.probe_refs(sentinels, blocks=False))


def find_stored_prefix(
    keys: PromptKeys, exists: ExistsFn, read: ReadFn | None = None, extend_min_tokens: int = 1
) -> StoredPrefix:
    """Longest stored prefix of one prompt (see ``find_stored_prefixes``)."""
    return find_stored_prefixes([keys], exists, read, extend_min_tokens)[0]


def _ask(exists: ExistsFn, refs_per_prompt: list[list[ObjectRef]]) -> list[frozenset[str]]:
    """One existence query for every prompt's refs; the keys found, per prompt."""
    query = list(dict.fromkeys(ref.key for refs in refs_per_prompt for ref in refs))  # each key once
    if not query:
        return [frozenset() for _ in refs_per_prompt]
    found = {key for key, present in zip(query, exists(query), strict=True) if present}
    return [frozenset(ref.key for ref in refs if ref.key in found) for refs in refs_per_prompt]


def _first_round_ends(keys: PromptKeys, first_block: bool, can_read: bool) -> tuple[list[int], set[int]]:
    """Candidate ends asked about first, and the blocks among them asked by their sentinels
    (``probes.sparse``): every block boundary, the ends inside the prompt's last block, and with
    ``first_block`` every candidate of its first block (``probes.first_block_probes``). Without it,
    where the first block has many candidates (255 at block 256 and hash unit 1), hashing and asking
    them for every prompt, block 0 stored or not, costs more than the round trip saved: its sentinels
    are asked instead, which answer a miss (the commonest lookup) in this query alone."""
    ends = {(i + 1) * keys.block_size for i in range(keys.num_full_blocks)}
    last = len(keys.tokens) // keys.block_size
    sparse_blocks = {block for block in {0, last} if sparse(keys, block, can_read)}
    ends.update(block_sentinels(keys, last) if last in sparse_blocks else keys.inner_candidates(last))
    if first_block:
        ends.update(keys.inner_candidates(0))
    elif 0 in sparse_blocks:
        ends.update(block_sentinels(keys, 0))  # its pointers too: no second query for it
    else:
        ends.update(first_block_sentinels(keys) or ())  # a handful: a miss ends with this query
    return sorted(ends), sparse_blocks


def _plain_hit(keys: PromptKeys, ends: Sequence[int], found: frozenset[str]) -> int:
    """The hit the first query's objects make without its pointers (which a pointer round may drop):
    the lookup's hit is no shorter."""
    plain = frozenset(key for key in found if (ref := keys.ref_of(key)) is None or ref.kind is not KeyKind.POINTER)
    return _longest(keys, ends, plain)[1]


def _chain_blocks(keys: PromptKeys, ends: Sequence[int], present: frozenset[str]) -> int:
    """How many leading blocks are stored: where a stored shorter prompt may end, inside the next one.

    Counted on the full-attention groups, which keep every block (a state group holds states at a
    few boundaries only, a sliding window only its window); without one, at the longest block
    boundary every group serves."""
    full = [group.index for group in keys.groups if group.kind is GroupKind.FULL]
    if not full:
        index = keys.served(present)
        aligned = [end for end in ends if end % keys.block_size == 0 and index.serves(end)]
        return max(aligned, default=0) // keys.block_size
    count = 0
    while count < keys.num_full_blocks and all(keys.block_key(count, group) in present for group in full):
        count += 1
    return count


def find_stored_prefixes(
    prompts: Sequence[PromptKeys], exists: ExistsFn, read: ReadFn | None = None, extend_min_tokens: int = 1
) -> list[StoredPrefix]:
    """Longest stored prefix of each prompt, to the token, in at most two queries and two pointer rounds.

    The first query asks, for every prompt and group, for every full-block key, the tail (or state)
    candidates of the prompt's last block and (where they are few) of its first one, and the state
    one token short of the prompt, which answers the common cases (a miss; a repeated prompt; every
    block stored; a stored sub-block prompt) in one round trip. Where the stored block boundaries
    stop later, at block k, a second query (one for all such prompts) asks for the candidates inside
    block k: that is where a stored shorter prompt (the previous chat turn) ends. With ``read``, the
    pointers a hit relies on or may extend it are read (``_settle_pointers``) and the hit goes on to
    the exact common prefix (``_extend``; from a block boundary, only by ``extend_min_tokens`` or
    more: the config's ``extend_min_tokens``).
    """
    can_read = read is not None
    probed = first_block_probes(prompts)
    first = [_first_round_ends(keys, whole, can_read) for keys, whole in zip(prompts, probed, strict=True)]
    first_ends = [ends for ends, _ in first]
    present = _ask(exists, [keys.probe_refs(ends, blocks=True) for keys, ends in zip(prompts, first_ends, strict=True)])

    inner_ends: list[list[int]] = []
    sparse_at: list[int | None] = []  # the block where the stored chain stops, where asked by its sentinels
    for keys, (ends, sparse_blocks), found, whole in zip(prompts, first, present, probed, strict=True):
        block = _chain_blocks(keys, ends, found)
        asked = block == len(keys.tokens) // keys.block_size or (
            block == 0 and (whole or 0 in sparse_blocks or _nothing_in_first_block(keys, found))
        )
        if not asked and sparse(keys, block, can_read):
            sparse_blocks = {block}
        inner = (
            [] if asked else block_sentinels(keys, block) if block in sparse_blocks else keys.inner_candidates(block)
        )
        if block and not whole and not all_full(keys) and _plain_hit(keys, ends, found) < keys.block_size:
            # Alone, its first query would have asked the first block's ends: where another group (a
            # state, a window) leaves no hit of a whole block or more, a hit may lie inside the first.
            inner = sorted({*inner, *keys.inner_candidates(0)})
        inner_ends.append(inner)
        sparse_at.append(block if block in sparse_blocks else None)
    second_refs = [keys.probe_refs(ends, blocks=False) for keys, ends in zip(prompts, inner_ends, strict=True)]
    more = _ask(exists, second_refs) if any(second_refs) else [frozenset() for _ in prompts]

    candidates = [
        sorted({*ends, *inner, len(keys.tokens), len(keys.tokens) - 1})
        for keys, ends, inner in zip(prompts, first_ends, inner_ends, strict=True)
    ]
    known = [found | found_inner for found, found_inner in zip(present, more, strict=True)]
    settled = [_Settled() for _ in prompts]
    calls = 0
    if read is not None:
        lookup = _Lookup(prompts, candidates, known, settled, sparse_at)
        calls = _settle_pointers(lookup, exists, read)
    results = []
    for keys, ends, found, pointers, inner in zip(prompts, candidates, known, settled, inner_ends, strict=True):
        tokens, hit = _longest(keys, ends, found)
        extended: dict[int, ObjectRef] = {}
        if read is not None and not pointers.unread:
            tokens, hit, extended = _extend(keys, (tokens, hit), found, pointers, extend_min_tokens)
        queries = (2 if inner else 1) + calls
        results.append(
            StoredPrefix(keys.block_size, tokens, hit, found, queries, pointers.targets, pointers.unread, extended)
        )
    return results


def find_saved_objects(
    prompts: Sequence[PromptKeys], exists: ExistsFn, read: ReadFn | None = None, extend_min_tokens: int = 1
) -> list[StoredPrefix]:
    """Which of each prompt's own objects (``plan_save``) are stored, in one existence query: what a
    producer asks, which saves its prompts and never loads (its save skips the objects found). No
    prefix is searched: ``tokens`` and ``hit_tokens`` are 0. (The signature is
    ``find_stored_prefixes``'s, so a lookup batcher runs either.)"""
    del read, extend_min_tokens  # no hit: no pointer is read, nothing is extended
    found = _ask(exists, [plan_save(keys) for keys in prompts])
    return [StoredPrefix(keys.block_size, 0, 0, present) for keys, present in zip(prompts, found, strict=True)]


def _longest(keys: PromptKeys, ends: Sequence[int], known: frozenset[str]) -> tuple[int, int]:
    """The longest stored prefix, and the longest one a load can claim (one token short of the prompt)."""
    return keys.served(known).longest(ends) if known else (0, 0)


@dataclass
class _Settled:
    """One prompt's pointers read so far."""

    targets: dict[str, ObjectRef] = field(default_factory=dict)  # pointer key -> the stored object it names
    reach: dict[str, int] = field(default_factory=dict)  # pointer key -> where its token ids leave the prompt
    unread: bool = False  # a read failed: the store, not the record


def _wanted(keys: PromptKeys, hit: int, known: frozenset[str], settled: _Settled) -> list[ObjectRef]:
    """The pointers not read yet that a hit of ``hit`` tokens relies on (their token ids may extend it)."""
    wanted: dict[str, ObjectRef] = {}
    for group in keys.groups if hit else ():
        for ref in keys.objects_for(group, hit, known) or ():
            if ref.kind is KeyKind.POINTER and ref.key not in settled.targets:
                wanted[ref.key] = ref
    return list(wanted.values())


@dataclass
class _Lookup:
    """A batch's lookup state between its queries: per prompt, the ends it asked about, the keys found
    stored, its pointers read, and the block where its stored chain stops where that block was asked
    by its sentinels (``probes.block_sentinels``; its tails past the last pointer found are asked
    with the first pointer round)."""

    prompts: Sequence[PromptKeys]
    candidates: list[list[int]]
    known: list[frozenset[str]]
    settled: list[_Settled]
    sparse_at: list[int | None]

    def past_pointer_ends(self) -> list[list[int]]:
        """Each prompt's tail ends past the last pointer found in its sparse block (``past_pointer_ends``)
        and past what is found already (a repeated prompt: its own tail); no key is made yet."""
        pending = []
        for index, (keys, block) in enumerate(zip(self.prompts, self.sparse_at, strict=True)):
            ends = [] if block is None else past_pointer_ends(keys, block, self.known[index], self.candidates[index])
            if ends:
                reached = _longest(keys, self.candidates[index], self.known[index])[0]
                ends = [end for end in ends if end > reached]
            pending.append(ends)
        return pending

    def past_pointers(self, pending: list[list[int]], beyond: Sequence[int]) -> list[list[ObjectRef]]:
        """The refs of each prompt's ``pending`` ends past ``beyond`` (how far the pointers just read go
        along it: a tail short of that adds nothing), added to its candidates."""
        refs = []
        for index, (keys, ends) in enumerate(zip(self.prompts, pending, strict=True)):
            ends = [end for end in ends if end > beyond[index]]
            if ends:
                self.candidates[index] = sorted({*self.candidates[index], *ends})
            refs.append(keys.probe_refs(ends, blocks=False))
        return refs

    def pointer_reach(self, asked: list[tuple[int, ObjectRef]], named: list[tuple[ObjectRef, int] | None]) -> list[int]:
        """How far the pointers just read go along each prompt inside its sparse block, in every group
        (0 where a group read none there): a tail of that block ending short of it adds nothing."""
        reach: list[dict[int, int]] = [{} for _ in self.prompts]
        for (index, ref), found in zip(asked, named, strict=True):
            if found is not None and ref.block_index == self.sparse_at[index]:
                reach[index][ref.group] = max(reach[index].get(ref.group, 0), found[1])
        return [
            min((groups.get(group.index, 0) for group in keys.groups), default=0)
            for keys, groups in zip(self.prompts, reach, strict=True)
        ]

    def add_found(self, refs: list[list[ObjectRef]], found: set[str]) -> None:
        for index, asked in enumerate(refs):
            self.known[index] = self.known[index] | {ref.key for ref in asked if ref.key in found}


def _settle_pointers(lookup: _Lookup, exists: ExistsFn, read: ReadFn) -> int:
    """Read the pointers each prompt's hit relies on or may be extended by, and check that the objects
    they name are stored; a pointer that is unreadable, bad, or names a missing object (evicted:
    pointers are small and may outlive it) is dropped, and the hit falls back to what else is stored.
    The first round's existence query asks the tails past the pointers found in sparse blocks too.
    Returns the store calls made. Updates ``lookup.known`` (drops bad pointers, adds the tails found),
    ``lookup.candidates`` and ``lookup.settled`` in place."""
    prompts, known, settled = lookup.prompts, lookup.known, lookup.settled
    pending = lookup.past_pointer_ends()
    calls = 0
    for round_ in range(POINTER_ROUNDS):
        asked: list[tuple[int, ObjectRef]] = []
        for index, (keys, ends) in enumerate(zip(prompts, lookup.candidates, strict=True)):
            hit = _longest(keys, ends, known[index])[1]
            asked += [(index, ref) for ref in _wanted(keys, hit, known[index], settled[index])]
        if not asked and not any(pending):
            return calls  # every pointer a hit relies on is settled
        try:
            calls += bool(asked)
            records = read([ref.key for _, ref in asked]) if asked else []
            named = [
                _named(prompts[index], ref, record) if record else None
                for (index, ref), record in zip(asked, records, strict=True)
            ]
            # After the first round, what is pending was left out for a pointer since dropped: all asked.
            beyond = lookup.pointer_reach(asked, named) if not round_ else [0] * len(prompts)
            extra = lookup.past_pointers(pending, beyond)
            extra_keys = list(dict.fromkeys(ref.key for refs in extra for ref in refs))
            targets = [found[0].key for found in named if found is not None]
            calls += bool(targets or extra_keys)
            answers = exists(targets + extra_keys) if targets or extra_keys else []
        except StoreError:
            for index, _ in asked:
                settled[index].unread = True
            break  # a pointer read or check failed: no hit relies on a pointer not settled (below)
        lookup.add_found(extra, {key for key, there in zip(extra_keys, answers[len(targets) :], strict=True) if there})
        stored, dropped = iter(answers[: len(targets)]), set()
        for (index, ref), found in zip(asked, named, strict=True):
            if found is not None and next(stored):
                settled[index].targets[ref.key], settled[index].reach[ref.key] = found
            else:
                known[index], dropped = known[index] - {ref.key}, dropped | {index}
        # The tails left out for a reach that a dropped pointer (its object evicted) may have claimed.
        pending = [[e for e in ends if e <= beyond[i]] if i in dropped else [] for i, ends in enumerate(pending)]
    # Unsettled after the last round, or a failed read: no hit relies on a pointer not settled.
    for index in range(len(prompts)):
        known[index] = frozenset(key for key in known[index] if key in settled[index].targets or not _is_pointer(key))
    return calls


def _extend(
    keys: PromptKeys, found: tuple[int, int], known: frozenset[str], settled: _Settled, min_tokens: int
) -> tuple[int, int, dict[int, ObjectRef]]:
    """The hit extended to the exact common prefix with stored objects, for a hit that relies on a
    pointer: per attention group, how far the object holding the hit's last token goes along the prompt
    (the prompt's own tail or block there; what a pointer names, as far as its token ids match the
    prompt's); the hit is where the group that reaches least stops. A hit through a lead pointer (a
    block's first token: a block more to load) must reach ``min_tokens`` past the block's start, else
    it falls back to that start. Returns (tokens, hit, group -> object); ``found``: the longest stored
    prefix and hit, ``_longest``'s."""
    tokens, hit = found
    length = len(keys.tokens)
    if tokens == length or keys.has_state_group or not keys.grid or not hit % keys.block_size:
        return tokens, hit, {}
    reached: dict[int, tuple[int, ObjectRef]] = {}
    lead = False
    for group in keys.groups:
        last = (keys.objects_for(group, hit, known) or [None])[-1]
        if last is None:
            return tokens, hit, {}
        if last.kind is KeyKind.POINTER:
            lead = lead or keys.is_lead(last.token_end)
            reached[group.index] = (settled.reach[last.key], settled.targets[last.key])
        else:
            reached[group.index] = (last.token_end, last)
    end = min(reach for reach, _ in reached.values())
    if lead and min(end, length - 1) - (hit - hit % keys.block_size) < min_tokens:
        # Back to the longest block boundary every group serves (a sliding window may need a block more
        # there than one token later).
        served, start = keys.served(known), hit - hit % keys.block_size
        while start and not served.serves(start):
            start -= keys.block_size
        return start, start, {}
    if min(end, length - 1) <= hit:
        return tokens, hit, {}
    return end, min(end, length - 1), {group: target for group, (_, target) in reached.items()}


def _is_pointer(key: str) -> bool:
    decoded = decode_key(key)
    return decoded is not None and decoded.kind is KeyKind.POINTER


def _named(keys: PromptKeys, pointer: ObjectRef, record: bytes) -> tuple[ObjectRef, int] | None:
    """The object a stored pointer record names and how far its token ids go along the prompt; None when
    the record is not this pointer's, or its token ids are not the ones the object's key was hashed from
    (the prompt's tokens of that block up to the pointer, then the ids, chained from the block's parent)."""
    named = _verified(keys, pointer, record)
    if named is None:
        return None
    start, ids = pointer.token_end, named.token_ids
    block_start = pointer.block_index * keys.block_size
    held = keys.tokens[block_start:start] + ids  # the object's tokens, as the record says
    parent = keys.parent_of_block(pointer.block_index)
    if named.target_kind is KeyKind.BLOCK:
        digest = block_hashes(held, keys.block_size, parent)[0]
    else:
        digest = tail_hash(held, len(held), keys.block_size, parent)
    if digest != named.target_hash:
        return None
    common = 0
    while common < len(ids) and start + common < len(keys.tokens) and ids[common] == keys.tokens[start + common]:
        common += 1
    key = object_key(keys.namespace, pointer.group, named.target_kind, named.target_end, named.target_hash)
    target = ObjectRef(
        key,
        pointer.group,
        named.target_kind,
        pointer.block_index,
        pointer.token_start,
        named.target_end,
        named.target_hash,
    )
    return target, start + common


def _verified(keys: PromptKeys, pointer: ObjectRef, record: bytes) -> PointerRecord | None:
    try:
        return verify_pointer(
            record, keys.namespace, pointer.chain_hash, pointer.group, pointer.token_end, keys.block_size
        )
    except ObjectRejected:
        return None
