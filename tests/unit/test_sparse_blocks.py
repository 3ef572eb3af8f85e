"""A block of many candidate ends (255 at block 256 and hash unit 1) is asked by its sentinels: its tails
up to its first pointer and its pointers, then, with the pointer round, the tails past the last pointer
found (``connector.core.probes``). The hits are the ones every candidate gives, from a fraction of the keys,
and never past what the objects loaded hold."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core import probes
from connector.config import EXTEND_MIN_TOKENS, has_lead_pointers
from connector.core.hashing import RequestIdentity
from connector.core.keys import KeyKind, decode_key
from connector.core.objects import HEADER_SIZE, PointerRecord, encode_pointer
from connector.core.prefix import PromptKeys, plan_load, plan_save
from connector.core.search import find_stored_prefixes

from .scripted_store import ScriptedStore
from .test_worker import NS

ROOT = RequestIdentity().root_hash()
FINGERPRINT = NS.fingerprint()
BASE = list(range(1000, 1900))


def keys_for(tokens, block, grid):
    lead = has_lead_pointers(grid, EXTEND_MIN_TOKENS)
    return PromptKeys.build(tokens, block, 1, NS.key_component(), ROOT, grid=grid, lead_pointers=lead)


class CountingStore(ScriptedStore):
    """A dict store that counts the keys each existence query names; ``publish`` puts what a save puts:
    its objects (the first put of a key wins), then its pointer records (replacing older ones)."""

    def __init__(self):
        super().__init__()
        self.asked: list[int] = []
        self.sources: dict[str, list[int]] = {}

    def exists(self, keys):
        self.asked.append(len(keys))
        return super().exists(keys)

    def publish(self, tokens, block, grid):
        for ref in publish(self, tokens, block, grid):
            self.sources.setdefault(ref.key, tokens)


def publish(store, tokens, block, grid):
    """What a save of ``tokens`` puts into ``store``: its objects (the first put of a key wins), then its
    pointer records (replacing older ones). Returns the objects' refs."""
    keys = keys_for(tokens, block, grid)
    saved = plan_save(keys)
    store.put_many([(ref.key, b"\0" * HEADER_SIZE) for ref in saved])
    records = []
    for ref in saved:
        for p in keys.pointers_inside(ref):
            ids = tokens[p.token_end : ref.token_end]
            record = PointerRecord(
                FINGERPRINT, p.chain_hash, p.group, p.token_end, ref.kind, ref.token_end, ref.chain_hash, ids
            )
            records.append((p.key, encode_pointer(record)))
    store.put_many(records, replace=True)
    return saved


def lookup(store, prompts, block, grid, sparse_min):
    """Each prompt's stored prefix, with blocks of more than ``sparse_min`` candidates asked sparsely."""
    original = probes.SPARSE_BLOCK_MIN
    probes.SPARSE_BLOCK_MIN = sparse_min
    try:
        keys = [keys_for(tokens, block, grid) for tokens in prompts]
        return keys, find_stored_prefixes(keys, store.exists, lambda asked: store.get(asked), EXTEND_MIN_TOKENS)
    finally:
        probes.SPARSE_BLOCK_MIN = original


shape = st.tuples(st.integers(0, 700), st.integers(1, 300))  # (tokens shared with BASE, then fresh ones)


@settings(max_examples=200, deadline=None)
@given(
    saved=st.lists(shape, min_size=1, max_size=3),
    asked=st.lists(shape, min_size=1, max_size=3),
    block=st.sampled_from([128, 256]),
    grid_share=st.sampled_from([2, 4, 8]),
    evicted=st.sets(st.integers(0, 40), max_size=4),
)
def test_sentinels_find_the_hit_every_candidate_finds_and_never_more_than_the_objects_hold(
    saved, asked, block, grid_share, evicted
):
    grid = block // grid_share
    store = CountingStore()
    for number, (shared, fresh) in enumerate(saved):
        store.publish(BASE[:shared] + [5000 + 1000 * number + i for i in range(fresh)], block, grid)
    objects = sorted(key for key in store.objects if decode_key(key).kind is not KeyKind.POINTER)
    for index in evicted:  # objects evicted under their pointers: a pointer may name a missing object
        store.objects.pop(objects[index % len(objects)], None)
    prompts = [BASE[:shared] + [9000 + 1000 * n + i for i in range(fresh)] for n, (shared, fresh) in enumerate(asked)]

    _, every = lookup(store, prompts, block, grid, sparse_min=10**6)
    keys, sentinels = lookup(store, prompts, block, grid, sparse_min=probes.SPARSE_BLOCK_MIN)
    for prompt, prompt_keys, full, sparse in zip(prompts, keys, every, sentinels, strict=True):
        if not evicted:
            assert (sparse.tokens, sparse.hit_tokens) == (full.tokens, full.hit_tokens)
        for obj in plan_load(prompt_keys, sparse, 0).objects:  # never past what an object holds
            upto = min(sparse.hit_tokens, obj.token_end)
            assert prompt[:upto] == store.sources[obj.key][:upto]


