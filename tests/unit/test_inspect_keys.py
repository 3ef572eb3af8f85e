"""`kvtool inspect keys`: decoding (round trip with the encoder), foreign keys, filters, paging."""

from hypothesis import given
from hypothesis import strategies as st

from connector.core.keys import Namespace, block_key, tail_key, watermark_key
from kvtool.inspect.keys import FOREIGN, describe_key, namespaces, select_keys
from kvtool.inspect.watermarks import latest_record_keys

NS = Namespace(model="m", dtype="float32", kv_layout="cpu", block_size=32, num_layers=2, num_kv_heads=2, head_size=64)
OTHER = Namespace(
    model="other", dtype="float32", kv_layout="cpu", block_size=32, num_layers=2, num_kv_heads=2, head_size=64
)


@given(block=st.integers(1, 2**20), chain=st.binary(min_size=16, max_size=16))
def test_block_keys_round_trip(block, chain):
    key = block_key(NS.key_component(), block * 32, chain)
    info = describe_key(key, block_size=32)
    assert (info.kind, info.namespace, info.end_token, info.tokens, info.chain_hash) == (
        "block",
        NS.key_component(),
        block * 32,
        32,
        chain.hex(),
    )


@given(boundary=st.integers(1, 2**20).filter(lambda b: b % 32), chain=st.binary(min_size=16, max_size=16))
def test_tail_keys_round_trip_with_their_valid_tokens(boundary, chain):
    info = describe_key(tail_key(NS.key_component(), boundary, chain), block_size=32)
    assert (info.kind, info.end_token, info.tokens, info.chain_hash) == ("tail", boundary, boundary % 32, chain.hex())


def test_without_a_block_size_a_tail_shows_its_boundary_only():
    info = describe_key(tail_key(NS.key_component(), 85, bytes(16)))
    assert (info.end_token, info.tokens) == (85, None)


def test_watermark_keys_decode_to_request_and_seq():
    info = describe_key(watermark_key(NS.key_component(), "req-1", 1))
    assert (info.kind, info.namespace, info.seq) == ("watermark", NS.key_component(), 1)
    assert info.request_hash is not None and info.end_token is None


def test_foreign_keys_are_marked_not_dropped():
    ns = NS.key_component()
    foreign = [
        "vllm@model@tp0@abc",  # another program
        f"kvtool/2/{ns}/b/32/{'0' * 32}",  # another schema version
        f"kvtool/2/{ns}/0/x/32/{'0' * 32}",  # unknown kind
        f"kvtool/2/{ns}/0/b/32/{'0' * 31}",  # short hash
        f"kvtool/2/{ns[:-1]}/0/t/5/{'0' * 32}",  # short namespace
    ]
    for key in foreign:
        info = describe_key(key)
        assert (info.kind, info.key, info.namespace) == (FOREIGN, key, None), key


def test_filters_combine_and_order_by_namespace_kind_and_token():
    ns, other = NS.key_component(), OTHER.key_component()
    keys = [
        tail_key(ns, 85, bytes(16)),
        block_key(ns, 64, bytes(16)),
        block_key(ns, 32, bytes(16)),
        block_key(other, 32, bytes(16)),
        "foreign-key",
    ]
    infos = [describe_key(k) for k in keys]
    assert [i.end_token for i in select_keys(infos, kind="block", namespace=ns)] == [32, 64]
    assert [i.key for i in select_keys(infos, kind="foreign")] == ["foreign-key"]
    assert len(select_keys(infos, prefix=f"kvtool/2/{other}/")) == 1
    assert namespaces(infos) == sorted([ns, other])


def test_the_latest_watermark_record_of_each_request_wins():
    ns = NS.key_component()
    keys = [watermark_key(ns, "a", 0), watermark_key(ns, "a", 1), watermark_key(ns, "b", 0), "foreign"]
    latest = latest_record_keys(keys)
    assert sorted((r.key, r.seq) for r in latest) == sorted(
        [(watermark_key(ns, "a", 1), 1), (watermark_key(ns, "b", 0), 0)]
    )
    assert latest_record_keys(keys, namespace=OTHER.key_component()) == []
