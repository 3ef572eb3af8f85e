"""Finding the longest stored prefix of a prompt, and turning it into a load plan. Pure logic.

The store is consulted through an ``exists`` callable, so the rules here are tested without one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .hashing import block_hashes, save_tail_boundary, tail_boundaries, tail_hash
from .keys import KeyKind, block_key, tail_key

ExistsFn = Callable[[list[str]], list[bool]]


@dataclass(frozen=True)
class PromptKeys:
    """The keys of one prompt: one per full block, and the tail keys computed on demand."""

    tokens: tuple[int, ...]
    block_size: int
    hash_unit: int
    namespace: str
    root: bytes
    block_chain: tuple[bytes, ...]

    @classmethod
    def build(cls, tokens: Sequence[int], block_size: int, hash_unit: int, namespace: str, root: bytes):
        tokens = tuple(tokens)
        return cls(tokens, block_size, hash_unit, namespace, root, tuple(block_hashes(tokens, block_size, root)))

    @property
    def num_full_blocks(self) -> int:
        return len(self.block_chain)

    def block_key(self, index: int) -> str:
        return block_key(self.namespace, (index + 1) * self.block_size, self.block_chain[index])

    def parent_of_block(self, index: int) -> bytes:
        return self.root if index == 0 else self.block_chain[index - 1]

    def tail_hash(self, boundary: int) -> bytes:
        block_index = boundary // self.block_size
        return tail_hash(self.tokens, boundary, self.block_size, self.parent_of_block(block_index))

    def tail_key(self, boundary: int) -> str:
        return tail_key(self.namespace, boundary, self.tail_hash(boundary))

    def tail_candidates(self, block_index: int) -> list[int]:
        return tail_boundaries(block_index, self.block_size, self.hash_unit, len(self.tokens))


@dataclass(frozen=True)
class StoredPrefix:
    """The longest prefix of a prompt whose KV is in the store."""

    block_size: int
    full_blocks: int  # leading full blocks stored
    tail_boundary: int | None  # end of the longest stored tail in the block after them
    queries: int = 1  # existence round trips it took

    @property
    def block_tokens(self) -> int:
        return self.block_size * self.full_blocks

    @property
    def tokens(self) -> int:
        return self.tail_boundary if self.tail_boundary is not None else self.block_tokens


def find_stored_prefix(keys: PromptKeys, exists: ExistsFn) -> StoredPrefix:
    """Longest stored prefix of one prompt (see ``find_stored_prefixes``)."""
    return find_stored_prefixes([keys], exists)[0]


def find_stored_prefixes(prompts: Sequence[PromptKeys], exists: ExistsFn) -> list[StoredPrefix]:
    """Longest stored prefix of each prompt, at hash-unit granularity, in at most two queries in all.

    The first query asks, for every prompt, for every full-block key plus the tail candidates of the
    prompt's last block, which answers the common cases (a repeated prompt; every full block stored)
    in one round trip. Where a prompt's stored blocks stop earlier, at block k, a second query (one
    for all such prompts) asks for the tail candidates inside block k: that is where a stored shorter
    prompt (a sub-block prompt, the previous chat turn) ends.
    """
    first: list[tuple[list[str], list[int]]] = []
    query: list[str] = []
    for keys in prompts:
        block_keys = [keys.block_key(i) for i in range(keys.num_full_blocks)]
        last_tails = keys.tail_candidates(len(keys.tokens) // keys.block_size)
        first.append((block_keys, last_tails))
        query += block_keys + [keys.tail_key(b) for b in last_tails]
    answers = exists(query) if query else []

    results: list[StoredPrefix | None] = []
    second: list[tuple[int, int, list[int]]] = []  # (prompt index, full blocks, inner tail candidates)
    second_query: list[str] = []
    offset = 0
    for index, (keys, (block_keys, last_tails)) in enumerate(zip(prompts, first, strict=True)):
        mine = answers[offset : offset + len(block_keys) + len(last_tails)]
        offset += len(mine)
        full_blocks = 0
        while full_blocks < len(block_keys) and mine[full_blocks]:
            full_blocks += 1
        if full_blocks == keys.num_full_blocks:
            tail = _longest(last_tails, mine[len(block_keys) :])
            results.append(StoredPrefix(keys.block_size, full_blocks, tail, queries=1))
            continue
        inner = keys.tail_candidates(full_blocks)
        results.append(None)
        second.append((index, full_blocks, inner))
        second_query += [keys.tail_key(b) for b in inner]

    inner_answers = exists(second_query) if second_query else []
    offset = 0
    for index, full_blocks, inner in second:
        mine = inner_answers[offset : offset + len(inner)]
        offset += len(inner)
        results[index] = StoredPrefix(prompts[index].block_size, full_blocks, _longest(inner, mine), queries=2)
    return [r for r in results if r is not None]


def _longest(boundaries: list[int], answers: Sequence[bool]) -> int | None:
    found = [b for b, present in zip(boundaries, answers, strict=True) if present]
    return max(found) if found else None


@dataclass(frozen=True)
class ObjectLoad:
    """One stored object to copy into one of the request's blocks."""

    key: str
    kind: KeyKind
    block_index: int  # index of the block within the request
    token_start: int
    token_end: int  # end of the object's valid tokens (block end, or tail boundary)
    chain_hash: bytes


