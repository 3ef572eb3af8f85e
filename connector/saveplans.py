"""How a planned save object becomes the worker's transfer, and which key a save puts last. Pure."""

from __future__ import annotations

from .data import BlockTransfer
from .prefix import ObjectRef, PromptKeys


def save_transfer(keys: PromptKeys, ref: ObjectRef, block_id: int) -> BlockTransfer:
    """A save object copied from ``block_id``, with the pointers to put after it."""
    pointers = tuple((p.token_end, p.chain_hash) for p in keys.pointers_inside(ref))
    token_ids = keys.tokens[ref.token_start : ref.token_end] if pointers else ()
    return BlockTransfer(block_id, ref.kind, ref.token_start, ref.token_end, ref.chain_hash, ref.group, pointers,
                         token_ids)  # fmt: skip


def last_put_key(keys: PromptKeys, saved: list[ObjectRef]) -> str:
    """The key a save puts last: the last pointer of its one batch of pointers (put after every object),
    else its last object. Once it is stored, every put of the save was tried."""
    pointers = [pointer for ref in saved for pointer in keys.pointers_inside(ref)]
    return pointers[-1].key if pointers else saved[-1].key
