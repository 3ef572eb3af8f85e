import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.core.hashing import (
    _digest,
    pack_tokens,
    tail_hashes,
    HASH_BYTES,
    RequestIdentity,
    block_hashes,
    save_tail_boundary,
    tail_boundaries,
    tail_hash,
)

ROOT = RequestIdentity().root_hash()
tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)
block_size_st = st.sampled_from([1, 2, 16, 32, 64])


def test_hashes_are_128_bits_and_deterministic():
    tokens = list(range(100))
    first = block_hashes(tokens, 32, ROOT)
    assert len(first) == 3
    assert all(len(h) == HASH_BYTES for h in first)
    assert first == block_hashes(tokens, 32, RequestIdentity().root_hash())


def test_known_vector_is_stable():
    # Changing this value changes every key in every store: bump the key schema version with it.
    assert block_hashes(list(range(32)), 32, ROOT)[0].hex() == KNOWN_BLOCK0


KNOWN_BLOCK0 = "eef25122a88b73aff5d234906c1737c7"


@given(tokens=tokens_st, block_size=block_size_st)
def test_block_hashes_chain_over_prefixes(tokens, block_size):
    hashes = block_hashes(tokens, block_size, ROOT)
    assert len(hashes) == len(tokens) // block_size
    for cut in range(len(hashes)):
        assert block_hashes(tokens[: (cut + 1) * block_size], block_size, ROOT) == hashes[: cut + 1]


@given(tokens=st.lists(st.integers(0, 1000), min_size=2, max_size=96), position=st.integers(0, 95))
def test_a_changed_token_changes_every_later_hash(tokens, position):
    position %= len(tokens)
    changed = list(tokens)
    changed[position] += 1
    before, after = block_hashes(tokens, 16, ROOT), block_hashes(changed, 16, ROOT)
    first_affected = position // 16
    assert before[:first_affected] == after[:first_affected]
    assert all(b != a for b, a in zip(before[first_affected:], after[first_affected:], strict=True))


def test_identity_separates_salts_loras_and_multimodal_inputs():
    roots = {
        RequestIdentity().root_hash(),
        RequestIdentity(cache_salt="").root_hash(),
        RequestIdentity(cache_salt="alice").root_hash(),
        RequestIdentity(cache_salt="bob").root_hash(),
        RequestIdentity(lora_name="alice").root_hash(),
        RequestIdentity(mm_hashes=("img1",)).root_hash(),
        RequestIdentity(lora_name="alice", lora_path="/a").root_hash(),
        RequestIdentity(embeds_digest=bytes(16)).root_hash(),
        RequestIdentity(lora_path="", embeds_digest=bytes(16)).root_hash(),
    }
    assert len(roots) == 9


def test_multimodal_entries_holding_the_separator_cannot_join_into_others():
    # Identifiers a client gives (``multi_modal_uuids``) may hold the join's separator.
    joined = RequestIdentity(mm_hashes=("a\x1fb",)).root_hash()
    assert joined != RequestIdentity(mm_hashes=("a", "b")).root_hash()
    first, second = RequestIdentity(mm_hashes=("a\x1fb", "c")), RequestIdentity(mm_hashes=("a", "b\x1fc"))
    assert first.root_hash() != second.root_hash()
    # Entries without it keep the root they always had (stored keys stay valid).
    old = _digest(b"kvtool-root-v1", b"", b"\x00", b"", b"a\x1fb")
    assert RequestIdentity(mm_hashes=("a", "b")).root_hash() == old


def test_tail_hash_differs_from_block_hash_over_same_tokens():
    tokens = list(range(32))
    # A "tail" of 31 tokens and the block of 32 cannot collide, nor can tails of other lengths.
    tails = {tail_hash(tokens, b, 32, ROOT) for b in range(1, 32)}
    assert len(tails) == 31
    assert block_hashes(tokens, 32, ROOT)[0] not in tails


def test_tail_hash_rejects_aligned_and_out_of_range_boundaries():
    import pytest

    with pytest.raises(ValueError):
        tail_hash(list(range(64)), 32, 32, ROOT)
    with pytest.raises(ValueError):
        tail_hash(list(range(10)), 11, 32, ROOT)


