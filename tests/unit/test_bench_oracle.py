"""The ideal-reuse oracle: longest prefix of any earlier published prompt, on the reuse grid, capped."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.bench.oracle import common_prefix_length, ideal_hit, ideal_hits, on_reuse_grid
from kvtool.bench.workloads.base import Step

tokens = st.lists(st.integers(0, 3), max_size=80)


def naive_common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=300)
@given(a=tokens, b=tokens)
def test_common_prefix_length_matches_the_definition(a, b):
    assert common_prefix_length(a, b) == naive_common_prefix(a, b)
    assert common_prefix_length(a, tuple(b)) == naive_common_prefix(a, b)  # a prompt sent vs one planned


@settings(max_examples=200)
@given(prompt=tokens, published=st.lists(tokens, max_size=4), block=st.sampled_from([4, 8]), unit=st.integers(1, 8))
def test_ideal_hit_is_a_capped_reusable_prefix_of_an_earlier_prompt(prompt, published, block, unit):
    unit = min(unit, block)
    ideal = ideal_hit(prompt, published, block, unit)
    assert 0 <= ideal <= max(0, len(prompt) - 1)
    if ideal:
        assert any(prompt[:ideal] == earlier[:ideal] for earlier in published)

    # By enumeration: the longest boundary a store can hold (a block end or a hash-unit multiple)
    # that an earlier prompt shares, then capped one short of the prompt (a load may claim part of
    # the object holding it).
    def storable_and_shared(boundary):
        on_grid = boundary % unit == 0 or boundary % block == 0
        return on_grid and any(prompt[:boundary] == earlier[:boundary] for earlier in published)

    best = max((b for b in range(len(prompt) + 1) if storable_and_shared(b)), default=0)
    assert ideal == min(best, max(0, len(prompt) - 1))


def test_grid_counts_block_ends_and_hash_unit_multiples():
    assert on_reuse_grid(85, 32, 1) == 85
    assert on_reuse_grid(85, 32, 8) == 80
    assert on_reuse_grid(70, 32, 20) == 64  # a block end beats the coarser hash-unit grid
    assert on_reuse_grid(31, 32, 32) == 0


def test_ideal_hits_only_count_prompts_published_before():
    a = tuple(range(10, 50))
    steps = [
        Step("consumer", a, 4),  # nothing published yet
        Step("producer", a[:20], 1),
        Step("consumer", a, 4, (1,)),  # extends the published 20
        Step("consumer", a[:20], 4, (1,)),  # repeats it: capped one short
        Step("consumer", (99,) + a[1:], 4, (1,)),  # diverges at the first token
    ]
    assert ideal_hits(steps, block_size=8, hash_unit=1) == {0: 0, 2: 20, 3: 19, 4: 0}
    assert ideal_hits(steps, block_size=8, hash_unit=6)[2] == 18
    assert ideal_hits(steps, block_size=8, hash_unit=8)[2] == 16


def test_consumer_prompts_do_not_publish():
    a = tuple(range(10, 30))
    steps = [Step("consumer", a, 4), Step("consumer", a, 4)]
    assert ideal_hits(steps, 8, 1) == {0: 0, 1: 0}
