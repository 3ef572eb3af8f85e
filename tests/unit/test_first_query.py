"""A miss is answered by the lookup's first query at every block size and prompt length (issue 38):
the first query asks a prompt's first-block sentinels (its tails up to the block's first pointer, and
that pointer), and where none is stored and its first block is not, nothing is asked again. Where
something is stored, the hit is the same as asking every candidate."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.config import EXTEND_MIN_TOKENS, has_lead_pointers
from connector.core.hashing import RequestIdentity
from connector.core.prefix import PromptKeys, plan_save
from connector.core.search import find_stored_prefixes, first_block_sentinels

from .test_worker import NS

ROOT = RequestIdentity().root_hash()


def keys_for(tokens, block, grid):
    lead = has_lead_pointers(grid, EXTEND_MIN_TOKENS)
    return PromptKeys.build(tokens, block, 1, NS.key_component(), ROOT, grid=grid, lead_pointers=lead)


def published(tokens, block, grid) -> set[str]:
    """Every key a save of ``tokens`` puts: its objects and their pointers."""
    keys = keys_for(tokens, block, grid)
    return {ref.key for obj in plan_save(keys) for ref in (obj, *keys.pointers_inside(obj))}


class CountingStore:
    def __init__(self, stored: set[str]):
        self.stored = stored
        self.queries: list[list[str]] = []

    def exists(self, keys):
        self.queries.append(list(keys))
        return [key in self.stored for key in keys]


def exhaustive(keys: PromptKeys, stored: set[str]) -> int:
    """The longest stored prefix a load can claim, from every candidate end asked at once."""
    ends = sorted(
        {e for b in range(len(keys.tokens) // keys.block_size + 1) for e in keys.inner_candidates(b)}
        | {(i + 1) * keys.block_size for i in range(keys.num_full_blocks)}
    )
    present = frozenset(ref.key for ref in keys.probe_refs(ends, blocks=True) if ref.key in stored)
    return keys.served(present).longest([*ends, len(keys.tokens), len(keys.tokens) - 1])[1] if present else 0


@pytest.mark.parametrize("block, grid", [(256, 64), (256, 8), (32, 8), (64, 16), (128, 32)])
@pytest.mark.parametrize("length", [5, 100, 255, 600, 1500])
def test_a_miss_is_one_query_beside_other_stored_prompts_in_one_batch(block, grid, length):
    others = [list(range(5000 + 1000 * n, 5000 + 1000 * n + 300)) for n in range(3)]
    store = CountingStore(set().union(*(published(tokens, block, grid) for tokens in others)))
    fresh = [list(range(50 + 3000 * n, 50 + 3000 * n + length)) for n in range(1, 5)]  # batches of four misses
    results = find_stored_prefixes([keys_for(t, block, grid) for t in fresh], store.exists)
    assert [r.hit_tokens for r in results] == [0, 0, 0, 0]
    assert len(store.queries) == 1 and all(r.queries == 1 for r in results)


def test_the_sentinels_are_a_handful_where_a_block_has_hundreds_of_candidates():
    keys = keys_for(list(range(600)), 256, 64)  # lead pointers: the first token
    assert first_block_sentinels(keys) == [1]
    keys = keys_for(list(range(600)), 32, 8)  # no lead pointers: tails up to the first grid point
    assert first_block_sentinels(keys) == list(range(1, 9))
    assert first_block_sentinels(keys_for(list(range(600)), 256, 0)) is None  # no pointers: none tell


@settings(max_examples=150, deadline=None)
@given(
    block=st.sampled_from([32, 64, 256]),
    grid_share=st.sampled_from([1, 4, 8]),
    stored_len=st.integers(1, 600),
    common=st.integers(0, 600),
    extra=st.integers(1, 40),
    batch=st.integers(1, 4),
)
def test_the_hit_is_the_one_every_candidate_gives(block, grid_share, stored_len, common, extra, batch):
    grid = block // grid_share
    stored_tokens = list(range(1000, 1000 + stored_len))
    stored = published(stored_tokens, block, grid)
    prompt = stored_tokens[: min(common, stored_len)] + [7] * extra
    # Other prompts in the batch (misses) take the first-block probe budget first.
    prompts = [list(range(90000 + 700 * n, 90000 + 700 * n + 300)) for n in range(batch - 1)] + [prompt]
    store = CountingStore(stored)
    result = find_stored_prefixes([keys_for(t, block, grid) for t in prompts], store.exists)[-1]
    assert result.hit_tokens == exhaustive(keys_for(prompt, block, grid), stored)
    if result.hit_tokens == 0 and not any(key in stored for key in store.queries[0]):
        assert len(store.queries) == 1  # a miss: one query for the whole batch
