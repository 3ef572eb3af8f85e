"""A prompt's keys in every cache group, what each group needs for a hit, and the plans a load and a
save follow. Pure logic (``connector.core.search`` asks the store which of these keys it holds).

A model has one or more KV cache groups (``connector.core.groups``); a prefix is stored when every group
holds what it needs for it, and a load reads each group's objects into that group's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from . import native
from .groups import CacheGroup, GroupKind
from .hashing import block_hashes, pack_tokens, save_tail_boundary, tail_boundaries, tail_hash, tail_hashes
from .keys import KeyKind, object_key, object_key_prefix

from .refs import LoadPlan, ObjectRef, StoredPrefix, new_ref
from .served import ServedIndex


def single_group(block_size: int) -> tuple[CacheGroup, ...]:
    """The layout of a plain model: one full-attention group."""
    return (CacheGroup(0, GroupKind.FULL, block_size),)


@dataclass(frozen=True)
class PromptKeys:
    """The keys of one prompt, for every cache group: blocks, tails and states, computed on demand.

    Thread-safety: the lookup thread (``search``) and the engine thread (save and load plans) use one
    ``PromptKeys`` at once, with no lock. That is safe by one rule, which every cache below keeps and a
    new one must keep too (or take a lock): a write stores the value a pure function of the frozen
    fields gives for its key, so two threads writing one key write equal values (idempotent), and
    no code iterates a cache (membership tests, ``get`` and single stores only; each is atomic under
    the GIL). A cache that held anything else (a count, a list appended to, a value that depends on
    which thread got there first) would race. The C key builder (``native.KEYS.build_refs``) writes
    ``_refs`` and ``_by_key`` by the same rule, and holds each hash it reads while it makes the ref."""

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
    # A pointer at each stored object's first token too (its block start + 1): a prompt that leaves a
    # stored one before the grid's first point in a block still finds it, and goes on through the token
    # ids (used where that point lies further than a lookup's ``extend_min_tokens`` from the start).
    lead_pointers: bool = False
    # Tail hashes already computed: a lookup asks for the same ones in every group and candidate.
    _tails: dict[int, bytes] = field(default_factory=dict, compare=False, repr=False)
    # Inner candidate ends per block, likewise asked for again and again.
    _inner: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)
    # Refs built so far, by (kind, end, group): a lookup asks for each several times (the query, the
    # search for the longest served end, the pointers' rounds), and building a key is most of its cost.
    _refs: dict[tuple[KeyKind, int, int], ObjectRef] = field(default_factory=dict, compare=False, repr=False)
    # Every full block's ref, by group (``block_refs``).
    _blocks: dict[int, list[ObjectRef]] = field(default_factory=dict, compare=False, repr=False)
    # The refs above by key: which of this prompt's objects a set of stored keys names (``ServedIndex``).
    _by_key: dict[str, ObjectRef] = field(default_factory=dict, compare=False, repr=False)
    # Served indexes by the set of stored keys they answer for (``served``): a lookup asks the same
    # set again in each of its rounds.
    _served: dict[frozenset[str], ServedIndex] = field(default_factory=dict, compare=False, repr=False)
    # The tokens packed as the hashes take them (``hashing.pack_tokens``), once per prompt.
    _packed: bytes | None = field(default=None, compare=False, repr=False)

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
        lead_pointers: bool = False,
    ) -> PromptKeys:
        groups = groups or single_group(block_size)
        if any(group.block_size != block_size for group in groups):
            raise ValueError("every cache group must use the prompt's block size")
        tokens = tuple(tokens)
        packed = pack_tokens(tokens)  # checks every id (``UnkeyableTokens``)
        full = len(tokens) // block_size * block_size * 4
        chain = tuple(block_hashes(tokens, block_size, root, memoryview(packed)[:full]))
        return cls(
            tokens,
            block_size,
            hash_unit,
            namespace,
            root,
            chain,
            groups,
            grid,
            lead_pointers and grid > 0,
            _packed=packed,
        )

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
            block = boundary // self.block_size
            if boundary % self.block_size == 0 or boundary > len(self.tokens):
                tail_hash(self.tokens, boundary, self.block_size, self.parent_of_block(block))  # says why not
            # Every boundary a lookup may ask about in this block, at once (``hashing.tail_hashes``).
            ends = sorted({*self.inner_candidates(block), boundary})
            digests = tail_hashes(self.tokens, ends, self.block_size, self.parent_of_block(block), self._packed)
            self._tails.update(zip(ends, digests, strict=True))
            digest = self._tails[boundary]
        return digest

    def block_ref(self, index: int, group: int = 0) -> ObjectRef:
        if not 0 <= index < len(self.block_chain):
            raise IndexError(f"block {index} is not a full block of the {len(self.tokens)} tokens")
        return self.block_refs(group)[index]

    def block_refs(self, group: int = 0) -> list[ObjectRef]:
        """Every full block's ref in ``group``, in order (made at once: a lookup asks for all of them)."""
        refs = self._blocks.get(group)
        if refs is None:
            prefix, bs, kind = object_key_prefix(self.namespace, group, KeyKind.BLOCK), self.block_size, KeyKind.BLOCK
            refs = self._blocks[group] = [
                new_ref(
                    ObjectRef, (f"{prefix}{(i + 1) * bs}/{digest.hex()}", group, kind, i, i * bs, (i + 1) * bs, digest)
                )
                for i, digest in enumerate(self.block_chain)
            ]
            self._by_key.update((ref.key, ref) for ref in refs)
        return refs

    def _keep(self, where: tuple[KeyKind, int, int], ref: ObjectRef) -> ObjectRef:
        self._refs[where] = self._by_key[ref.key] = ref
        return ref

    def ref_of(self, key: str) -> ObjectRef | None:
        """This prompt's object with that key, among those built so far (every key a lookup asked)."""
        return self._by_key.get(key)

    def tail_ref(self, boundary: int, group: int = 0) -> ObjectRef:
        return self._inner_ref(KeyKind.TAIL, boundary, group)

    def pointer_ref(self, boundary: int, group: int = 0) -> ObjectRef:
        """The pointer at ``boundary`` (inside a block): it has a tail's hash, and names a stored object
        of ``group`` that holds this prefix's KV and more."""
        return self._inner_ref(KeyKind.POINTER, boundary, group)

    def _inner_ref(self, kind: KeyKind, boundary: int, group: int) -> ObjectRef:
        """A tail's or a pointer's ref: both have the tail hash of the prefix ending at ``boundary``."""
        ref = self._refs.get((kind, boundary, group))
        if ref is None:
            self.tail_hash(boundary)  # says why not, for a boundary that has no tail hash
            ref = self._refs_of(kind, [boundary], group)[0]
        return ref

    def pointers_inside(self, ref: ObjectRef) -> list[ObjectRef]:
        """The pointers a save writes for one of its block or tail objects: at every grid multiple
        strictly inside the tokens it holds, and at its first token (``lead_pointers``). Each record
        carries the object's token ids from its boundary on, so a prompt sharing part of them finds the
        exact common prefix."""
        return [self.pointer_ref(boundary, ref.group) for boundary, _ in self.pointer_hashes(ref)]

    def pointer_hashes(self, ref: ObjectRef) -> list[tuple[int, bytes]]:
        """``pointers_inside`` as (boundary, prefix hash), without their keys (what a save sends)."""
        if not self.grid or ref.kind not in (KeyKind.BLOCK, KeyKind.TAIL):
            return []
        ends = self.pointer_ends(ref.block_index, ref.token_end - 1)
        # Only these ends' hashes (``tail_hash`` alone would take every boundary a lookup may ask
        # about in the block: at hash unit 1, the block's 31 others for a save's 3 or 4 pointers).
        missing = [end for end in ends if end not in self._tails]
        if missing:
            parent = self.parent_of_block(ref.block_index)
            digests = tail_hashes(self.tokens, missing, self.block_size, parent, self._packed)
            self._tails.update(zip(missing, digests, strict=True))
        return [(end, self._tails[end]) for end in ends]

    def pointer_ends(self, block_index: int, limit: int) -> list[int]:
        """Where pointers stand in block ``block_index``, up to ``limit``: the grid's multiples inside
        it, and its first token with ``lead_pointers``."""
        ends = tail_boundaries(block_index, self.block_size, self.grid, limit)
        lead = block_index * self.block_size + 1
        if self.lead_pointers and lead <= limit and (not ends or ends[0] != lead):
            ends.insert(0, lead)
        return ends

    def is_lead(self, end: int) -> bool:
        """A lead pointer's end (a block's first token), not one of the grid's."""
        return self.lead_pointers and end % self.block_size == 1 and end % self.grid != 0

    def state_ref(self, end: int, group: int) -> ObjectRef:
        """The state after ``end`` tokens: it lives in the block holding token ``end - 1``."""
        ref = self._refs.get((KeyKind.STATE, end, group))
        if ref is None:
            digest = self.chain_hash(end)
            ref = self._keep(
                (KeyKind.STATE, end, group),
                ObjectRef(
                    object_key(self.namespace, group, KeyKind.STATE, end, digest),
                    group,
                    KeyKind.STATE,
                    (end - 1) // self.block_size,
                    0,
                    end,
                    digest,
                ),
            )
        return ref

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
        if ends is None and self.hash_unit == 1:
            # Every end inside the block is a tail's (token-exact), the pointers' among them: no union.
            ends = self._inner[block_index] = self.tail_candidates(block_index)
        if ends is None:
            found = set(self.tail_candidates(block_index))
            if self.grid:
                found.update(self.pointer_ends(block_index, len(self.tokens)))
            ends = self._inner[block_index] = sorted(found)
        return ends

    def inner_refs(self, end: int, group: int) -> list[ObjectRef]:
        """What may hold a prefix ending at ``end`` inside a block: its tail, its pointer."""
        refs = [self.tail_ref(end, group)] if end % self.hash_unit == 0 else []
        if self.grid and (end % self.grid == 0 or self.is_lead(end)):
            refs.append(self.pointer_ref(end, group))
        return refs

    # -- what a group needs ---------------------------------------------------------------------------

    def probe_refs(self, ends: Sequence[int], blocks: bool) -> list[ObjectRef]:
        """The objects a lookup asks about, in every group: the full blocks (when ``blocks``) and, at
        each candidate end, a tail or pointer (attention groups) or a state (state groups; also one
        token short of the prompt, the most a hit on the prompt itself can claim)."""
        refs: list[ObjectRef] = []
        for group in self.groups:
            if group.kind is GroupKind.STATE:
                states = set(ends) | ({len(self.tokens) - 1} if blocks and len(self.tokens) > 1 else set())
                refs += [self.state_ref(end, group.index) for end in sorted(states)]
                continue
            if blocks:
                refs += self.block_refs(group.index)
            refs += self._inner_refs_at([end for end in ends if end % self.block_size], group.index)
        return refs

    def _inner_refs_at(self, ends: Sequence[int], group: int) -> list[ObjectRef]:
        """``inner_refs`` of each of ``ends`` (none block-aligned), built in one pass: at hash unit 1 a
        lookup asks for a whole block's tails (255 at block 256), and one by one that was most of its CPU."""
        missing: dict[int, list[int]] = {}  # block -> the ends not hashed yet, each block's at once
        for end in ends:
            if end not in self._tails:
                missing.setdefault(end // self.block_size, []).append(end)
        for block, unhashed in missing.items():
            parent = self.parent_of_block(block)
            self._tails.update(
                zip(unhashed, tail_hashes(self.tokens, unhashed, self.block_size, parent, self._packed), strict=True)
            )
        tails = [end for end in ends if end % self.hash_unit == 0]
        pointers = [end for end in ends if self.grid and (end % self.grid == 0 or self.is_lead(end))]
        return self._refs_of(KeyKind.TAIL, tails, group) + self._refs_of(KeyKind.POINTER, pointers, group)

    def _refs_of(self, kind: KeyKind, ends: list[int], group: int) -> list[ObjectRef]:
        """The tail or pointer refs at ``ends`` (their hashes known), made where not made yet."""
        if not ends:
            return []
        prefix = object_key_prefix(self.namespace, group, kind)
        if native.KEYS is not None:  # the loop below, in C (the same keys, refs and caches)
            return native.KEYS.build_refs(
                ObjectRef, prefix, group, kind, self.block_size, ends, self._tails, self._refs, self._by_key
            )
        return self.reference_refs(prefix, kind, ends, group)

    def reference_refs(self, prefix: str, kind: KeyKind, ends: list[int], group: int) -> list[ObjectRef]:
        """``_refs_of`` in Python: the reference the C key builder is held to."""
        refs, by_key, hashes, bs, found = self._refs, self._by_key, self._tails, self.block_size, []
        for end in ends:
            ref = refs.get((kind, end, group))
            if ref is None:  # ``_keep``, inline: a lookup at hash unit 1 makes a whole block's refs
                digest, index = hashes[end], end // bs
                key = f"{prefix}{end}/{digest.hex()}"
                ref = refs[kind, end, group] = by_key[key] = new_ref(
                    ObjectRef, (key, group, kind, index, index * bs, end, digest)
                )
            found.append(ref)
        return found

    @property
    def state_groups(self) -> tuple[int, ...]:
        """The state groups (Mamba): a save names them, since each needs a state for a hit."""
        return tuple(group.index for group in self.groups if group.kind is GroupKind.STATE)

    @property
    def has_state_group(self) -> bool:
        """A state group holds states at exact ends only: no hit extends past a stored end there."""
        return any(group.kind is GroupKind.STATE for group in self.groups)

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
                for ref in self.inner_refs(boundary, group.index):
                    if ref.key in present:
                        return ref
        return None

    def objects_for(
        self,
        group: CacheGroup,
        hit: int,
        present: frozenset[str],
        from_block: int = 0,
        final: ObjectRef | None = None,
    ) -> list[ObjectRef] | None:
        """What ``group`` loads for a hit of ``hit`` tokens, blocks below ``from_block`` excluded
        (the engine's own cached ones); None when something it needs is not stored. ``final``: the
        object that holds the hit's last token, when a pointer's token ids extended the hit to it."""
        if group.kind is GroupKind.STATE:
            state = self.state_ref(hit, group.index)
            return [state] if state.key in present else None
        last = (hit - 1) // self.block_size
        refs = self.block_refs(group.index)[max(from_block, group.first_needed_block(hit)) : last]
        if any(ref.key not in present for ref in refs):
            return None
        if last < from_block:
            return refs
        final = final or self._last_object(group, hit, present)
        return None if final is None else refs + [final]

    def served(self, present: frozenset[str]) -> ServedIndex:
        """Which lengths ``present`` serves (``ServedIndex``), built once per set of stored keys. The
        index refers to these keys weakly (no cycle): use it while they are alive."""
        index = self._served.get(present)
        if index is None:
            index = self._served[present] = ServedIndex(self, present)
        return index

    def serves(self, hit: int, present: frozenset[str]) -> bool:
        """Whether every group holds what a hit of ``hit`` tokens needs."""
        return hit > 0 and all(self.objects_for(group, hit, present) is not None for group in self.groups)


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
        refs = keys.objects_for(group, hit, stored.present, from_block, stored.extended.get(group.index))
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
        blocks += keys.block_refs(group.index)
        if boundary is not None:
            tails.append(keys.tail_ref(boundary, group.index))
    blocks.sort(key=lambda ref: (ref.block_index, ref.group))
    return blocks + tails + states
