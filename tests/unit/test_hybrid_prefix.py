"""Lookups, loads and saves on hybrid layouts: sliding-window and state groups beside full attention.

A store is a key set (pure logic). What a producer publishes comes from ``plan_save`` minus the
blocks a sliding-window group no longer held, as the scheduler side drops them.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core.groups import CacheGroup, GroupKind, describe_groups
from connector.core.hashing import RequestIdentity
from connector.core.keys import KeyKind, decode_key
from connector.core.prefix import PromptKeys, plan_load, plan_save
from connector.core.search import find_stored_prefix
from connector.core.watermarks import ObjectProgress, watermark

B = 32
ROOT = RequestIdentity().root_hash()
FULL = CacheGroup(0, GroupKind.FULL, B)
SWA = (FULL, CacheGroup(1, GroupKind.SLIDING, B, window=64))
MAMBA = (CacheGroup(0, GroupKind.STATE, B), CacheGroup(1, GroupKind.FULL, B))


def keys_for(tokens, groups, unit=1):
    return PromptKeys.build(tokens, B, unit, "0123456789abcdef", ROOT, groups)


class KeySet:
    def __init__(self):
        self.keys: set[str] = set()
        self.queries: list[int] = []

    def publish(self, tokens, groups, live_from_block=0, unit=1):
        """What a producer stores; sliding groups lose blocks below ``live_from_block`` (chunked prefill)."""
        for ref in plan_save(keys_for(tokens, groups, unit)):
            kind = groups[ref.group].kind
            if kind is GroupKind.SLIDING and ref.block_index < live_from_block:
                continue
            self.keys.add(ref.key)

    def drop(self, predicate):
        self.keys = {key for key in self.keys if not predicate(decode_key(key))}

    def exists(self, keys):
        self.queries.append(len(keys))
        return [k in self.keys for k in keys]


def lookup(store, tokens, groups, local=0):
    keys = keys_for(tokens, groups)
    stored = find_stored_prefix(keys, store.exists)
    return stored, plan_load(keys, stored, local)


def tokens(seed, n):
    return [1000 + (seed * 7919 + i * 31) % 5000 for i in range(n)]


def test_keys_name_their_group_and_a_state_has_its_own_kind():
    keys = keys_for(tokens(1, 85), MAMBA)
    saves = plan_save(keys)
    assert [(s.group, s.kind, s.token_end) for s in saves] == [
        (1, KeyKind.BLOCK, 32),
        (1, KeyKind.BLOCK, 64),
        (1, KeyKind.TAIL, 85),
        (0, KeyKind.STATE, 85),
    ]
    decoded = decode_key(saves[-1].key)
    assert (decoded.group, decoded.kind, decoded.end_token) == (0, KeyKind.STATE, 85)
    assert saves[-1].block_index == 2  # the state after 85 tokens lives in the block of token 84


def test_sliding_window_extension_hits_the_whole_prompt_and_loads_only_the_window():
    store = KeySet()
    base = tokens(2, 150)
    store.publish(base, SWA)
    stored, plan = lookup(store, base + tokens(3, 20), SWA)
    assert stored.hit_tokens == 150 and plan.external_tokens == 150
    sliding = [o for o in plan.objects if o.group == 1]
    # window 64 before 150: tokens 87.. are attended, so blocks 2 (64-95), 3 and the tail block 4
    assert [o.block_index for o in sliding] == [2, 3, 4]
    assert [o.block_index for o in plan.objects if o.group == 0] == [0, 1, 2, 3, 4]


def test_a_sliding_window_that_lost_its_early_blocks_still_serves_hits_past_them():
    store = KeySet()
    base = tokens(4, 200)
    store.publish(base, SWA, live_from_block=3)  # blocks 0-2 were freed before the save
    stored, _ = lookup(store, base + tokens(5, 9), SWA)
    assert stored.hit_tokens == 200
    # A prompt that shares only the first 70 tokens would need the window at 70: blocks 0-2, gone.
    stored, plan = lookup(store, base[:70] + tokens(6, 40), SWA)
    assert plan.external_tokens == 0 and stored.hit_tokens == 0


def test_a_missing_object_of_one_group_drops_the_hit_to_what_every_group_holds():
    store = KeySet()
    base = tokens(7, 100)
    store.publish(base, SWA)
    store.drop(lambda d: d.group == 1 and d.kind is KeyKind.TAIL)
    stored, plan = lookup(store, base + tokens(8, 5), SWA)
    assert stored.hit_tokens == 96  # the full blocks; the tail is only half there
    assert all(o.kind is KeyKind.BLOCK for o in plan.objects)


def test_a_state_group_hits_only_where_a_state_was_saved():
    store = KeySet()
    base = tokens(9, 85)
    store.publish(base, MAMBA)
    stored, plan = lookup(store, base + tokens(10, 7), MAMBA)
    assert stored.hit_tokens == 85
    assert [(o.group, o.kind, o.block_index) for o in plan.objects if o.group == 0] == [(0, KeyKind.STATE, 2)]
    # The prompt itself: a hit must leave one token to compute, and no state exists at 84.
    stored, plan = lookup(store, base, MAMBA)
    assert stored.tokens == 85 and stored.hit_tokens == 0 and plan.external_tokens == 0


def test_a_state_inside_an_earlier_block_is_found_by_the_second_query():
    """The stored prompt ends blocks before the new one does: its blocks stop there, and the second
    query finds the state at its end although no block boundary has a state."""
    store = KeySet()
    base = tokens(30, 150)
    store.publish(base, MAMBA)
    stored, plan = lookup(store, base + tokens(31, 100), MAMBA)
    assert stored.queries == 2 and stored.hit_tokens == 150 and plan.external_tokens == 150


def test_without_its_state_the_attention_blocks_are_no_hit():
    store = KeySet()
    base = tokens(11, 85)
    store.publish(base, MAMBA)
    store.drop(lambda d: d.kind is KeyKind.STATE)
    stored, plan = lookup(store, base + tokens(12, 7), MAMBA)
    assert stored.hit_tokens == 0 and plan.objects == ()


def test_a_local_hit_is_never_claimed_and_its_blocks_never_loaded():
    store = KeySet()
    base = tokens(13, 150)
    store.publish(base, SWA)
    _, plan = lookup(store, base + tokens(14, 3), SWA, local=64)
    assert plan.local_tokens == 64 and plan.external_tokens == 86
    assert min(o.block_index for o in plan.objects) == 2


def test_hybrid_lookups_take_at_most_two_queries():
    store = KeySet()
    store.publish(tokens(15, 40), SWA)
    store.publish(tokens(16, 85), MAMBA)
    stored, _ = lookup(store, tokens(15, 40) + tokens(17, 60), SWA)  # inside block 1: a second query
    assert stored.hit_tokens == 40 and stored.queries == 2 and len(store.queries) == 2


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(2, 300),
    shared=st.integers(1, 300),
    extra=st.integers(1, 40),
    layout=st.sampled_from(["swa", "mamba", "full"]),
)
def test_a_hit_never_claims_an_unstored_token_and_every_group_serves_it(length, shared, extra, layout):
    groups = {"swa": SWA, "mamba": MAMBA, "full": (FULL,)}[layout]
    store = KeySet()
    base = tokens(20, length)
    store.publish(base, groups)
    shared = min(shared, length)
    query = base[:shared] + tokens(21, extra)
    stored, plan = lookup(store, query, groups)
    hit = plan.external_tokens
    assert hit <= min(shared, len(query) - 1)
    if hit:
        keys = keys_for(query, groups)
        assert all(o.key in store.keys for o in plan.objects)
        assert all(keys.objects_for(g, hit, stored.present) is not None for g in groups)
    if layout != "mamba":  # attention only: the longest stored boundary the prompts share is reused
        boundaries = [b for b in [*range(B, length + 1, B), length] if b <= shared]
        assert hit == max(boundaries, default=0)
    else:  # a state only after the whole stored prompt: all of it, or nothing
        assert hit == (length if length <= shared else 0)


def test_group_descriptions_name_the_layout_and_plain_models_keep_none():
    assert describe_groups((FULL,)) == ""
    assert describe_groups(SWA) == "full:32;sliding:32:64"


def test_a_watermark_is_the_smallest_durable_offset_over_the_groups():
    def progress(kind, start, end, outcome, group):
        return ObjectProgress(kind, start, end, outcome, group)

    objects = [
        progress(KeyKind.BLOCK, 0, 32, "stored", 0),
        progress(KeyKind.BLOCK, 32, 64, "stored", 0),
        progress(KeyKind.BLOCK, 32, 64, "stored", 1),  # a sliding group: its saved blocks start later
        progress(KeyKind.TAIL, 64, 85, "stored", 0),
        progress(KeyKind.TAIL, 64, 85, "no_space", 1),
    ]
    record = watermark("r", None, 85, objects, 0.0)
    assert (record.durable_offset, record.tail_boundary, record.tail_durable) == (64, 85, False)
    stored = [*objects[:4], progress(KeyKind.TAIL, 64, 85, "stored", 1)]
    assert watermark("r", None, 85, stored, 0.0).durable_offset == 85
    with_state = [*stored, progress(KeyKind.STATE, 0, 85, "failed", 2)]
    assert watermark("r", None, 85, with_state, 0.0).durable_offset == 0
    stated = [*stored, progress(KeyKind.STATE, 0, 85, "stored", 2)]
    assert watermark("r", None, 85, stated, 0.0).durable_offset == 85


def test_a_hybrid_watermark_stops_only_where_every_state_group_has_a_state():
    """A state group serves a hit only at a stored state's exact end: where the tail failed, the
    attention groups are durable to 64, but with no state at 64 in the save nothing is (not 64)."""

    def progress(kind, start, end, outcome, group):
        return ObjectProgress(kind, start, end, outcome, group)

    blocks = [progress(KeyKind.BLOCK, 0, 32, "stored", 0), progress(KeyKind.BLOCK, 32, 64, "stored", 0)]
    tail_failed = [*blocks, progress(KeyKind.TAIL, 64, 85, "no_space", 0)]
    state_85 = progress(KeyKind.STATE, 0, 85, "stored", 1)
    assert watermark("r", None, 85, [*tail_failed, state_85], 0.0).durable_offset == 0
    state_64 = progress(KeyKind.STATE, 0, 64, "present", 1)
    assert watermark("r", None, 85, [*tail_failed, state_64, state_85], 0.0).durable_offset == 64
    # Two state groups: the furthest end both hold.
    other_64 = progress(KeyKind.STATE, 0, 64, "stored", 2)
    whole = [*blocks, progress(KeyKind.TAIL, 64, 85, "stored", 0), state_64, state_85, other_64]
    assert watermark("r", None, 85, whole, 0.0).durable_offset == 64
    assert watermark("r", None, 85, [*whole, progress(KeyKind.STATE, 0, 85, "stored", 2)], 0.0).durable_offset == 85
    # States only (no attention group): the furthest state every state group holds.
    assert watermark("r", None, 85, [state_64, state_85], 0.0).durable_offset == 85
    # A state group with no object in the save at all (its block was not held): nothing is durable.
    stored_tail = [*blocks, progress(KeyKind.TAIL, 64, 85, "stored", 0)]
    assert watermark("r", None, 85, stored_tail, 0.0, state_groups=(1,)).durable_offset == 0
    assert watermark("r", None, 85, [*stored_tail, state_85], 0.0, state_groups=(1,)).durable_offset == 85
    assert watermark("r", None, 85, stored_tail, 0.0).durable_offset == 85  # a plain model: no state group


def alone_and_batched(store, prompt, groups=MAMBA):
    """``prompt``'s lookup alone, and as the fourth prompt of a batch (past the batch's first-block probe
    budget, ``search._first_block_probes``): (alone, batched)."""
    from connector.core.search import find_stored_prefixes

    batch = [keys_for(list(range(5000 + 100 * i, 5060 + 100 * i)), groups) for i in range(3)]
    alone = find_stored_prefix(keys_for(prompt, groups), store.exists)
    return alone, find_stored_prefixes([*batch, keys_for(prompt, groups)], store.exists)[-1]


def test_a_batched_lookup_finds_a_hit_inside_a_first_block_whose_end_has_no_state():
    """A batch asks most prompts' first-block candidates only in its second query: where the first
    block is stored but its end serves no hit (no state there), those candidates are asked then, so
    every prompt of the batch finds what it would alone."""
    tokens = list(range(2000, 2100))
    store = KeySet()
    store.publish(tokens[:10], MAMBA)  # a sub-block prompt: its tail and state at 10
    store.publish(tokens[:80], MAMBA)  # blocks 0 and 1, a tail and a state at 80: no state at 32
    alone, batched = alone_and_batched(store, tokens[:32] + list(range(9000, 9020)))
    assert (alone.tokens, alone.hit_tokens) == (10, 10)
    assert (batched.tokens, batched.hit_tokens) == (10, 10)


def test_a_batched_lookup_of_a_one_block_prompt_finds_the_hit_short_of_it():
    """Its first block is stored and served, but a hit must stop short of the prompt, where no state is:
    the hit inside the block, as alone."""
    tokens = list(range(3000, 3100))
    store = KeySet()
    store.publish(tokens[:16], MAMBA)
    store.publish(tokens[:32], MAMBA)
    alone, batched = alone_and_batched(store, tokens[:32])
    assert (alone.tokens, alone.hit_tokens) == (32, 16)
    assert (batched.tokens, batched.hit_tokens) == (32, 16)


def test_a_batched_mamba_lookup_with_a_whole_block_hit_asks_nothing_more():
    """A hit of a whole block or more found by the first query: the first block's ends are not asked
    (they cannot make a longer hit), so a repeated prompt still takes one query."""
    tokens = list(range(4000, 4100))
    store = KeySet()
    store.publish(tokens[:99], MAMBA)  # the prompt less its last token: its state is the hit's
    _, batched = alone_and_batched(store, tokens)
    assert (batched.tokens, batched.hit_tokens, batched.queries) == (99, 99, 1)
