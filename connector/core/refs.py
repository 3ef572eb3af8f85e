"""The plain types that cross the lookup's modules: what a stored object is (``ObjectRef``), what a
lookup found (``StoredPrefix``) and what a load takes (``LoadPlan``). Pure data, no logic beyond a few
derived fields: ``prefix`` (which keys a prompt has), ``served`` (which lengths they serve), ``search``
(what is stored) and the scheduler side all use them, and none of those needs another to name them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .keys import KeyKind


class ObjectRef(NamedTuple):
    """One stored object of one group, and the request block (index within the group) it fills.

    (A named tuple, not a frozen dataclass: a lookup at block 256 and hash unit 1 builds hundreds per
    prompt, and a frozen dataclass costs several times as much to make.)"""

    key: str
    group: int
    kind: KeyKind
    block_index: int
    token_start: int
    token_end: int  # end of the object's valid tokens (block end, tail boundary, or the state's position)
    chain_hash: bytes


# A ref made from its fields' tuple: a named tuple's own ``__new__`` is a Python function, several times
# the cost of the tuple itself (a lookup at hash unit 1 makes a whole block's refs).
new_ref = tuple.__new__


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
    # The hit was extended past the ends its keys name by pointer records' token ids (the exact point
    # where the prompt leaves a stored one): group -> the object holding the hit's last token.
    extended: dict[int, ObjectRef] = field(default_factory=dict)

    @property
    def full_blocks(self) -> int:
        return self.tokens // self.block_size

    @property
    def tail_boundary(self) -> int | None:
        return self.tokens if self.tokens % self.block_size else None

    @property
    def block_tokens(self) -> int:
        return self.full_blocks * self.block_size


@dataclass(frozen=True)
class LoadPlan:
    """What a consumer loads: tokens [local_tokens, local_tokens + external_tokens)."""

    local_tokens: int
    external_tokens: int
    block_tokens: int  # of external_tokens, those that come from full-block objects
    tail_tokens: int  # of external_tokens, those that come from a tail object
    objects: tuple[ObjectRef, ...]