@dataclass(frozen=True)
class LoadPlan:
    """What a consumer loads: tokens [local_tokens, local_tokens + external_tokens)."""

    local_tokens: int
    external_tokens: int
    block_tokens: int  # of external_tokens, those that come from full-block objects
    tail_tokens: int  # of external_tokens, those that come from a tail object
    objects: tuple[ObjectLoad, ...]


def plan_load(keys: PromptKeys, stored: StoredPrefix, local_tokens: int) -> LoadPlan:
    """The hit vLLM can take: capped one token short of the prompt, and never below what vLLM holds.

    ``local_tokens`` is vLLM's own (block-aligned) prefix-cache hit; those tokens are never claimed.
    """
    block_size = keys.block_size
    usable = min(stored.tokens, len(keys.tokens) - 1)
    if usable <= local_tokens:
        return LoadPlan(local_tokens, 0, 0, 0, ())
    block_end = stored.full_blocks * block_size
    objects: list[ObjectLoad] = []
    first_block = local_tokens // block_size
    last_block = (usable - 1) // block_size
    for index in range(first_block, last_block + 1):
        start = index * block_size
        if index < stored.full_blocks:
            objects.append(
                ObjectLoad(
                    keys.block_key(index), KeyKind.BLOCK, index, start, start + block_size, keys.block_chain[index]
                )
            )
        else:
            boundary = stored.tail_boundary
            assert boundary is not None and boundary // block_size == index
            objects.append(
                ObjectLoad(keys.tail_key(boundary), KeyKind.TAIL, index, start, boundary, keys.tail_hash(boundary))
            )
    block_tokens = max(0, min(usable, block_end) - local_tokens)
    external = usable - local_tokens
    return LoadPlan(local_tokens, external, block_tokens, external - block_tokens, tuple(objects))


@dataclass(frozen=True)
class ObjectSave:
    key: str
    kind: KeyKind
    block_index: int
    token_start: int
    token_end: int
    chain_hash: bytes


def plan_save(keys: PromptKeys) -> list[ObjectSave]:
    """Objects a producer publishes for its prompt: every full block, then the prompt's tail."""
    block_size = keys.block_size
    saves = [
        ObjectSave(keys.block_key(i), KeyKind.BLOCK, i, i * block_size, (i + 1) * block_size, keys.block_chain[i])
        for i in range(keys.num_full_blocks)
    ]
    boundary = save_tail_boundary(len(keys.tokens), block_size, keys.hash_unit)
    if boundary is not None:
        index = boundary // block_size
        saves.append(
            ObjectSave(
                keys.tail_key(boundary), KeyKind.TAIL, index, index * block_size, boundary, keys.tail_hash(boundary)
            )
        )
    return saves
