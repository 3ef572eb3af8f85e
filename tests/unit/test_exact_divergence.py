"""Exact divergence points at the grid's key cost: pointer records carry the token ids of the object
they name, so a prompt that leaves a stored one anywhere (inside a block, inside the first block, at
any token) hits their exact common prefix, and never more than what the objects it loads hold.

Saves go through the real worker (objects, then their pointer records); the store is a dict. Every hit
is checked against the prompts that wrote the objects it loads.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.data import KVToolMetadata, RequestSave
from connector.core.groups import CacheGroup, GroupKind
from connector.core.hashing import save_tail_boundary
from connector.core.objects import PointerRecord, encode_pointer
from connector.core.prefix import PromptKeys, plan_load, plan_save
from connector.core.saveplans import save_transfer
from connector.core.search import find_stored_prefix

from .scripted_store import ScriptedStore
from .test_divergence import ROOT
from .test_worker import BLOCK, NS, kv_caches, worker

CACHES = kv_caches("random")
BASE = list(range(1000, 1200))


def keys_for(tokens, grid, unit=1):
    """Keys with lead pointers too, at each block's first token (what a connector whose grid exceeds
    extend_min_tokens puts)."""
    return PromptKeys.build(tokens, BLOCK, unit, NS.key_component(), ROOT, grid=grid, lead_pointers=True)


def save(store, tokens, grid, unit=1):
    """A save through the real worker: objects, then their pointer records; block i in physical block i."""
    keys = keys_for(tokens, grid, unit)
    side = worker(store, CACHES)
    transfers = tuple(save_transfer(keys, ref, ref.block_index) for ref in plan_save(keys))
    side.wait_for_save(KVToolMetadata(saves=[RequestSave("req-1", transfers, prompt_tokens=len(tokens))]))
    side.shutdown()


def lookup(store, tokens, grid, unit=1, min_tokens=1):
    keys = keys_for(tokens, grid, unit)
    stored = find_stored_prefix(keys, store.exists, lambda asked: store.get(asked), min_tokens)
    return stored, plan_load(keys, stored, 0)


def common_prefix(a, b) -> int:
    count = 0
    while count < min(len(a), len(b)) and a[count] == b[count]:
        count += 1
    return count


def stored_end(tokens, unit) -> int:
    """How many of a saved prompt's tokens its objects hold: whole blocks and the tail on the unit grid."""
    tail = save_tail_boundary(len(tokens), BLOCK, unit)
    return tail if tail is not None else len(tokens) // BLOCK * BLOCK


prompt_shape = st.tuples(st.integers(0, 150), st.integers(1, 60))  # (tokens shared with BASE, then fresh ones)


