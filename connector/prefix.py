"""Finding the longest stored prefix of a prompt, and turning it into a load plan. Pure logic.

The store is consulted through an ``exists`` callable, so the rules here are tested without one.
A model has one or more KV cache groups (``connector.groups``); a prefix is stored when every group
holds what it needs for it, and a load reads each group's objects into that group's blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .groups import CacheGroup, GroupKind
from .hashing import block_hashes, check_token_ids, save_tail_boundary, tail_boundaries, tail_hash
from .keys import KeyKind, decode_key, object_key
from .calls import StoreError
from .objects import ObjectRejected, verify_pointer
from .served import ServedIndex

ExistsFn = Callable[[list[str]], list[bool]]
ReadFn = Callable[[list[str]], list["bytes | None"]]  # small objects (pointer records) by key
POINTER_ROUNDS = 2  # at most this many (read, exists) rounds settle a lookup's pointers


def single_group(block_size: int) -> tuple[CacheGroup, ...]:
    """The layout of a plain model: one full-attention group."""
    return (CacheGroup(0, GroupKind.FULL, block_size),)


@dataclass(frozen=True)
class ObjectRef:
    """One stored object of one group, and the request block (index within the group) it fills."""

    key: str
    group: int
    kind: KeyKind
    block_index: int
    token_start: int
    token_end: int  # end of the object's valid tokens (block end, tail boundary, or the state's position)
    chain_hash: bytes


@dataclass(frozen=True)
class PromptKeys:
    """The keys of one prompt, for every cache group: blocks, tails and states, computed on demand."""

    tokens: tuple[int, ...]
    block_size: int
    hash_unit: int
    namespace: str
    root: bytes
    block_chain: tuple[bytes, ...]
    groups: tuple[CacheGroup, ...]
    # Divergence grid: stored block and tail objects are pointed to at its multiples inside them, so a
    # prompt that leaves a stored one there finds the common prefix (0: no pointers).
    grid: int = 0
    # Tail hashes already computed: a lookup asks for the same ones in every group and candidate.
    _tails: dict[int, bytes] = field(default_factory=dict, compare=False, repr=False)
    # Inner candidate ends per block, likewise asked for again and again.
    _inner: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(
        cls,
        tokens: Sequence[int],
        block_size: int,
        hash_unit: int,
        namespace: str,
        root: bytes,
        groups: tuple[CacheGroup, ...] | None = None,
        grid: int = 0,
    ) -> PromptKeys:
        groups = groups or single_group(block_size)
        if any(group.block_size != block_size for group in groups):
            raise ValueError("every cache group must use the prompt's block size")
        tokens = tuple(tokens)
        check_token_ids(tokens)
        chain = tuple(block_hashes(tokens, block_size, root))
        return cls(tokens, block_size, hash_unit, namespace, root, chain, groups, grid)

    @property
    def num_full_blocks(self) -> int:
        return len(self.block_chain)

    def parent_of_block(self, index: int) -> bytes:
        return self.root if index == 0 else self.block_chain[index - 1]

    def chain_hash(self, end: int) -> bytes:
        """The chain value after ``end`` tokens: a block's when ``end`` is block-aligned, else a tail's."""
        if end % self.block_size == 0:
            return self.block_chain[end // self.block_size - 1]
        return self.tail_hash(end)

    def tail_hash(self, boundary: int) -> bytes:
        digest = self._tails.get(boundary)
        if digest is None:
            parent = self.parent_of_block(boundary // self.block_size)
            digest = self._tails[boundary] = tail_hash(self.tokens, boundary, self.block_size, parent)
        return digest

    def block_ref(self, index: int, group: int = 0) -> ObjectRef:
        start, end = index * self.block_size, (index + 1) * self.block_size
        digest = self.block_chain[index]
        return ObjectRef(object_key(self.namespace, group, KeyKind.BLOCK, end, digest), group, KeyKind.BLOCK, index,
                         start, end, digest)  # fmt: skip

    def tail_ref(self, boundary: int, group: int = 0) -> ObjectRef:
        index = boundary // self.block_size
        digest = self.tail_hash(boundary)
        return ObjectRef(object_key(self.namespace, group, KeyKind.TAIL, boundary, digest), group, KeyKind.TAIL, index,
                         index * self.block_size, boundary, digest)  # fmt: skip

    def pointer_ref(self, boundary: int, group: int = 0) -> ObjectRef:
        """The pointer at ``boundary`` (inside a block): it has a tail's hash, and names a stored object
        of ``group`` that holds this prefix's KV and more."""
        index = boundary // self.block_size
        digest = self.tail_hash(boundary)
        return ObjectRef(object_key(self.namespace, group, KeyKind.POINTER, boundary, digest), group,
                         KeyKind.POINTER, index, index * self.block_size, boundary, digest)  # fmt: skip

    def pointers_inside(self, ref: ObjectRef) -> list[ObjectRef]:
        """The pointers a save writes for one of its block or tail objects: at every grid multiple
        strictly inside the tokens it holds."""
        if not self.grid or ref.kind not in (KeyKind.BLOCK, KeyKind.TAIL):
            return []
        inside = tail_boundaries(ref.block_index, self.block_size, self.grid, ref.token_end - 1)
        return [self.pointer_ref(boundary, ref.group) for boundary in inside]

    def state_ref(self, end: int, group: int) -> ObjectRef:
        """The state after ``end`` tokens: it lives in the block holding token ``end - 1``."""
        digest = self.chain_hash(end)
        return ObjectRef(object_key(self.namespace, group, KeyKind.STATE, end, digest), group, KeyKind.STATE,
                         (end - 1) // self.block_size, 0, end, digest)  # fmt: skip

    def block_key(self, index: int, group: int = 0) -> str:
        return self.block_ref(index, group).key

    def tail_key(self, boundary: int, group: int = 0) -> str:
        return self.tail_ref(boundary, group).key

    def tail_candidates(self, block_index: int) -> list[int]:
        return tail_boundaries(block_index, self.block_size, self.hash_unit, len(self.tokens))

    def inner_candidates(self, block_index: int) -> list[int]:
        """Where a stored prefix may end inside block ``block_index``: a tail (on the hash-unit grid)
        or a pointer (on the divergence grid)."""
        ends = self._inner.get(block_index)
        if ends is None:
            found = set(self.tail_candidates(block_index))
            if self.grid:
                found.update(tail_boundaries(block_index, self.block_size, self.grid, len(self.tokens)))
            ends = self._inner[block_index] = sorted(found)
        return ends

    def _inner_refs(self, end: int, group: int) -> list[ObjectRef]:
        """What may hold a prefix ending at ``end`` inside a block: its tail, its pointer."""
        refs = [self.tail_ref(end, group)] if end % self.hash_unit == 0 else []
        if self.grid and end % self.grid == 0:
            refs.append(self.pointer_ref(end, group))
        return refs

    # -- what a group needs ---------------------------------------------------------------------------

    def probe_refs(self, ends: Sequence[int], blocks: bool) -> list[ObjectRef]:
        """The objects a lookup asks about, in every group: the full blocks (when ``blocks``) and, at
        each candidate end, a tail (attention groups) or a state (state groups; also one token short
        of the prompt, the most a hit on the prompt itself can claim)."""
        refs: list[ObjectRef] = []
        for group in self.groups:
            if group.kind is GroupKind.STATE:
                states = set(ends) | ({len(self.tokens) - 1} if blocks and len(self.tokens) > 1 else set())
                refs += [self.state_ref(end, group.index) for end in sorted(states)]
                continue
            if blocks:
                refs += [self.block_ref(i, group.index) for i in range(self.num_full_blocks)]
            refs += [ref for end in ends if end % self.block_size for ref in self._inner_refs(end, group.index)]
        return refs

    def _last_object(self, group: CacheGroup, hit: int, present: frozenset[str]) -> ObjectRef | None:
        """A stored object that holds the KV of token ``hit - 1`` for an attention group: the full
        block, or the shortest stored tail of that block that reaches ``hit``, or the object a pointer
        that reaches ``hit`` names (another prompt's, sharing these tokens and going on)."""
        index = (hit - 1) // self.block_size
        if index < self.num_full_blocks:
            block = self.block_ref(index, group.index)
            if block.key in present:
                return block
        for boundary in self.inner_candidates(index):
            if boundary >= hit:
                for ref in self._inner_refs(boundary, group.index):
                    if ref.key in present:
                        return ref
        return None

    def objects_for(
        self, group: CacheGroup, hit: int, present: frozenset[str], from_block: int = 0
    ) -> list[ObjectRef] | None:
        """What ``group`` loads for a hit of ``hit`` tokens, blocks below ``from_block`` excluded
        (the engine's own cached ones); None when something it needs is not stored."""
        if group.kind is GroupKind.STATE:
            state = self.state_ref(hit, group.index)
            return [state] if state.key in present else None
        last = (hit - 1) // self.block_size
        refs = [self.block_ref(i, group.index) for i in range(max(from_block, group.first_needed_block(hit)), last)]
        if any(ref.key not in present for ref in refs):
            return None
        if last < from_block:
            return refs
        final = self._last_object(group, hit, present)
        return None if final is None else refs + [final]

    def serves(self, hit: int, present: frozenset[str]) -> bool:
        """Whether every group holds what a hit of ``hit`` tokens needs."""
        return hit > 0 and all(self.objects_for(group, hit, present) is not None for group in self.groups)


@dataclass(frozen=True)
class StoredPrefix:
    """The longest prefix of a prompt whose KV is in the store, for every group."""

    block_size: int
    tokens: int  # the longest stored prefix, the whole prompt included
    hit_tokens: int  # the longest stored prefix a load can claim: at least one prompt token is computed
    present: frozenset[str] = frozenset()  # every key the lookup found stored
    queries: int = 1  # round trips it took
    # Pointer key -> the object it names, read and found stored by the lookup: a load reads that object.
    targets: dict[str, ObjectRef] = field(default_factory=dict)
    # A pointer read failed (the store, not the record): hits that relied on it were dropped.
    pointer_read_failed: bool = False

    @property
    def full_blocks(self) -> int:
        return self.tokens // self.block_size

    @property
    def tail_boundary(self) -> int | None:
        return self.tokens if self.tokens % self.block_size else None

    @property
    def block_tokens(self) -> int:
        return self.full_blocks * self.block_size


def find_stored_prefix(keys: PromptKeys, exists: ExistsFn, read: ReadFn | None = None) -> StoredPrefix:
    """Longest stored prefix of one prompt (see ``find_stored_prefixes``)."""
    return find_stored_prefixes([keys], exists, read)[0]


def _ask(exists: ExistsFn, refs_per_prompt: list[list[ObjectRef]]) -> list[frozenset[str]]:
    """One existence query for every prompt's refs; the keys found, per prompt."""
    query = sorted({ref.key for refs in refs_per_prompt for ref in refs})
    if not query:
        return [frozenset() for _ in refs_per_prompt]
    found = {key for key, present in zip(query, exists(query), strict=True) if present}
    return [frozenset(ref.key for ref in refs if ref.key in found) for refs in refs_per_prompt]


def _first_round_ends(keys: PromptKeys) -> list[int]:
    """Candidate ends asked about first: every block boundary and the tail boundaries of the
    prompt's last block."""
    ends = {(i + 1) * keys.block_size for i in range(keys.num_full_blocks)}
    ends.update(keys.inner_candidates(len(keys.tokens) // keys.block_size))
    return sorted(ends)


def _chain_blocks(keys: PromptKeys, ends: Sequence[int], present: frozenset[str]) -> int:
    """How many leading blocks are stored: where a stored shorter prompt may end, inside the next one.

    Counted on the full-attention groups, which keep every block (a state group holds states at a
    few boundaries only, a sliding window only its window); without one, at the longest block
    boundary every group serves."""
    full = [group.index for group in keys.groups if group.kind is GroupKind.FULL]
    if not full:
        index = ServedIndex(keys, present)
        aligned = [end for end in ends if end % keys.block_size == 0 and index.serves(end)]
        return max(aligned, default=0) // keys.block_size
    count = 0
    while count < keys.num_full_blocks and all(keys.block_key(count, group) in present for group in full):
        count += 1
    return count


def find_stored_prefixes(
    prompts: Sequence[PromptKeys], exists: ExistsFn, read: ReadFn | None = None
) -> list[StoredPrefix]:
    """Longest stored prefix of each prompt, at hash-unit granularity, in at most two queries in all.

    The first query asks, for every prompt and group, for every full-block key, the tail (or state)
    candidates of the prompt's last block, and the state one token short of the prompt, which
    answers the common cases (a repeated prompt; every block stored) in one round trip. Where the
    stored block boundaries stop earlier, at block k, a second query (one for all such prompts) asks
    for the candidates inside block k: that is where a stored shorter prompt (a sub-block prompt,
    the previous chat turn) ends.
    """
    first_ends = [_first_round_ends(keys) for keys in prompts]
    present = _ask(exists, [keys.probe_refs(ends, blocks=True) for keys, ends in zip(prompts, first_ends, strict=True)])

    inner_ends: list[list[int]] = []
    for keys, ends, found in zip(prompts, first_ends, present, strict=True):
        length = len(keys.tokens)
        block = _chain_blocks(keys, ends, found)
        inner_ends.append([] if block == length // keys.block_size else keys.inner_candidates(block))
    second_refs = [keys.probe_refs(ends, blocks=False) for keys, ends in zip(prompts, inner_ends, strict=True)]
    asked_twice = any(second_refs)
    more = _ask(exists, second_refs) if asked_twice else [frozenset() for _ in prompts]

    candidates = [
        sorted({*ends, *inner, len(keys.tokens), len(keys.tokens) - 1})
        for keys, ends, inner in zip(prompts, first_ends, inner_ends, strict=True)
    ]
    known = [found | found_inner for found, found_inner in zip(present, more, strict=True)]
    targets: list[dict[str, ObjectRef]] = [{} for _ in prompts]
    unread: set[int] = set()
    rounds = _settle_pointers(prompts, candidates, known, targets, exists, read, unread) if read is not None else 0
    results = []
    for index, (keys, ends, found, pointed, inner) in enumerate(
        zip(prompts, candidates, known, targets, inner_ends, strict=True)
    ):
        tokens, hit = _longest(keys, ends, found)
        queries = (2 if inner else 1) + 2 * rounds
        results.append(StoredPrefix(keys.block_size, tokens, hit, found, queries, pointed, index in unread))
    return results


def _longest(keys: PromptKeys, ends: Sequence[int], known: frozenset[str]) -> tuple[int, int]:
    """The longest stored prefix, and the longest one a load can claim (one token short of the prompt)."""
    return ServedIndex(keys, known).longest(ends)


def _settle_pointers(
    prompts: Sequence[PromptKeys],
    candidates: list[list[int]],
    known: list[frozenset[str]],
    targets: list[dict[str, ObjectRef]],
    exists: ExistsFn,
    read: ReadFn,
    unread: set[int],
) -> int:
    """Read the pointers each prompt's hit relies on and check that the objects they name are stored;
    a pointer that is unreadable, bad, or names a missing object (evicted: pointers are small and may
    outlive it) is dropped, and the hit falls back to what else is stored. Returns the rounds taken.

    Updates ``known`` (drops bad pointers), ``targets`` (pointer key -> object) and ``unread`` (the
    prompts whose pointer read failed) in place."""
    for rounds in range(1, POINTER_ROUNDS + 1):
        asked: list[tuple[int, ObjectRef]] = []
        for index, (keys, ends) in enumerate(zip(prompts, candidates, strict=True)):
            hit = _longest(keys, ends, known[index])[1]
            for group in keys.groups if hit else ():
                for ref in keys.objects_for(group, hit, known[index]) or ():
                    if ref.kind is KeyKind.POINTER and ref.key not in targets[index]:
                        asked.append((index, ref))
        if not asked:
            return rounds - 1
        try:
            records = read([ref.key for _, ref in asked])
            named = [
                pointer_target(prompts[index], ref, record) if record else None
                for (index, ref), record in zip(asked, records, strict=True)
            ]
            stored = iter(exists([target.key for target in named if target is not None]))
        except StoreError:
            unread.update(index for index, _ in asked)
            break  # a pointer read or check failed: no hit relies on a pointer not settled (below)
        for (index, ref), target in zip(asked, named, strict=True):
            if target is not None and next(stored):
                targets[index][ref.key] = target
            else:
                known[index] = known[index] - {ref.key}
    # Unsettled after the last round, or a failed read: no hit relies on a pointer not settled.
    for index in range(len(prompts)):
        known[index] = frozenset(key for key in known[index] if key in targets[index] or not _is_pointer(key))
    return rounds


def _is_pointer(key: str) -> bool:
    decoded = decode_key(key)
    return decoded is not None and decoded.kind is KeyKind.POINTER


def pointer_target(keys: PromptKeys, pointer: ObjectRef, record: bytes) -> ObjectRef | None:
    """The object a stored pointer record names, or None when the record is not this pointer's."""
    try:
        named = verify_pointer(record, keys.namespace, pointer.chain_hash, pointer.group, pointer.token_end,
                               keys.block_size)  # fmt: skip
    except ObjectRejected:
        return None
    key = object_key(keys.namespace, pointer.group, named.target_kind, named.target_end, named.target_hash)
    return ObjectRef(key, pointer.group, named.target_kind, pointer.block_index, pointer.token_start,
                     named.target_end, named.target_hash)  # fmt: skip


@dataclass(frozen=True)
class LoadPlan:
    """What a consumer loads: tokens [local_tokens, local_tokens + external_tokens)."""

    local_tokens: int
    external_tokens: int
    block_tokens: int  # of external_tokens, those that come from full-block objects
    tail_tokens: int  # of external_tokens, those that come from a tail object
    objects: tuple[ObjectRef, ...]


def plan_load(keys: PromptKeys, stored: StoredPrefix, local_tokens: int) -> LoadPlan:
    """The hit vLLM can take: at most ``stored.hit_tokens``, and never below what vLLM holds.

    ``local_tokens`` is vLLM's own (block-aligned) prefix-cache hit; those tokens are never claimed.
    """
    hit = stored.hit_tokens
    if hit <= local_tokens:
        return LoadPlan(local_tokens, 0, 0, 0, ())
    from_block = local_tokens // keys.block_size
    objects: list[ObjectRef] = []
    for group in keys.groups:
        refs = keys.objects_for(group, hit, stored.present, from_block)
        if refs is None:  # the lookup found it stored; only a caller's own present set can miss it
            return LoadPlan(local_tokens, 0, 0, 0, ())
        objects += [stored.targets.get(ref.key, ref) for ref in refs]  # a pointer: the object it names
    objects.sort(key=lambda ref: (ref.block_index, ref.group))
    # Reported by the first attention group: tokens served by full blocks, and by the tail.
    attention = [ref for ref in objects if ref.kind is not KeyKind.STATE and ref.group == _primary(keys)]
    block_end = max((ref.token_end for ref in attention if ref.kind is KeyKind.BLOCK), default=local_tokens)
    block_tokens = max(0, min(hit, block_end) - local_tokens)
    external = hit - local_tokens
    return LoadPlan(local_tokens, external, block_tokens, external - block_tokens, tuple(objects))


def _primary(keys: PromptKeys) -> int:
    """The group whose objects name the hit's full blocks and tail: the first full-attention group."""
    return next((g.index for g in keys.groups if g.kind is GroupKind.FULL), keys.groups[0].index)


def plan_save(keys: PromptKeys) -> list[ObjectRef]:
    """Objects a producer publishes for its prompt, in put order: every group's full blocks by position,
    then every group's tail, then every state group's state after the whole prompt."""
    length = len(keys.tokens)
    boundary = save_tail_boundary(length, keys.block_size, keys.hash_unit)
    blocks, tails, states = [], [], []
    for group in keys.groups:
        if group.kind is GroupKind.STATE:
            if length:
                states.append(keys.state_ref(length, group.index))
            continue
        blocks += [keys.block_ref(i, group.index) for i in range(keys.num_full_blocks)]
        if boundary is not None:
            tails.append(keys.tail_ref(boundary, group.index))
    blocks.sort(key=lambda ref: (ref.block_index, ref.group))
    return blocks + tails + states
