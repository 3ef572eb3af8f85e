"""Lookup and save planning against a dict-backed key set (pure logic, no store)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core.hashing import RequestIdentity
from connector.core.keys import KeyKind
from connector.core.prefix import PromptKeys, plan_load, plan_save
from connector.core.search import find_stored_prefix

B = 32
ROOT = RequestIdentity().root_hash()


def keys_for(tokens, unit=1, root=ROOT):
    return PromptKeys.build(tokens, B, unit, "0123456789abcdef", root)


class KeySet:
    def __init__(self):
        self.keys: set[str] = set()
        self.queries: list[int] = []

    def publish(self, tokens, unit=1, root=ROOT):
        self.keys.update(s.key for s in plan_save(keys_for(tokens, unit, root)))

    def exists(self, keys):
        self.queries.append(len(keys))
        return [k in self.keys for k in keys]


def hit(store, tokens, local=0, unit=1, root=ROOT):
    keys = keys_for(tokens, unit, root)
    return plan_load(keys, find_stored_prefix(keys, store.exists), local)


PROMPT = list(range(1000, 1200))


def test_sub_block_prompt_extended_hits_the_whole_prompt_as_tail():
    store = KeySet()
    store.publish(PROMPT[:20])
    plan = hit(store, PROMPT[:50])
    assert (plan.external_tokens, plan.block_tokens, plan.tail_tokens) == (20, 0, 20)
    assert [o.kind for o in plan.objects] == [KeyKind.TAIL]


def test_cross_block_prompt_extended_hits_blocks_plus_tail():
    store = KeySet()
    store.publish(PROMPT[:85])
    plan = hit(store, PROMPT[:120])
    assert (plan.external_tokens, plan.block_tokens, plan.tail_tokens) == (85, 64, 21)
    assert [o.kind for o in plan.objects] == [KeyKind.BLOCK, KeyKind.BLOCK, KeyKind.TAIL]
    assert store.queries == [3 + 24 + 31, 31]  # blocks + last- and first-block tails, then block 2's tails


def test_a_miss_and_a_sub_block_hit_take_one_query():
    """The first query asks for the first block's tails too: a miss (nothing stored) and a prompt
    extending a stored sub-block one are answered by it alone."""
    store = KeySet()
    assert hit(store, PROMPT[:120]).external_tokens == 0
    assert store.queries == [3 + 24 + 31]
    store.publish(PROMPT[:20])
    store.queries.clear()
    assert hit(store, PROMPT[:120]).external_tokens == 20
    assert len(store.queries) == 1


def test_a_batch_asks_the_first_block_candidates_first_for_its_first_prompts_only():
    """Beyond two 1k-token prompts (31 first-block ends each), a batch's prompts ask for their first
    block's candidates in the second query, where that block is not stored: the same hits, fewer keys."""
    from connector.core.search import find_stored_prefixes

    store = KeySet()
    store.publish(PROMPT[:20])  # a stored sub-block prompt: three later prompts extend it
    prompts = [keys_for(PROMPT[:120]) for _ in range(3)] + [keys_for(list(range(5000, 5120)))]
    found = find_stored_prefixes(prompts, store.exists)
    assert [stored.hit_tokens for stored in found] == [20, 20, 20, 0]
    assert [stored.queries for stored in found] == [1, 1, 2, 2]
    # The first query: every prompt's 3 blocks and 24 last-block tails, and two prompts' 31 first-block
    # tails (the first three prompts share their keys); the second, the other prompts' first-block tails.
    assert store.queries == [3 + 24 + 31 + 3 + 24, 31 + 31]


def test_repeated_prompt_hits_in_one_query_leaving_one_token():
    store = KeySet()
    store.publish(PROMPT[:85])
    plan = hit(store, PROMPT[:85])
    assert plan.external_tokens == 84
    assert len(store.queries) == 1


def test_local_blocks_are_never_claimed():
    store = KeySet()
    store.publish(PROMPT[:85])
    plan = hit(store, PROMPT[:85], local=64)
    assert (plan.local_tokens, plan.external_tokens, plan.block_tokens, plan.tail_tokens) == (64, 20, 0, 20)
    assert [o.block_index for o in plan.objects] == [2]
    assert hit(store, PROMPT[:85], local=96 - 32).external_tokens == 20


def test_local_hit_at_or_beyond_the_store_loads_nothing():
    store = KeySet()
    store.publish(PROMPT[:40])
    assert hit(store, PROMPT[:100], local=64).external_tokens == 0


