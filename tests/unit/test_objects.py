import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.core.keys import KeyKind
from connector.core.objects import HEADER_SIZE, ObjectHeader, ObjectRejected, encode_object, verify_object


def expected(payload_len=64, **overrides):
    fields = dict(
        namespace_fingerprint=b"N" * 16,
        chain_hash=b"H" * 16,
        kind=KeyKind.TAIL,
        dtype="float32",
        num_layers=2,
        token_start=64,
        token_end=85,
        payload_len=payload_len,
    )
    fields.update(overrides)
    return ObjectHeader(**fields)


@given(payload=st.binary(min_size=0, max_size=512))
def test_round_trip(payload):
    header = expected(len(payload))
    assert bytes(verify_object(encode_object(header, payload), header)) == payload


def test_tail_header_keeps_its_valid_token_count():
    assert expected().valid_tokens == 21


@given(payload=st.binary(min_size=1, max_size=256), position=st.integers(0, 10_000))
def test_a_flipped_payload_byte_is_rejected(payload, position):
    header = expected(len(payload))
    data = bytearray(encode_object(header, payload))
    index = HEADER_SIZE + position % len(payload)
    data[index] ^= 0x01
    with pytest.raises(ObjectRejected) as info:
        verify_object(bytes(data), header)
    assert info.value.cause == "checksum"


@given(position=st.integers(0, HEADER_SIZE - 1))
def test_a_flipped_header_byte_is_rejected(position):
    payload = bytes(range(64))
    header = expected(len(payload))
    data = bytearray(encode_object(header, payload))
    data[position] ^= 0x40
    with pytest.raises(ObjectRejected):
        verify_object(bytes(data), header)


@given(cut=st.integers(0, HEADER_SIZE + 63))
def test_a_truncated_object_is_rejected(cut):
    payload = bytes(range(64))
    header = expected(len(payload))
    data = encode_object(header, payload)[:cut]
    with pytest.raises(ObjectRejected) as info:
        verify_object(data, header)
    assert info.value.cause in ("truncated", "mismatch")


def test_a_foreign_namespace_is_rejected():
    payload = bytes(64)
    written = expected(len(payload), namespace_fingerprint=b"X" * 16)
    with pytest.raises(ObjectRejected) as info:
        verify_object(encode_object(written, payload), expected(len(payload)))
    assert info.value.cause == "namespace"


@pytest.mark.parametrize(
    "field,value",
    [
        ("chain_hash", b"Z" * 16),
        ("kind", KeyKind.BLOCK),
        ("dtype", "bfloat16"),
        ("num_layers", 3),
        ("token_start", 32),
        ("token_end", 84),
    ],
)
def test_any_other_mismatch_is_rejected(field, value):
    payload = bytes(64)
    with pytest.raises(ObjectRejected):
        verify_object(encode_object(expected(len(payload), **{field: value}), payload), expected(len(payload)))


def test_a_payload_of_the_wrong_size_is_rejected():
    with pytest.raises(ObjectRejected):
        verify_object(encode_object(expected(32), bytes(32)), expected(64))


def test_non_kvtool_bytes_are_rejected():
    for data in [b"", b"hello", bytes(200)]:
        with pytest.raises(ObjectRejected):
            verify_object(data, expected())
