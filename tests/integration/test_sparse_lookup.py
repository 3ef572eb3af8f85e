"""A lookup at block 256 against a real mooncake_master, through the store stack: a block is asked by its
pointers (``connector.core.probes``), and the hits are those of asking every candidate, from fewer keys."""

from __future__ import annotations

import random

import pytest

from connector.core import probes
from tests.unit.test_sparse_blocks import lookup, publish

pytestmark = pytest.mark.integration

BLOCK, GRID = 256, 64


class Counted:
    """The store's calls a lookup makes, counting the keys its existence queries name."""

    def __init__(self, store):
        self.store, self.asked = store, 0

    def exists(self, keys):
        self.asked += len(keys)
        return self.store.exists(keys)

    def get(self, keys):
        return self.store.get(keys)


def test_hits_inside_blocks_and_a_miss_match_every_candidate_on_a_real_store(store):
    rng = random.Random(256)
    base = [rng.randrange(10, 30000) for _ in range(700)]
    answer = [rng.randrange(10, 30000) for _ in range(40)]
    publish(store, base[:333], BLOCK, GRID)  # a turn ending inside block 1
    publish(store, base[:333] + answer, BLOCK, GRID)  # its answer, saved at request end
    publish(store, base[:600], BLOCK, GRID)  # a longer prompt sharing the first 333 tokens
    prompts = [
        base[:333] + answer + [7] * 300,  # the next turn: prompt and answer reused
        base[:333] + [rng.randrange(10, 30000) for _ in range(200)],  # leaves the stored ones at 333
        base[:500] + [9] * 50,  # leaves the longer prompt inside block 1, at 500
        [rng.randrange(10, 30000) for _ in range(900)],  # shares nothing: a miss
    ]
    every, sparse = Counted(store), Counted(store)
    _, full = lookup(every, prompts, BLOCK, GRID, sparse_min=10**6)
    _, found = lookup(sparse, prompts, BLOCK, GRID, sparse_min=probes.SPARSE_BLOCK_MIN)
    assert [r.hit_tokens for r in found] == [r.hit_tokens for r in full] == [373, 333, 500, 0]
    assert sparse.asked * 2 <= every.asked
