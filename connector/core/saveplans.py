"""How a planned save object becomes the worker's transfer, which key a save puts last, and how the
Mamba boundary states vLLM names join a step's saves. Pure."""

from __future__ import annotations

from dataclasses import replace

from ..data import BlockTransfer, RequestSave
from .groups import NULL_BLOCK_ID, CacheGroup, GroupKind
from .prefix import PromptKeys
from .refs import ObjectRef


def save_transfer(keys: PromptKeys, ref: ObjectRef, block_id: int) -> BlockTransfer:
    """A save object copied from ``block_id``, with the pointers to put after it."""
    pointers = tuple(keys.pointer_hashes(ref))
    token_ids = keys.tokens[ref.token_start : ref.token_end] if pointers else ()
    return BlockTransfer(
        block_id, ref.kind, ref.token_start, ref.token_end, ref.chain_hash, ref.group, pointers, token_ids
    )


def last_put_key(keys: PromptKeys, saved: list[ObjectRef]) -> str:
    """The key a save puts last: the last pointer of its one batch of pointers (put after every object),
    else its last object. Once it is stored, every put of the save was tried."""
    for ref in reversed(saved):
        hashes = keys.pointer_hashes(ref)
        if hashes:
            return keys.pointer_ref(hashes[-1][0], ref.group).key
    return saved[-1].key


def state_transfers(
    keys: PromptKeys, groups: tuple[CacheGroup, ...], entries: list[tuple[int, int, int]]
) -> list[BlockTransfer]:
    """The state saves of vLLM's ``(group, block_id, boundary)`` offloads that name a state group's
    block at a boundary inside the prompt (past it: a resumed request's re-prefill, not the prompt's)."""
    transfers = []
    for group, block_id, boundary in entries:
        if group >= len(groups) or groups[group].kind is not GroupKind.STATE:
            continue
        if block_id == NULL_BLOCK_ID or not 0 < boundary <= len(keys.tokens):
            continue
        ref = keys.state_ref(boundary, group)
        transfers.append(BlockTransfer(block_id, ref.kind, ref.token_start, ref.token_end, ref.chain_hash, group))
    return transfers


def add_state_saves(saves: list[RequestSave], req_id: str, transfers: list[BlockTransfer], prompt_tokens: int) -> None:
    """Add state saves to the step's ``saves``: into the prompt's own save of this step (one job, states
    after its objects, none twice), else as a checkpoint save of their own."""
    index = next((i for i, save in enumerate(saves) if save.req_id == req_id), None)
    if index is None:
        saves.append(RequestSave(req_id, tuple(transfers), prompt_tokens=prompt_tokens, checkpoint=True))
        return
    save = saves[index]
    have = {(t.group, t.kind, t.token_end) for t in save.transfers}
    extra = tuple(t for t in transfers if (t.group, t.kind, t.token_end) not in have)
    saves[index] = replace(save, transfers=save.transfers + extra)