@given(tokens=st.lists(st.integers(0, 50), min_size=40, max_size=90), boundary=st.integers(33, 63))
def test_tail_hash_depends_only_on_its_prefix(tokens, boundary):
    boundary = min(boundary, len(tokens))
    if boundary % 32 == 0:
        return
    parent = block_hashes(tokens, 32, ROOT)[0]
    extended = tokens + [7, 8, 9]
    assert tail_hash(tokens, boundary, 32, parent) == tail_hash(extended, boundary, 32, parent)


@given(block_index=st.integers(0, 10), block_size=block_size_st, unit=st.integers(1, 40), limit=st.integers(0, 800))
def test_tail_boundaries_lie_inside_the_block_on_the_grid(block_index, block_size, unit, limit):
    start = block_index * block_size
    found = tail_boundaries(block_index, block_size, unit, limit)
    assert found == sorted(found)
    for boundary in found:
        assert start < boundary < start + block_size
        assert boundary % unit == 0
        assert boundary <= limit


def test_tail_boundaries_token_exact():
    assert tail_boundaries(0, 32, 1, 20) == list(range(1, 21))
    assert tail_boundaries(2, 32, 1, 85) == list(range(65, 86))
    assert tail_boundaries(2, 32, 8, 1000) == [72, 80, 88]


@given(num_tokens=st.integers(0, 600), block_size=block_size_st, unit=st.integers(1, 64))
def test_save_tail_boundary(num_tokens, block_size, unit):
    boundary = save_tail_boundary(num_tokens, block_size, unit)
    if boundary is None:
        return
    assert boundary <= num_tokens
    assert boundary % unit == 0
    assert boundary % block_size != 0
    assert boundary // block_size == num_tokens // block_size


def test_save_tail_boundary_examples():
    assert save_tail_boundary(20, 32, 1) == 20
    assert save_tail_boundary(85, 32, 1) == 85
    assert save_tail_boundary(64, 32, 1) is None
    assert save_tail_boundary(85, 32, 16) == 80
    assert save_tail_boundary(70, 32, 16) is None


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=80),
    block_size=st.integers(2, 16),
    parent=st.binary(min_size=16, max_size=16),
    data=st.data(),
)
def test_tail_hashes_of_a_block_equal_its_tail_hashes_one_by_one(tokens, block_size, parent, data):
    block = data.draw(st.integers(0, len(tokens) // block_size))
    inside = [b for b in range(block * block_size + 1, (block + 1) * block_size) if b <= len(tokens)]
    if not inside:
        return
    boundaries = sorted(data.draw(st.sets(st.sampled_from(inside), min_size=1)))
    one_by_one = [tail_hash(tokens, b, block_size, parent) for b in boundaries]
    assert tail_hashes(tokens, boundaries, block_size, parent) == one_by_one
    # From the prompt packed once (``PromptKeys``): the same hashes.
    assert tail_hashes(tokens, boundaries, block_size, parent, pack_tokens(tokens)) == one_by_one
    full = len(tokens) // block_size * block_size
    packed = pack_tokens(tokens[:full])
    assert block_hashes(tokens, block_size, parent, packed) == block_hashes(tokens, block_size, parent)


@pytest.mark.parametrize("bad", [-1, 2**32, "7"])
def test_a_prompt_with_an_id_the_keys_cannot_encode_has_no_keys(bad):
    from connector.core.hashing import UnkeyableTokens
    from connector.core.prefix import PromptKeys

    with pytest.raises(UnkeyableTokens):
        PromptKeys.build([1, 2, bad, 4], 2, 1, "0123456789abcdef", ROOT)


def test_tail_hashes_refuse_boundaries_outside_one_block():
    tokens = list(range(40))
    for boundaries in ([16], [3, 17], [41]):
        with pytest.raises(ValueError):
            tail_hashes(tokens, boundaries, 16, bytes(16))


@given(
    boundaries=st.lists(st.integers(0, 70), min_size=1, max_size=6),
    block_size=st.integers(1, 16),
    length=st.integers(0, 64),
)
def test_tail_hashes_refuse_exactly_the_boundaries_tail_hash_refuses(boundaries, block_size, length):
    tokens = list(range(length))
    start = boundaries[0] // block_size * block_size
    valid = all(b // block_size * block_size == start and b != start and b <= length for b in boundaries)
    if valid:
        assert len(tail_hashes(tokens, boundaries, block_size, bytes(16))) == len(boundaries)
    else:
        with pytest.raises(ValueError):
            tail_hashes(tokens, boundaries, block_size, bytes(16))