@pytest.mark.parametrize("cut", [300, 333, 400, 511])
def test_a_prompt_extending_a_stored_one_inside_a_block_asks_a_fraction_of_the_keys(cut):
    """A turn extending the stored previous one, which ends at ``cut`` inside block 1 of 256: the same
    hit, with half or less of the keys of asking every candidate (a quarter of the block's: the tails up
    to the grid point after the last pointer found)."""
    store = CountingStore()
    store.publish(BASE[:cut], 256, 64)
    prompt = BASE[:cut] + list(range(20000, 20400))
    _, (full,) = lookup(store, [prompt], 256, 64, sparse_min=10**6)
    every_keys, store.asked = sum(store.asked), []
    _, (sparse,) = lookup(store, [prompt], 256, 64, sparse_min=probes.SPARSE_BLOCK_MIN)
    assert sparse.hit_tokens == full.hit_tokens == cut
    assert sum(store.asked) * 2 <= every_keys


def test_a_miss_at_block_256_asks_a_handful_of_keys_in_one_query():
    store = CountingStore()
    store.publish(BASE[:600], 256, 64)
    _, (stored,) = lookup(store, [list(range(30000, 31000))], 256, 64, sparse_min=probes.SPARSE_BLOCK_MIN)
    assert stored.hit_tokens == 0 and stored.queries == 1
    # Its 3 blocks; in block 0 and block 3, the lead pointer and its tail, the 3 grid points' pointers and
    # tails; the prompt's end in block 3: 20 keys, where every candidate is 3 + 258 + 235.
    assert store.asked == [3 + 2 * (2 + 3 * 2) + 1]


def test_a_repeated_prompt_ending_inside_a_sparse_block_is_one_query():
    store = CountingStore()
    store.publish(BASE[:700], 256, 64)
    _, (stored,) = lookup(store, [BASE[:700]], 256, 64, sparse_min=probes.SPARSE_BLOCK_MIN)
    assert stored.hit_tokens == 699 and stored.queries == 1 and len(store.asked) == 1


class QueryLog(CountingStore):
    """Keeps every existence query's keys."""

    def __init__(self):
        super().__init__()
        self.queries: list[list[str]] = []

    def exists(self, keys):
        self.queries.append(list(keys))
        return super().exists(keys)


def tail_ends(keys):
    return sorted(d.end_token for key in keys if (d := decode_key(key)).kind is KeyKind.TAIL)


def test_the_tails_past_a_pointer_start_where_the_pointer_read_stops_along_the_prompt():
    """The pointer at 640 names the stored prompt's tail (700), whose token ids go along the prompt to
    700: of the tails between that pointer and the next grid point (641-703), only those past 700 are
    asked (beside the target itself): a tail ending before where the pointer reaches adds nothing."""
    store = QueryLog()
    store.publish(BASE[:700], 256, 64)
    prompt = BASE[:700] + list(range(20000, 20300))
    _, (found,) = lookup(store, [prompt], 256, 64, sparse_min=probes.SPARSE_BLOCK_MIN)
    assert found.hit_tokens == 700
    asked = tail_ends(store.queries[-1])  # with the pointer's target: the stored tail at 700
    assert [end for end in asked if 640 < end < 704] == [700, 701, 702, 703]


def test_tails_left_out_for_an_evicted_pointer_target_are_asked_in_the_next_round():
    """A later prompt took the pointer at 640 over (it shares this one to 670 and leaves it); its object
    is evicted, so that pointer is dropped after the round that read it. The tails it made the lookup
    leave out (641-670) are asked in the next round, which finds the older stored prompt ending at 650:
    the hit every candidate finds."""
    store = QueryLog()
    store.publish(BASE[:650], 256, 64)
    newer = BASE[:670] + list(range(40000, 40030))
    store.publish(newer, 256, 64)
    newer_tail = next(ref.key for ref in plan_save(keys_for(newer, 256, 64)) if ref.kind is KeyKind.TAIL)
    del store.objects[newer_tail]
    prompt = BASE[:700] + list(range(20000, 20300))
    _, (every,) = lookup(store, [prompt], 256, 64, sparse_min=10**6)
    _, (sparse,) = lookup(store, [prompt], 256, 64, sparse_min=probes.SPARSE_BLOCK_MIN)
    assert sparse.hit_tokens == every.hit_tokens == 650
