"""The C key builder (connector/core/_native.c) against the pure-Python reference it replaces: the same
chain and tail digests, the same keys and refs, the same caches filled, on random prompts (hypothesis);
its errors are Python errors, never a crash; and the install built it here (CI has a C compiler, so a
build that silently fell back to Python would show up as a slower lookup, not a failing test)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core import native
from connector.core.hashing import (
    RequestIdentity,
    block_hashes,
    pack_tokens,
    reference_block_chain,
    reference_tail_digests,
)
from connector.core.keys import KeyKind
from connector.core.prefix import PromptKeys
from connector.core.refs import ObjectRef

C = native.KEYS
needs_c = pytest.mark.skipif(C is None, reason="the C key builder is not built (KVTOOL_NATIVE_KEYS=0 or no compiler)")

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=700)
block_st = st.sampled_from([1, 2, 3, 16, 32, 64, 256])
roots = st.one_of(st.just(RequestIdentity().root_hash()), st.binary(min_size=0, max_size=40))


@pytest.mark.skipif(native.TURNED_OFF, reason="KVTOOL_NATIVE_KEYS=0 rules the C key builder out")
def test_the_install_built_the_c_key_builder():
    assert C is not None, "connector/core/_native.c was not built: pip install -e . needs a C compiler and Python.h"
    assert native.describe() == "the C key builder"


@needs_c
@settings(max_examples=150, deadline=None)
@given(tokens=tokens_st, block_size=block_st, root=roots)
def test_block_chains_are_the_references(tokens, block_size, root):
    packed = memoryview(pack_tokens(tokens))
    count = len(tokens) // block_size
    assert C.block_chain(packed[: 4 * count * block_size], block_size, root) == reference_block_chain(
        packed, block_size, count, root
    )


@needs_c
@settings(max_examples=150, deadline=None)
@given(tokens=tokens_st, block_size=block_st, root=roots, data=st.data())
def test_tail_digests_are_the_references(tokens, block_size, root, data):
    blocks = len(tokens) // block_size + 1
    block = data.draw(st.integers(0, blocks - 1))
    start = block * block_size
    inside = list(range(start + 1, min(start + block_size, len(tokens) + 1)))
    if not inside:
        return
    ends = sorted(data.draw(st.sets(st.sampled_from(inside), min_size=1)))
    packed = pack_tokens(tokens)
    reference = reference_tail_digests(memoryview(packed)[4 * start :], start, ends, root)
    assert C.tail_digests(packed, start, ends, root) == reference


def _keys(tokens, block_size, grid, hash_unit=1):
    return PromptKeys.build(tokens, block_size, hash_unit, "0123456789abcdef", b"r" * 16, grid=grid, lead_pointers=True)


@needs_c
@settings(max_examples=80, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), min_size=1, max_size=600),
    block_size=st.sampled_from([16, 32, 256]),
    grid=st.sampled_from([0, 4, 8, 64]),
    hash_unit=st.sampled_from([1, 2, 5]),
)
def test_a_prompts_keys_and_refs_are_the_references(tokens, block_size, grid, hash_unit):
    grid = grid if grid < block_size else 0
    ends = sorted({*range(1, len(tokens) + 1)})
    built = _keys(tokens, block_size, grid, hash_unit)
    with_c = built.probe_refs(ends, blocks=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "KEYS", None)
        plain = _keys(tokens, block_size, grid, hash_unit)
        assert plain.block_chain == built.block_chain
        assert plain.probe_refs(ends, blocks=True) == with_c
    assert all(type(ref) is ObjectRef for ref in with_c)  # a named tuple: ``ref.key`` and the rest read as before
    assert [hash(ref) for ref in with_c] == [hash(ref) for ref in plain.probe_refs(ends, blocks=True)]
    assert plain._by_key == built._by_key and plain._refs == built._refs  # the caches hold the same refs


@needs_c
def test_the_c_builder_refuses_bad_input_with_python_errors():
    keys = _keys(list(range(40)), 32, 8)
    with pytest.raises(KeyError, match="no tail hash for end 5"):
        C.build_refs(ObjectRef, "p/", 0, KeyKind.TAIL, 32, [5], {}, {}, {})
    with pytest.raises(TypeError):
        C.build_refs(int, "p/", 0, KeyKind.TAIL, 32, [5], {5: b"x"}, {}, {})
    with pytest.raises(ValueError, match="not inside the packed tokens"):
        C.tail_digests(keys._packed, 32, [41], b"")
    with pytest.raises(ValueError, match="block_size must be positive"):
        C.block_chain(b"", 0, b"")
    with pytest.raises(ValueError, match="block_size must be positive"):
        C.build_refs(ObjectRef, "p/", 0, KeyKind.TAIL, 0, [5], {5: b"x"}, {}, {})
    assert C.block_chain(b"\0" * 7, 2, b"") == []  # less than one block of packed tokens
    # Sizes whose byte counts would wrap around a machine word: refused, never read past the buffer.
    with pytest.raises(ValueError, match="not inside the packed tokens"):
        C.tail_digests(b"abcd", 3 << 61, [(3 << 61) + 1], b"")
    with pytest.raises(ValueError, match="block_size must be positive"):
        C.block_chain(b"abcd", 1 << 62, b"")


def test_keys_without_the_c_builder_are_the_same_bytes(monkeypatch):
    tokens = list(range(1000, 1300))
    with_c = _keys(tokens, 32, 8)
    monkeypatch.setattr(native, "KEYS", None)
    plain = _keys(tokens, 32, 8)
    assert block_hashes(tokens, 32, b"r" * 16) == list(plain.block_chain) == list(with_c.block_chain)
    assert [ref.key for ref in plain.probe_refs(range(1, 300), blocks=True)] == [
        ref.key for ref in with_c.probe_refs(range(1, 300), blocks=True)
    ]
