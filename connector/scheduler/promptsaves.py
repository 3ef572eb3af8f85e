"""Which of a prompt's objects the scheduler side has the worker save, from which blocks, in the step
that completes the prompt (so a ``max_tokens=1`` request publishes too); and the Mamba states vLLM's
align mode keeps at boundaries inside a prompt, saved in the step that computes them.

One ``PromptSaves`` a step: it holds that step's view of vLLM's block tables (never an append-only
mirror: a sliding window or a Mamba group frees blocks and reuses their ids) and of what each request
is scheduled to compute. (Answer saves, at a request's end, are ``answers``.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..core.groups import NULL_BLOCK_ID, CacheGroup, GroupKind
from ..core.keys import KeyKind
from ..core.prefix import plan_save
from ..core.refs import ObjectRef
from ..core.saveplans import add_state_saves, last_put_key, save_transfer, state_transfers
from ..counters import Counters
from ..data import KVToolMetadata, RequestSave, StoredObject
from .tracking import TrackedRequest

BlockTables = Callable[[str], "tuple[list[int], ...] | None"]  # a request's current block ids, per group


class PromptSaves:
    def __init__(
        self,
        groups: Sequence[CacheGroup],
        stats: Counters,
        tables: BlockTables | None,
        scheduled: Mapping[str, int],
        found: Callable[[TrackedRequest], object],
    ):
        self._groups = groups
        self._stats = stats
        self._tables = tables  # vLLM's current block tables this step, where it gives them
        self._scheduled = scheduled  # request id -> tokens it computes this step
        self._found = found  # what a request's lookup found stored, answered but not taken yet

    def plan(self, meta: KVToolMetadata, tracked: TrackedRequest, num_computed: int) -> None:
        """Publish the prompt's KV in the step that completes it: the objects not found stored, from
        the blocks the request still holds."""
        if tracked.save_scheduled or tracked.unhashable:
            return
        req_id = tracked.request.request_id
        prompt_len = len(tracked.keys.tokens)
        if num_computed + self._scheduled.get(req_id, 0) < prompt_len:
            return
        tracked.save_scheduled = True
        planned = plan_save(tracked.keys)
        present = tracked.known_present(planned, self._found(tracked))
        missing = [s for s, found in zip(planned, present, strict=True) if not found]
        sources = [self._source_block(tracked, s, num_computed) for s in missing]
        usable = [(s, block_id) for s, block_id in zip(missing, sources, strict=True) if block_id is not None]
        if len(usable) != len(missing):
            # A sliding-window group gave up the blocks its window left (an earlier chunk's): a lookup
            # that needs them will not find them, which is a miss, never a wrong block.
            self._stats.add("save_objects_not_held", len(missing) - len(usable))
        if not usable:
            return
        params = getattr(tracked.request, "kv_transfer_params", None) or {}
        meta.saves.append(
            RequestSave(
                req_id,
                tuple(save_transfer(tracked.keys, s, block_id) for s, block_id in usable),
                already_stored=tuple(
                    StoredObject(s.kind, s.token_start, s.token_end, s.group, s.chain_hash)
                    for s, found in zip(planned, present, strict=True)
                    if found
                ),
                prompt_tokens=prompt_len,
                state_groups=tracked.keys.state_groups,
                tag=params.get("kvtool_tag"),
                last_block_key=next((s.key for s in reversed(planned) if s.kind is KeyKind.BLOCK), None),
                tail_key=next((s.key for s in planned if s.kind is KeyKind.TAIL), None),
                turn=tracked.turn,
            )
        )
        tracked.saved_keys |= frozenset(s.key for s, _ in usable)
        tracked.save_objects += len(usable)
        tracked.last_saved_key = last_put_key(tracked.keys, [s for s, _ in usable])
        tails = [s.token_end for s, _ in usable if s.kind is KeyKind.TAIL]
        tracked.tail_boundary_saved = tails[0] if tails else None

    def boundary_states(
        self, meta: KVToolMetadata, tracked: TrackedRequest | None, entries: list[tuple[int, int, int]]
    ) -> None:
        """Save the Mamba states vLLM's align mode keeps at boundaries inside a prompt, from the exact
        blocks it names, in the step that computes them (a later step's forward may overwrite them).

        With them a prompt that shares only the first blocks of a stored one, or the stored prompt
        itself sent unchanged, hits at the last boundary its state group holds."""
        if tracked is None or tracked.unhashable:
            return
        transfers = state_transfers(tracked.keys, self._groups, entries)
        if transfers:
            self._stats.add("state_checkpoints", len(transfers))
            add_state_saves(meta.saves, tracked.request.request_id, transfers, len(tracked.keys.tokens))

    def _source_block(self, tracked: TrackedRequest, save: ObjectRef, computed_before_step: int) -> int | None:
        """The block a save object is copied from, or None when the request no longer holds it."""
        tables = self._tables(tracked.request.request_id) if self._tables is not None else None
        if tables is None:
            if self._groups[save.group].kind is not GroupKind.FULL:
                return None  # only full attention's table only grows; another group's mirror may be stale
            tables = tracked.block_ids
        ids = tables[save.group] if save.group < len(tables) else []
        if save.block_index >= len(ids) or ids[save.block_index] == NULL_BLOCK_ID:
            return None
        if save.block_index < self._groups[save.group].live_from_block(computed_before_step):
            return None  # freed when this step began: its id may already hold another request's KV
        return ids[save.block_index]
