"""``ServedIndex`` answers exactly what ``PromptKeys.serves`` does, for every length, on every layout.

A store is a random subset of what several related prompts publish (blocks, tails, states, and the
pointers of a divergence grid), so block runs have holes, tails sit at many ends and pointers lead
inside blocks: the index must agree with the per-length walk on all of them.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core.groups import CacheGroup, GroupKind
from connector.core.hashing import RequestIdentity
from connector.core.prefix import PromptKeys, plan_save
from connector.core.search import find_stored_prefix
from connector.core.served import ServedIndex

B = 8
ROOT = RequestIdentity().root_hash()
LAYOUTS = {
    "full": (CacheGroup(0, GroupKind.FULL, B),),
    "swa": (CacheGroup(0, GroupKind.FULL, B), CacheGroup(1, GroupKind.SLIDING, B, window=12)),
    "mamba": (CacheGroup(0, GroupKind.STATE, B), CacheGroup(1, GroupKind.FULL, B)),
    "swa-only": (CacheGroup(0, GroupKind.SLIDING, B, window=12),),
}


def keys_for(tokens, groups, unit, grid):
    return PromptKeys.build(tokens, B, unit, "0123456789abcdef", ROOT, groups, grid)


def published(tokens, groups, unit, grid) -> list[str]:
    keys = keys_for(tokens, groups, unit, grid)
    refs = plan_save(keys)
    pointers = [p for ref in refs for p in keys.pointers_inside(ref)]
    state_groups = [g.index for g in groups if g.kind is GroupKind.STATE]
    states = [keys.state_ref(end, g) for g in state_groups for end in range(1, len(tokens))]
    return [ref.key for ref in refs + pointers + states]


def related_store(prompt, groups, unit, grid, cuts, kept) -> set[str]:
    """A random subset of what shorter prompts sharing its start, and one going on past it, publish."""
    stored: set[str] = set()
    for cut in cuts:
        for key in published(prompt[:cut], groups, unit, grid) + published(prompt + [1, 2], groups, unit, grid):
            if kept.random() < 0.7:
                stored.add(key)
    return stored


def assert_index_is_the_walk(index, keys, present, groups, prompt):
    served = [hit for hit in range(1, len(prompt) + 1) if keys.serves(hit, present)]
    walked = (max(served, default=0), max((hit for hit in served if hit < len(prompt)), default=0))
    assert index.longest(range(0, len(prompt) + 1)) == walked
    for hit in range(0, len(prompt) + 1):
        assert index.serves(hit) == keys.serves(hit, present), hit
        for group in groups:
            if group.kind is not GroupKind.STATE and hit > 0:
                assert index.last_object(group, hit) == keys._last_object(group, hit, present), (hit, group)


STORES = dict(
    layout=st.sampled_from(sorted(LAYOUTS)),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    unit=st.sampled_from([1, 2, 3]),
    grid=st.sampled_from([0, 2, 4]),
    kept=st.randoms(use_true_random=False),
)


@settings(max_examples=150, deadline=None)
@given(**STORES)
def test_the_index_serves_exactly_the_lengths_the_walk_serves(layout, prompt, cuts, unit, grid, kept):
    groups = LAYOUTS[layout]
    keys = keys_for(prompt, groups, unit, grid)
    present = frozenset(related_store(prompt, groups, unit, grid, cuts, kept))
    assert_index_is_the_walk(ServedIndex(keys, present), keys, present, groups, prompt)


def test_a_long_prompt_with_nothing_stored_is_answered_without_walking_each_block():
    """The miss that cost 56 ms at block 256: every candidate end answered from the counts at once."""
    tokens = list(range(4000))
    keys = PromptKeys.build(tokens, 256, 1, "0123456789abcdef", ROOT, grid=64)
    found = find_stored_prefix(keys, lambda asked: [False] * len(asked))
    assert (found.tokens, found.hit_tokens) == (0, 0)


def test_a_lookup_leaves_no_reference_cycle_behind():
    """A prompt's keys are freed as soon as the lookup drops them (reference counting), not at the
    collector's next full pass: in an engine that pass is a pause, and every request's keys and refs
    would be held until it. (The index a lookup caches in the keys refers back to them weakly.)"""
    import weakref

    base = [i % 5 for i in range(120)]
    stored = set(published(base[:70], LAYOUTS["swa"], 1, 4))
    keys = keys_for(base, LAYOUTS["swa"], 1, 4)
    found = find_stored_prefix(keys, lambda asked: [key in stored for key in asked])
    assert found.tokens == 70
    assert keys.served(found.present).longest(range(121)) == (70, 70)
    gone = weakref.ref(keys)
    del keys
    assert gone() is None


@settings(max_examples=150, deadline=None)
@given(**STORES)
def test_the_index_read_off_the_stored_keys_serves_what_the_walk_serves(layout, prompt, cuts, unit, grid, kept):
    """A lookup's own case: every stored key is one the prompt's keys asked about (built), so the index
    reads the stored tails and pointers off them instead of walking each candidate end."""
    groups = LAYOUTS[layout]
    stored = related_store(prompt, groups, unit, grid, cuts, kept)
    keys = keys_for(prompt, groups, unit, grid)
    keys.probe_refs(range(1, len(prompt) + 1), blocks=True)  # what a lookup asks about, every end at once
    present = frozenset(key for key in stored if keys.ref_of(key) is not None)
    index = ServedIndex(keys, present)
    assert index._stored_inner is not None  # the path a lookup takes
    assert_index_is_the_walk(index, keys, present, groups, prompt)
