from hypothesis import given
from hypothesis import strategies as st

from connector.core.keys import KeyKind, Namespace, block_key, decode_key, request_hash, tail_key, watermark_key

NS = Namespace(model="m", dtype="float32", kv_layout="cpu", block_size=32, num_layers=2, num_kv_heads=2, head_size=64)


@given(
    end=st.integers(0, 2**31),
    chain=st.binary(min_size=16, max_size=16),
    kind=st.sampled_from([KeyKind.BLOCK, KeyKind.TAIL]),
)
def test_round_trip(end, chain, kind):
    make = block_key if kind is KeyKind.BLOCK else tail_key
    key = make(NS.key_component(), end, chain)
    decoded = decode_key(key)
    assert decoded is not None
    assert (decoded.namespace, decoded.kind, decoded.end_token, decoded.chain_hash) == (
        NS.key_component(),
        kind,
        end,
        chain.hex(),
    )


def test_block_and_tail_keys_never_collide():
    chain = bytes(16)
    assert block_key(NS.key_component(), 64, chain) != tail_key(NS.key_component(), 64, chain)


def test_keys_are_plain_for_batch_queries():
    key = tail_key(NS.key_component(), 85, bytes(range(16)))
    assert "," not in key and " " not in key and key.startswith("kvtool/2/")


def test_foreign_keys_do_not_decode():
    good = block_key(NS.key_component(), 32, bytes(16))
    for foreign in [
        "",
        "abc",
        "vllm@mooncake@tp0@xyz",
        good.replace("kvtool/2/", "kvtool/1/"),
        good + "x",
        good.replace("/b/", "/q/"),
        good[:-1],
    ]:
        assert decode_key(foreign) is None


def test_namespace_folds_in_everything_that_makes_kv_incompatible():
    fields = dict(
        model="m",
        dtype="float32",
        kv_layout="cpu",
        block_size=32,
        num_layers=2,
        num_kv_heads=2,
        head_size=64,
        tp_size=1,
        tp_rank=0,
        cache_group=0,
        weights_digest="",
        model_identity="",
    )
    base = Namespace(**fields).key_component()
    changes = dict(
        model="m2",
        dtype="bfloat16",
        kv_layout="cuda",
        block_size=64,
        num_layers=3,
        num_kv_heads=4,
        head_size=128,
        tp_size=2,
        tp_rank=1,
        cache_group=1,
        weights_digest="abc",
        model_identity="def",
    )
    for name, value in changes.items():
        assert Namespace(**{**fields, name: value}).key_component() != base, name


@given(request_id=st.text(min_size=1, max_size=80), seq=st.integers(0, 10))
def test_watermark_keys_round_trip(request_id, seq):
    key = watermark_key(NS.key_component(), request_id, seq)
    decoded = decode_key(key)
    assert decoded is not None and decoded.kind is KeyKind.WATERMARK
    assert (decoded.namespace, decoded.request_hash, decoded.seq) == (NS.key_component(), request_hash(request_id), seq)
    assert decoded.end_token is None and decoded.chain_hash is None
    assert "," not in key and " " not in key