@settings(max_examples=150, deadline=None)
@given(
    saved=st.lists(prompt_shape, min_size=1, max_size=3),
    asked=prompt_shape,
    grid=st.sampled_from([1, 4, 8, 16, 31]),
    unit=st.sampled_from([1, 4]),
)
def test_a_hit_reaches_the_exact_common_prefix_with_the_last_saved_prompt_and_never_past_what_it_loads(
    saved, asked, grid, unit
):
    store, sources = ScriptedStore(), {}
    prompts = []
    for number, (shared, fresh) in enumerate(saved):
        tokens = BASE[:shared] + [5000 + 100 * number + i for i in range(fresh)]
        prompts.append(tokens)
        for ref in plan_save(keys_for(tokens, grid, unit)):
            sources.setdefault(ref.key, tokens)  # the first put of a key wins (objects are immutable)
        save(store, tokens, grid, unit)
    shared, fresh = asked
    prompt = BASE[:shared] + [9000 + i for i in range(fresh)]
    stored, plan = lookup(store, prompt, grid, unit)
    hit = stored.hit_tokens

    # Never past what the objects hold: each loaded object's writer shares the prompt up to the hit.
    for obj in plan.objects:
        upto = min(hit, obj.token_end)
        assert prompt[:upto] == sources[obj.key][:upto], (obj, hit)
    assert hit <= len(prompt) - 1
    # And up to the exact common prefix with the last prompt saved, when its save put the object where
    # they part (its pointers then replaced any older ones there; a save puts no object, nor pointers,
    # that an earlier one stored). At hash unit 4 a saved prompt's tail may be a prefix of this one: a
    # hit there reads no pointer (it could gain less than the grid's step).
    last = prompts[-1]
    reach = min(common_prefix(prompt, last), stored_end(last, unit), len(prompt) - 1)
    parting = [ref for ref in plan_save(keys_for(last, grid, unit)) if ref.block_index == reach // BLOCK]
    if unit == 1 and all(sources[ref.key] is last for ref in parting):
        assert hit >= reach, stored


def test_a_short_shared_prefix_inside_the_first_block_is_found_through_its_lead_pointer():
    """The commonest reuse there is: a short system prompt, shorter than the grid's first point."""
    store = ScriptedStore()
    save(store, BASE[:20] + [5] * 40, grid=16)
    stored, plan = lookup(store, BASE[:12] + [6] * 30, grid=16)
    assert stored.hit_tokens == 12 and plan.external_tokens == 12
    assert plan.objects[0].key == keys_for(BASE[:20] + [5] * 40, 16).block_key(0)


def test_a_prompt_leaving_a_stored_one_just_past_a_block_boundary_hits_there():
    store = ScriptedStore()
    save(store, BASE[:100], grid=8)
    stored, _ = lookup(store, BASE[:66] + [6] * 10, grid=8)
    assert stored.hit_tokens == 66  # 64 by the blocks, 2 more by the lead pointer at 65 and its token ids


def test_a_prompt_that_extends_a_stored_one_or_shares_nothing_reads_no_pointer():
    """A hit on the prompt's own tail relies on no pointer; an unseen prompt finds none (a lead pointer's
    key has the block's first token in it)."""
    store = ScriptedStore()
    save(store, BASE[:85], grid=8)
    reads = []

    def read(asked):
        reads.append(asked)
        return store.get(asked)

    for tokens, expected in ((BASE[:85], 84), (BASE[:85] + [6] * 10, 85), ([6] * 40, 0), (BASE[:64] + [6] * 9, 64)):
        assert find_stored_prefix(keys_for(tokens, 8), store.exists, read).hit_tokens == expected
    assert reads == []


def test_from_a_block_boundary_a_hit_goes_on_only_when_it_saves_enough_to_pay_for_the_block():
    """``extend_min_tokens``: a new block to load for a few tokens costs more than computing them; inside
    a block whose object the hit loads anyway, any gain is taken."""
    store = ScriptedStore()
    save(store, BASE[:100], grid=8)

    def hit(tokens, min_tokens):
        return lookup(store, tokens, 8, min_tokens=min_tokens)[0].hit_tokens

    assert [hit(BASE[:6] + [6] * 30, m) for m in (1, 6, 7)] == [6, 6, 0]  # from 0: a block to load
    assert [hit(BASE[:70] + [6] * 30, m) for m in (1, 6, 7)] == [70, 70, 64]  # from 64, likewise
    assert [hit(BASE[:78] + [6] * 30, m) for m in (1, 16)] == [78, 78]  # by the pointer at 72, inside the block


def test_without_lead_pointers_a_hit_inside_a_block_still_goes_on_from_its_grid_point():
    """The default at block 32 (grid 8, not past extend_min_tokens): no lead pointers, exact all the same
    from the first grid point on."""
    store, tokens = ScriptedStore(), BASE[:100]
    side, keys = worker(store, CACHES), PromptKeys.build(tokens, BLOCK, 1, NS.key_component(), ROOT, grid=8)
    transfers = tuple(save_transfer(keys, ref, ref.block_index) for ref in plan_save(keys))
    side.wait_for_save(KVToolMetadata(saves=[RequestSave("req-1", transfers, prompt_tokens=len(tokens))]))
    side.shutdown()
    assert sorted({int(key.split("/")[-2]) % BLOCK for key in store.objects if "/p/" in key}) == [8, 16, 24]
    asked = PromptKeys.build(BASE[:53] + [6] * 9, BLOCK, 1, NS.key_component(), ROOT, grid=8)
    assert find_stored_prefix(asked, store.exists, lambda k: store.get(k), 16).hit_tokens == 53


def publish(objects: dict, tokens, groups, grid=8):
    """What a save of ``tokens`` puts on a multi-group layout: every object, and each pointer's record
    with its token ids (as the worker writes them), the group's own."""
    keys = PromptKeys.build(tokens, BLOCK, 1, NS.key_component(), ROOT, groups, grid=grid)
    for ref in plan_save(keys):
        objects[ref.key] = b"object"
        for pointer in keys.pointers_inside(ref):
            ids = tuple(tokens[pointer.token_end : ref.token_end])
            record = PointerRecord(
                NS.fingerprint(),
                pointer.chain_hash,
                ref.group,
                pointer.token_end,
                ref.kind,
                ref.token_end,
                ref.chain_hash,
                ids,
            )
            objects[pointer.key] = encode_pointer(record)


def test_on_a_sliding_window_model_every_group_extends_and_the_hit_stops_where_the_shortest_does():
    groups = (CacheGroup(0, GroupKind.FULL, BLOCK), CacheGroup(1, GroupKind.SLIDING, BLOCK, window=40))
    objects: dict[str, bytes] = {}
    publish(objects, BASE[:85], groups)
    prompt = BASE[:77] + [6] * 20
    keys = PromptKeys.build(prompt, BLOCK, 1, NS.key_component(), ROOT, groups, grid=8)

    def exists(asked):
        return [key in objects for key in asked]

    def read(asked):
        return [objects.get(key) for key in asked]

    stored = find_stored_prefix(keys, exists, read)
    plan = plan_load(keys, stored, 0)
    assert stored.hit_tokens == 77 and set(stored.extended) == {0, 1}
    # The window (40 tokens) needs blocks from the one holding token 77 - 40 + 1 = 38: block 1 on.
    assert sorted((o.group, o.token_start, o.token_end) for o in plan.objects) == [
        (0, 0, 32),
        (0, 32, 64),
        (0, 64, 85),
        (1, 32, 64),
        (1, 64, 85),
    ]
    # Another prompt sharing 74 tokens, saved later, replaced the sliding group's pointer at 72 (and not,
    # say by a failed put, the full group's): the full group reaches 77, the sliding one 74.
    full_72 = keys.pointer_ref(72, 0).key
    kept = objects[full_72]
    publish(objects, BASE[:74] + [5] * 11, groups)
    objects[full_72] = kept
    assert find_stored_prefix(keys, exists, read).hit_tokens == 74
