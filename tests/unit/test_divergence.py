"""Divergence points: a prompt that leaves a stored one inside a block or a tail hits their common
prefix (on the divergence grid) through a pointer, and loads the object the pointer names."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.data import KVToolMetadata, RequestLoad, RequestSave
from connector.core.groups import CacheGroup, GroupKind
from connector.core.hashing import RequestIdentity
from connector.core.keys import KeyKind
from connector.core.objects import PointerRecord, encode_pointer
from connector.core.prefix import PromptKeys, plan_load, plan_save
from connector.core.search import find_stored_prefix
from connector.core.objects import pointer_size
from connector.core.saveplans import save_transfer
from connector.store.store import PutOutcome

from .scripted_store import ScriptedStore
from .test_worker import BLOCK, LAYERS, NS, kv_caches, worker

ROOT = RequestIdentity().root_hash()
STORED = list(range(1000, 1085))  # 85 tokens: blocks ending at 32 and 64, a tail ending at 85


def keys_for(tokens, grid=1, unit=1):
    return PromptKeys.build(tokens, BLOCK, unit, NS.key_component(), ROOT, grid=grid)


def published(tokens, grid=1, unit=1) -> set[str]:
    """Every key a save of ``tokens`` puts: its objects and their pointers."""
    keys = keys_for(tokens, grid, unit)
    return {ref.key for obj in plan_save(keys) for ref in (obj, *keys.pointers_inside(obj))}


def diverging(common: int, length: int) -> list[int]:
    return STORED[:common] + [7] * (length - common)


def found(stored: set[str], tokens, grid=1, unit=1):
    return find_stored_prefix(keys_for(tokens, grid, unit), lambda keys: [k in stored for k in keys])


@pytest.mark.parametrize(
    "common, length",
    [(50, 70), (50, 60), (70, 80), (70, 100), (5, 40), (31, 40)],
    ids=["in-block-longer", "in-block-shorter", "in-tail", "in-tail-longer", "first-block", "one-short-of-a-block"],
)
def test_a_prompt_leaving_a_stored_one_inside_an_object_hits_exactly_the_common_prefix(common, length):
    stored = published(STORED)
    prefix = found(stored, diverging(common, length))
    assert prefix.hit_tokens == common
    assert prefix.queries <= 2


def test_the_grid_rounds_the_hit_down_and_no_grid_finds_only_whole_blocks():
    assert found(published(STORED, grid=8), diverging(50, 70), grid=8).hit_tokens == 48
    assert found(published(STORED, grid=8), diverging(70, 80), grid=8).hit_tokens == 64  # 72 > 70: the block
    assert found(published(STORED, grid=0), diverging(50, 70), grid=0).hit_tokens == 32


@settings(max_examples=200, deadline=None)
@given(
    stored_len=st.integers(2, 140),
    common=st.integers(0, 140),
    extra=st.integers(0, 40),
    grid=st.sampled_from([1, 3, 4, 16]),
)
def test_the_hit_is_the_longest_stored_boundary_within_the_common_prefix(stored_len, common, extra, grid):
    stored_tokens = STORED[:stored_len] if stored_len <= len(STORED) else list(range(1000, 1000 + stored_len))
    common = min(common, stored_len)
    prompt = stored_tokens[:common] + [7] * extra
    if len(prompt) < 2:
        return
    # What the store can serve: any block end, the stored tail's end, a grid multiple inside either.
    ends = {e for e in range(1, stored_len + 1) if e % BLOCK == 0 or e == stored_len or e % grid == 0}
    within = [e for e in ends if e <= common and e < len(prompt)]
    if common == len(prompt) in ends:  # the prompt is a stored prefix: all of it but the token to compute
        within.append(len(prompt) - 1)
    assert found(published(stored_tokens, grid), prompt, grid).hit_tokens == max(within, default=0)


def test_a_load_plan_through_a_pointer_claims_only_the_common_prefix():
    stored = published(STORED)
    keys = keys_for(diverging(70, 80))
    plan = plan_load(keys, find_stored_prefix(keys, lambda ks: [k in stored for k in ks]), 32)
    assert plan.external_tokens == 38
    assert [(o.kind, o.token_start, o.token_end) for o in plan.objects] == [
        (KeyKind.BLOCK, 32, 64),
        (KeyKind.POINTER, 64, 70),
    ]


def save_with_pointers(store, caches, tokens, blocks, grid=1):
    keys = keys_for(tokens, grid)
    side = worker(store, caches)
    transfers = tuple(save_transfer(keys, ref, blocks[ref.block_index]) for ref in plan_save(keys))
    side.wait_for_save(KVToolMetadata(saves=[RequestSave("req-1", transfers, prompt_tokens=len(tokens))]))
    side.shutdown()


def resolved_lookup(store, tokens, grid=1):
    keys = keys_for(tokens, grid)
    stored = find_stored_prefix(keys, store.exists, lambda asked: store.get(asked, pointer_size(BLOCK)))
    return stored, plan_load(keys, stored, 0)


def test_a_lookup_reads_the_pointer_and_the_load_reads_the_object_it_names():
    store, source = ScriptedStore(), kv_caches("random")
    save_with_pointers(store, source, STORED, (3, 5, 1))
    stored, plan = resolved_lookup(store, diverging(70, 80))
    assert (stored.hit_tokens, stored.queries) == (70, 3)  # one existence query, then a read and a check
    last = plan.objects[-1]
    assert (last.kind, last.token_start, last.token_end, last.key) == (
        KeyKind.TAIL,
        64,
        85,
        keys_for(STORED).tail_key(85),
    )
    assert (plan.block_tokens, plan.tail_tokens) == (64, 6)
    target = kv_caches("zeros")
    loader = worker(store, target, saves=False)
    transfers = tuple(
        save_transfer(keys_for(STORED), ref, block) for ref, block in zip(plan.objects, (7, 2, 6), strict=True)
    )
    loader.start_load_kv(KVToolMetadata(loads=[RequestLoad("req-2", transfers)]))
    assert loader.get_finished() == ({"req-2"}, set())
    assert all(torch.equal(source[name][1], target[name][6]) for name in LAYERS)  # the tail's whole block


def test_a_pointer_into_a_full_block_names_the_block():
    store = ScriptedStore()
    save_with_pointers(store, kv_caches("random"), STORED, (3, 5, 1))
    stored, plan = resolved_lookup(store, diverging(50, 70))
    assert stored.hit_tokens == 50
    assert [(o.kind, o.token_end) for o in plan.objects] == [(KeyKind.BLOCK, 32), (KeyKind.BLOCK, 64)]
    assert (plan.block_tokens, plan.tail_tokens) == (50, 0)  # all of it from full-block objects


def forged(record: PointerRecord, **changes) -> bytes:
    fields = {**record.__dict__, **changes}
    return encode_pointer(PointerRecord(**fields))


@pytest.mark.parametrize(
    "change",
    [
        {"namespace_fingerprint": b"X" * 16},
        {"chain_hash": b"\0" * 16},
        {"target_end": 70},  # ends before the pointer
        {"target_end": 97},  # past its block
        {"target_kind": KeyKind.BLOCK},  # a block that does not end at the block's end
        {"target_hash": b"\1" * 16},  # names an object that is not stored
        {"token_ids": ()},  # token ids that do not cover the object from the boundary on
        "bit-flip",  # a stored record spoiled after its checksum was taken
        "forged-ids",  # well formed, but ids the object's key was not hashed from (they match the prompt)
    ],
    ids=["namespace", "prefix-hash", "before", "past-block", "kind", "not-stored", "ids", "bit-flip", "forged-ids"],
)
def test_a_bad_pointer_is_no_hit_and_the_lookup_falls_back(change):
    store = ScriptedStore()
    save_with_pointers(store, kv_caches("random"), STORED, (3, 5, 1), grid=8)
    keys, tail = keys_for(STORED, grid=8), keys_for(STORED).tail_ref(85)
    for boundary in (72, 80):  # every pointer into the tail (no block-start pointers at this grid)
        pointer = keys.pointer_ref(boundary)
        good = PointerRecord(
            NS.fingerprint(),
            pointer.chain_hash,
            0,
            boundary,
            KeyKind.TAIL,
            85,
            tail.chain_hash,
            tuple(STORED[boundary:85]),
        )
        assert store.objects[pointer.key] == encode_pointer(good)
        if change == "bit-flip":
            spoiled = bytearray(encode_pointer(good))
            spoiled[-8] ^= 1  # a token id
            store.objects[pointer.key] = bytes(spoiled)
        elif change == "forged-ids":
            store.objects[pointer.key] = forged(good, token_ids=(7,) * len(good.token_ids))
        else:
            store.objects[pointer.key] = forged(good, **change)
    stored, plan = resolved_lookup(store, diverging(75, 90), grid=8)
    assert stored.hit_tokens == 64 and keys.pointer_ref(72).key not in stored.present
    assert all(o.kind is KeyKind.BLOCK for o in plan.objects)


def test_a_pointer_whose_object_was_evicted_is_no_hit():
    store = ScriptedStore()
    save_with_pointers(store, kv_caches("random"), STORED, (3, 5, 1), grid=8)
    del store.objects[keys_for(STORED).tail_key(85)]  # pointers are small: they may outlive their object
    assert resolved_lookup(store, diverging(75, 90), grid=8)[0].hit_tokens == 64


def test_pointers_are_put_after_their_object_and_not_when_its_put_fails():
    store, source = ScriptedStore(), kv_caches("random")
    store.put_outcome_for = lambda key: PutOutcome.FAILED if "/t/" in key else PutOutcome.STORED
    save_with_pointers(store, source, STORED, (3, 5, 1))
    pointers = sorted(int(key.split("/")[-2]) for key in store.objects if "/p/" in key)
    assert pointers == [e for e in range(1, 64) if e % BLOCK]  # the blocks' pointers, none of the tail's


def hybrid_published(tokens, groups, states=()):
    """Every key a save of ``tokens`` puts on a hybrid layout, plus state checkpoints at ``states``."""
    keys = PromptKeys.build(tokens, BLOCK, 1, NS.key_component(), ROOT, groups, grid=1)
    stored = {ref.key for obj in plan_save(keys) for ref in (obj, *keys.pointers_inside(obj))}
    return stored | {keys.state_ref(end, g.index).key for end in states for g in groups if g.kind is GroupKind.STATE}


def hybrid_hit(stored, tokens, groups):
    keys = PromptKeys.build(tokens, BLOCK, 1, NS.key_component(), ROOT, groups, grid=1)
    return find_stored_prefix(keys, lambda ks: [k in stored for k in ks]).hit_tokens


def test_a_sliding_window_model_finds_divergence_points_in_every_group():
    groups = (CacheGroup(0, GroupKind.FULL, BLOCK), CacheGroup(1, GroupKind.SLIDING, BLOCK, window=64))
    stored = hybrid_published(STORED, groups)
    assert hybrid_hit(stored, diverging(70, 80), groups) == 70
    # Without the sliding group's pointer at 70 the full-attention one alone is no hit there: the
    # hit is the next point both groups serve.
    keys = PromptKeys.build(STORED, BLOCK, 1, NS.key_component(), ROOT, groups, grid=1)
    assert hybrid_hit(stored - {keys.pointer_ref(70, 1).key}, diverging(70, 80), groups) == 69


def test_on_a_mamba_model_a_divergence_point_is_a_hit_only_where_a_state_is_stored():
    groups = (CacheGroup(0, GroupKind.STATE, BLOCK), CacheGroup(1, GroupKind.FULL, BLOCK))
    # States after the whole prompt and at the block boundaries vLLM retained (32, 64).
    stored = hybrid_published(STORED, groups, states=(32, 64))
    assert hybrid_hit(stored, diverging(70, 80), groups) == 64  # pointers at 70, but no state there
    assert hybrid_hit(hybrid_published(STORED, groups, states=(32, 64, 70)), diverging(70, 80), groups) == 70


def test_a_failed_pointer_read_costs_only_the_pointer_hits_of_its_batch():
    from connector.calls import StoreError
    from connector.core.search import find_stored_prefixes

    store = ScriptedStore()
    save_with_pointers(store, kv_caches("random"), STORED, (3, 5, 1), grid=8)

    def failing_read(keys):
        raise StoreError("pointer read timed out after 2 s")

    extending, leaving = keys_for(STORED + [7, 8, 9], grid=8), keys_for(diverging(75, 90), grid=8)
    found = find_stored_prefixes([extending, leaving], store.exists, failing_read)
    assert [prefix.hit_tokens for prefix in found] == [85, 64]  # the extension keeps its tail hit
    # Only the prompt whose hit relied on a pointer says its read failed (its hit details carry it).
    assert [prefix.pointer_read_failed for prefix in found] == [False, True]


def test_a_new_save_replaces_a_pointer_whose_object_is_gone():
    store = ScriptedStore()
    save_with_pointers(store, kv_caches("random"), STORED, (3, 5, 1), grid=8)
    del store.objects[keys_for(STORED).tail_key(85)]  # evicted; its pointer at 72 stays
    assert resolved_lookup(store, diverging(75, 90), grid=8)[0].hit_tokens == 64
    other = STORED[:80] + [5] * 10  # shares the first 80 tokens: a tail ending at 90, a pointer at 72 too
    save_with_pointers(store, kv_caches("random"), other, (3, 5, 2), grid=8)
    stored, plan = resolved_lookup(store, diverging(75, 90), grid=8)
    assert stored.hit_tokens == 75  # the new pointers' token ids: the exact divergence point
    assert plan.objects[-1].key == keys_for(other).tail_key(90)
