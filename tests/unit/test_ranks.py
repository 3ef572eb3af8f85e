"""Tensor parallelism's keys: each rank under its own namespace, a key present only where every rank holds it."""

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.core.keys import KeyKind, Namespace, block_key, decode_key, tail_key, watermark_key
from connector.core.ranks import keys_on_every_rank, key_on_rank, on_every_rank, rank_components, rank_namespace

NS = Namespace(model="m", dtype="float32", kv_layout="cpu", block_size=32, num_layers=2, num_kv_heads=1, head_size=64)


def test_every_rank_has_its_own_namespace_and_rank_0_is_the_engines():
    ns = replace(NS, tp_size=4)
    components = rank_components(ns)
    assert len(set(components)) == 4
    assert components[0] == ns.key_component()
    assert rank_components(NS) == (NS.key_component(),)
    with pytest.raises(ValueError, match="outside a TP size of 4"):
        rank_namespace(ns, 4)


@given(
    rank=st.integers(0, 3),
    end=st.integers(0, 2**20),
    chain=st.binary(min_size=16, max_size=16),
    kind=st.sampled_from([KeyKind.BLOCK, KeyKind.TAIL]),
)
def test_a_key_on_another_rank_names_the_same_object_in_that_ranks_namespace(rank, end, chain, kind):
    components = rank_components(replace(NS, tp_size=4))
    make = block_key if kind is KeyKind.BLOCK else tail_key
    key = make(components[0], end, chain)
    moved = decode_key(key_on_rank(key, components, rank))
    original = decode_key(key)
    assert moved is not None and original is not None
    assert moved.namespace == components[rank]
    assert (moved.kind, moved.end_token, moved.chain_hash, moved.group) == (
        original.kind,
        original.end_token,
        original.chain_hash,
        original.group,
    )


def test_watermarks_move_too_and_foreign_keys_stay():
    components = rank_components(replace(NS, tp_size=2))
    record = watermark_key(components[0], "req-1", 1)
    assert keys_on_every_rank(record, components) == [record, watermark_key(components[1], "req-1", 1)]
    assert keys_on_every_rank("someone-elses/key", components) == ["someone-elses/key"] * 2
    assert keys_on_every_rank(record, components[:1]) == [record]


@given(
    ranks=st.integers(1, 4),
    keys=st.lists(st.integers(0, 40), min_size=0, max_size=12, unique=True),
    held=st.sets(st.tuples(st.integers(0, 3), st.integers(0, 40))),
)
def test_a_key_is_present_only_where_every_rank_holds_it_in_one_query(ranks, keys, held):
    components = rank_components(replace(NS, tp_size=ranks))
    names = [block_key(components[0], 32 * (k + 1), k.to_bytes(16, "big")) for k in keys]
    stored = {
        key_on_rank(names[i], components, r) for i, k in enumerate(keys) for r, kk in held if kk == k and r < ranks
    }
    calls = []

    def exists(asked):
        calls.append(list(asked))
        return [key in stored for key in asked]

    answers = on_every_rank(exists, components)(names)
    expected = [all((r, k) in held for r in range(ranks)) for k in keys]
    assert answers == expected
    assert len(calls) == 1 and len(calls[0]) == len(keys) * ranks
    if ranks == 1:
        assert on_every_rank(exists, components) is exists