def test_block_aligned_repeat_claims_all_but_the_last_token():
    store = KeySet()
    store.publish(PROMPT[:64])
    plan = hit(store, PROMPT[:64])
    assert (plan.external_tokens, plan.block_tokens, plan.tail_tokens) == (63, 63, 0)
    assert [o.kind for o in plan.objects] == [KeyKind.BLOCK, KeyKind.BLOCK]


def test_unknown_prompt_and_different_salt_miss():
    store = KeySet()
    store.publish(PROMPT[:85])
    assert hit(store, list(range(5000, 5100))).external_tokens == 0
    assert hit(store, PROMPT[:120], root=RequestIdentity(cache_salt="other").root_hash()).external_tokens == 0


def test_divergence_inside_the_tail_stops_the_hit_at_the_stored_shorter_tail():
    store = KeySet()
    store.publish(PROMPT[:70])
    store.publish(PROMPT[:80])
    changed = PROMPT[:75] + [1] + PROMPT[76:120]
    assert hit(store, changed).external_tokens == 70


def test_hash_unit_grid():
    store = KeySet()
    store.publish(PROMPT[:85], unit=8)  # tail stored at 80
    plan = hit(store, PROMPT[:120], unit=8)
    assert plan.external_tokens == 80


def test_single_token_prompt_never_hits():
    store = KeySet()
    store.publish(PROMPT[:1])
    assert hit(store, PROMPT[:1]).external_tokens == 0


@settings(max_examples=200, deadline=None)
@given(
    published=st.lists(st.integers(1, 150), min_size=0, max_size=4),
    length=st.integers(1, 200),
    unit=st.sampled_from([1, 4, 8]),
    local_blocks=st.integers(0, 6),
    diverge_at=st.one_of(st.none(), st.integers(0, 199)),
)
def test_hit_equals_the_oracle(published, length, unit, local_blocks, diverge_at):
    """The planned hit equals the brute-force longest common prefix with any published prompt."""
    store = KeySet()
    prompts = [PROMPT[:n] for n in published]
    for prompt in prompts:
        store.publish(prompt, unit)
    query = list(PROMPT[:length])
    if diverge_at is not None and diverge_at < length:
        query[diverge_at] = 7
    local = min(local_blocks * B, (length - 1) // B * B)

    def reusable(prompt):
        common = 0
        while common < min(len(prompt), len(query)) and prompt[common] == query[common]:
            common += 1
        # Stored boundaries: full blocks of the prompt, and its tail on the unit grid.
        best = common // B * B
        tail = len(prompt) // unit * unit
        if tail <= common and tail % B and tail // B == len(prompt) // B:
            best = max(best, tail)
        return best

    ideal = max([reusable(p) for p in prompts], default=0)
    ideal = min(ideal, length - 1)
    expected = max(0, ideal - local)
    plan = hit(store, query, local=local, unit=unit)
    assert plan.external_tokens == expected
    assert plan.block_tokens + plan.tail_tokens == plan.external_tokens
    covered = {o.block_index for o in plan.objects}
    if expected:
        assert covered == set(range(local // B, (local + expected - 1) // B + 1))


@given(
    tokens=st.lists(st.integers(0, 50_000), min_size=2, max_size=200),
    grid=st.sampled_from([1, 4, 8, 32]),
    lead=st.booleans(),
    asked_first=st.booleans(),
)
def test_a_saves_pointer_hashes_are_the_tail_hashes_of_their_boundaries(tokens, grid, lead, asked_first):
    """A save takes only its pointers' hashes (not every boundary of their blocks, as a lookup does);
    they must be the very hashes a lookup computes for those boundaries, in either order of asking."""
    from connector.core.hashing import tail_hash

    keys = PromptKeys.build(tokens, 32, 1, "ns", ROOT, grid=grid, lead_pointers=lead)
    if asked_first and len(tokens) % 32:
        keys.tail_hash(len(tokens))  # a lookup's probe of the last block first
    for ref in plan_save(keys):
        hashes = keys.pointer_hashes(ref)
        parent = keys.parent_of_block(ref.block_index)
        assert hashes == [(end, tail_hash(tokens, end, 32, parent)) for end, _ in hashes]
        assert [p.key for p in keys.pointers_inside(ref)] == [keys.pointer_ref(end).key for end, _ in hashes]
