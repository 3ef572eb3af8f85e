"""Tensor parallelism: a producer and a consumer of TP size 2 (vLLM's CPU backend runs it, one core a
rank), each rank saving and loading its share of the KV heads under keys of its own.

A consumer loads what every rank of the producer saved, partial tail included, and answers as a
recomputation does. A prefix that one rank lacks is not a hit (the lookup asks every rank's key),
and a load that fails on one rank only is recomputed by the whole engine (vLLM aggregates the ranks'
failed loads): a miss, never half of the heads loaded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from connector.core.hashing import RequestIdentity
from connector.core.keys import decode_key
from connector.core.prefix import PromptKeys
from connector.core.ranks import keys_on_every_rank
from kvtool.store.admin import open_admin

from .conftest import running_pair
from .pairtools import (
    RunningPair,
    consume,
    consume_while_held_back,
    faults,
    held_back,
    produce_whole,
    remove,
    warm_loads,
)

pytestmark = pytest.mark.e2e

TP = 2
LENGTH = 75  # two full blocks of 32 and a tail of 11: every object kind a prompt save has


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningPair]:
    # 64 MiB of store memory a rank, not 256 (these prompts need a few MiB): four workers beside the
    # session's other pairs once took the CI machine past its 24 GiB (the OOM killer took a rank).
    extra_args = ("--tensor-parallel-size", str(TP), "--segment-mib", "64")
    with running_pair(tmp_path_factory.mktemp("tp2"), extra_args=extra_args) as info:
        warm_loads(info)  # every rank's first transfers from each segment made (and waited through)
        yield info


def _keys(pair: RunningPair, tokens: list[int], namespace: str) -> PromptKeys:
    return PromptKeys.build(tokens, pair.block_size, pair.hash_unit, namespace, RequestIdentity().root_hash())


def test_every_rank_saves_its_share_and_a_consumer_loads_them_all(tp_pair):
    # A fresh prompt per try: a load that meets Mooncake's first-transfer stall (README, known issues)
    # is given up as a transport failure and recomputed (consume checks the answer), and the next
    # prompt tries again; the prompt itself would now be in vLLM's own cache.
    for attempt in range(3):
        tokens, saved = produce_whole(tp_pair, 9101 + 100 * attempt, LENGTH)
        assert len(saved.tp_namespaces) == TP and saved.tp_namespaces[0] == saved.namespace
        admin = open_admin(tp_pair.admin)
        keys = _keys(tp_pair, tokens, saved.namespace)
        for key in (keys.block_key(0), keys.block_key(1), keys.tail_key(LENGTH)):
            on_ranks = keys_on_every_rank(key, saved.tp_namespaces)
            assert len(set(on_ranks)) == TP and all(admin.exists(k) for k in on_ranks), on_ranks
            assert {decode_key(k).namespace for k in on_ranks} == set(saved.tp_namespaces)

        details, _ = consume(tp_pair, tokens)  # checked against a recomputation (logprobs)
        if not held_back(details):
            break
        time.sleep(2.0)  # past the breaker's back-off, should the stall have opened it
    assert details.lookup == "hit" and details.load_failure is None
    assert details.external_hit_tokens == LENGTH - 1  # vLLM computes the last prompt token itself
    assert details.tail_hit_tokens == LENGTH - 1 - 2 * tp_pair.block_size


def test_a_prefix_one_rank_lacks_is_not_a_hit(tp_pair):
    # A fresh prompt per try: one the store held back (``held_back``) was recomputed, and is now in the
    # consumer's own cache, which a load never claims over.
    for attempt in range(3):
        tokens, saved = produce_whole(tp_pair, 9102 + 10 * attempt, LENGTH)
        keys = _keys(tp_pair, tokens, saved.namespace)
        remove(tp_pair, keys_on_every_rank(keys.block_key(1), saved.tp_namespaces)[1])  # rank 1's second block
        details, _ = consume(tp_pair, tokens)
        if not held_back(details):
            break
        time.sleep(2.0)  # past the breaker's back-off, should the stall have opened it
    # Rank 0 still holds the whole prompt; only the first block is stored on both ranks.
    assert details.external_hit_tokens == tp_pair.block_size, details


def test_a_load_that_fails_on_one_rank_only_is_recomputed(tp_pair):
    """Rank 1's objects fail their checksum: the request is recomputed (consume checks the answer). Where
    rank 0's transfer stalls meanwhile (README known issues), the failure it reports first is a transport
    one: a fresh prompt is tried, up to 4, and the invariant (a miss, an exact answer) holds on each."""
    for attempt in range(4):
        tokens, saved = produce_whole(tp_pair, 9103 + 10 * attempt, LENGTH)
        with faults(tp_pair, corrupt_get="flip", get_namespaces=[saved.tp_namespaces[1]]):
            details, _ = consume(tp_pair, tokens)  # rank 0's objects load; rank 1's fail their checksum
        assert details.external_hit_tokens == 0, details  # a miss, whatever stopped the load
        if details.load_failure == "checksum":
            assert details.lookup.startswith("load failed"), details
            break
        assert held_back(details), details
        time.sleep(2.0)  # past the breaker's back-off, should the stall have opened it
    assert details.load_failure == "checksum", f"no try reached rank 1's checksum: {details}"

    # The same prompt again, the fault gone: the consumer's own cache holds the full blocks it
    # recomputed, and the tail loads from both ranks.
    details = consume_while_held_back(tp_pair, tokens)
    assert details.reused_tokens == LENGTH - 1 and details.external_hit_tokens > 0, details
    assert details.load_failure is None
