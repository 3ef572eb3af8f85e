"""The save of prompt + answer at a request's end (``save_answers``): what a decoding engine publishes
so that a chat's next turn reuses the answer too."""

from __future__ import annotations

from ..counters import Counters

from ..data import RequestSave, StoredObject
from ..core.groups import NULL_BLOCK_ID
from ..core.prefix import plan_save
from ..core.saveplans import last_put_key, save_transfer
from .tracking import KeySpace, TrackedRequest


def plan_answer_save(
    tracked: TrackedRequest,
    block_ids: tuple[list[int], ...] | None,
    space: KeySpace,
    *,
    has_state_group: bool,
    stats: Counters,
) -> RequestSave | None:
    """Every object of the tokens whose KV the request computed (the last generated token has none)
    that is not known stored, from the request's current blocks, which vLLM keeps until the worker has
    copied them (``finished_sending``). Records what it planned on ``tracked``; counts in ``stats``.

    Decoded KV is what a prefill of the same tokens computes, so the next turn, which extends
    prompt + answer, hits all of it, on any engine."""
    request = tracked.request
    if tracked.unhashable or block_ids is None:
        return None
    if getattr(request, "num_output_tokens", 0) <= 0 or not tracked.keys.tokens:
        return None  # never ran (an abort while waiting for its load): its blocks may hold nothing
    if tracked.loading:
        # Finished while its load (after a preemption) still fills its blocks: they hold nothing yet.
        stats.add("answer_saves_skipped_loading")
        return None
    in_flight = getattr(request, "num_in_flight_tokens", 0)
    computed = request.num_computed_tokens - in_flight
    if in_flight and has_state_group:
        # Async scheduling, a request stopped by its last sampled token (an EOS): the step in flight
        # computes that token, moving the running state past the answer's other tokens. It is the last
        # step the worker runs before the one that copies this save (steps run in order; vLLM holds the
        # blocks until the copy), so the save takes the whole answer, that token's KV and state included.
        # Anything else in flight (drafts, a stale share after a preemption) leaves no state to save.
        whole = len(tracked.keys.tokens) + len(getattr(request, "output_token_ids", ()))
        if in_flight != 1 or getattr(request, "num_stale_output_tokens", 0) or request.num_computed_tokens != whole:
            stats.add("answer_saves_skipped_in_flight")
            return None
        computed = request.num_computed_tokens
    # The prompt as it was hashed (vLLM zeroes prompt-embedding positions in all_token_ids), then the answer;
    # no further than the tokens there are (a stop inside accepted drafts leaves KV computed past them).
    tokens = [*tracked.keys.tokens, *getattr(request, "output_token_ids", ())][:computed]
    if has_state_group and len(tokens) < computed:
        stats.add("answer_saves_skipped_in_flight")  # the running state is past the answer's last token
        return None
    computed = len(tokens)
    done = len(tracked.keys.tokens) if tracked.save_scheduled else 0
    if computed <= max(done, 1):
        return None
    keys = space.keys(tokens, tracked.keys.root)
    stored = tracked.stored.present if tracked.stored is not None and tracked.load_failure is None else frozenset()
    # Where the prompt's save left objects unstored, none is taken as stored: the put asks the store again.
    known = frozenset() if tracked.prompt_unsaved else stored | tracked.saved_keys
    usable, found = [], []
    for ref in plan_save(keys):
        ids = block_ids[ref.group] if ref.group < len(block_ids) else []
        if ref.key in known:
            # Stored already, or planned by the prompt's save: its record names it, and the put thread
            # asks whether it is stored now (a put that failed or an eviction stops the watermark there).
            found.append(StoredObject(ref.kind, ref.token_start, ref.token_end, ref.group, ref.chain_hash))
            continue
        if ref.block_index >= len(ids) or ids[ref.block_index] == NULL_BLOCK_ID:
            continue  # a block a sliding window gave up
        usable.append((ref, ids[ref.block_index]))
    if not usable:
        return None
    transfers = tuple(save_transfer(keys, ref, block_id) for ref, block_id in usable)
    tracked.answer_tokens, tracked.answer_objects = computed, len(usable)
    tracked.answer_last_key = last_put_key(keys, [ref for ref, _ in usable])
    stats.add("answer_saves")
    params = getattr(request, "kv_transfer_params", None) or {}
    return RequestSave(
        request.request_id,
        transfers,
        tuple(found),
        prompt_tokens=computed,
        state_groups=keys.state_groups,
        tag=params.get("kvtool_tag"),
        answer=True,
    )
