"""Chained prefix hashes and the boundaries they are taken at.

The rule: a full block is keyed by the chain hash at its end; a partial tail is keyed by the hash of
the last full block's chain value and the tail's tokens, taken at the tail's exact end boundary.
Tail boundaries fall on a ``hash_unit`` grid (1 = token-exact). Block and tail hashes use different
domain tags, so a tail hash can never equal a block hash.

Everything here is pure and deterministic across processes and machines: BLAKE2b-128 over
little-endian uint32 token ids, never Python's ``hash``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from . import native

HASH_BYTES = 16  # 128-bit chain values

_ROOT_TAG = b"kvtool-root-v1"
_BLOCK_TAG = b"B"
_TAIL_TAG = b"T"


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    for part in parts:
        # Length-prefix each part so that concatenations of different parts cannot collide.
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    return h.digest()


MAX_TOKEN_ID = 2**32 - 1


class UnkeyableTokens(ValueError):
    """A token id the key schema cannot encode (outside 0..2^32-1): the prompt has no keys."""


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """The ids as the hashes take them (little-endian uint32); ``UnkeyableTokens`` for any id outside
    0..2^32-1 (packing checks every id: a prompt packed once needs no other check)."""
    return _token_bytes(tokens)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except (struct.error, TypeError) as exc:
        bad = next((t for t in tokens if not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID), None)
        raise UnkeyableTokens(f"token id {bad!r} is outside 0..{MAX_TOKEN_ID}") from exc


@dataclass(frozen=True)
class RequestIdentity:
    """What, besides the tokens, makes one request's KV differ from another's.

    ``cache_salt`` isolates users (requests with different salts never share KV), ``lora_name`` and
    ``lora_path`` the adapter, ``mm_hashes`` the multimodal inputs (identifier and placeholder
    position), ``embeds_digest`` the prompt embeddings (their positions hold placeholder token ids,
    so the tokens alone do not tell them apart). ``connector.core.identity.request_identity`` reads them
    from a vLLM request.
    """

    cache_salt: str | None = None
    lora_name: str | None = None
    mm_hashes: tuple[str, ...] = ()
    lora_path: str | None = None
    embeds_digest: bytes | None = None

    def root_hash(self) -> bytes:
        parts = [
            _ROOT_TAG,
            (self.cache_salt or "").encode(),
            b"\x01" if self.cache_salt is not None else b"\x00",
            (self.lora_name or "").encode(),
            "\x1f".join(self.mm_hashes).encode(),
        ]
        if any("\x1f" in entry for entry in self.mm_hashes):
            # The join above is ambiguous for entries holding the separator (identifiers a client
            # gave, ``multi_modal_uuids``): their count, then each entry as a part of its own (length-
            # prefixed by ``_digest``). Roots of identities without such entries are unchanged.
            parts += [b"mm_entries", str(len(self.mm_hashes)).encode(), *(e.encode() for e in self.mm_hashes)]
        # Fields added later are appended only when set, each behind its own tag and in a fixed
        # order: an identity without them keeps the root it always had (stored keys stay valid), and
        # since every part is length-prefixed, one with them can never hash the same bytes as one
        # without.
        if self.lora_path is not None:
            parts += [b"lora_path", self.lora_path.encode()]
        if self.embeds_digest is not None:
            parts += [b"embeds", self.embeds_digest]
        return _digest(*parts)


def block_hashes(tokens: Sequence[int], block_size: int, root: bytes, packed: bytes | None = None) -> list[bytes]:
    """Chain hashes at the end of every full block of ``tokens`` (``len(tokens) // block_size`` of them);
    ``packed``: ``pack_tokens(tokens)``, where the caller has it."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    count = len(tokens) // block_size
    if not count:
        return []
    # ``_digest(_BLOCK_TAG, parent, block's token bytes)``, with the tokens packed once for every block.
    packed = memoryview(packed if packed is not None else _token_bytes(tokens[: count * block_size]))
    if native.KEYS is not None:
        return native.KEYS.block_chain(packed[: 4 * count * block_size], block_size, root)
    return reference_block_chain(packed, block_size, count, root)


def reference_block_chain(packed: memoryview, block_size: int, count: int, root: bytes) -> list[bytes]:
    """``block_hashes`` in Python: the reference the C key builder is held to."""
    tag = struct.pack("<I", len(_BLOCK_TAG)) + _BLOCK_TAG
    size = struct.pack("<I", 4 * block_size)
    hashes: list[bytes] = []
    parent = root
    for start in range(0, 4 * count * block_size, 4 * block_size):
        h = hashlib.blake2b(tag, digest_size=HASH_BYTES)
        h.update(struct.pack("<I", len(parent)))
        h.update(parent)
        h.update(size)
        h.update(packed[start : start + 4 * block_size])
        parent = h.digest()
        hashes.append(parent)
    return hashes


def tail_hash(tokens: Sequence[int], boundary: int, block_size: int, parent: bytes) -> bytes:
    """Hash of the partial tail ending at ``boundary``.

    ``parent`` is the chain value of the last full block before the tail (the root when the tail
    lies in the first block). ``boundary`` must not be block-aligned: an aligned boundary is a block.
    """
    tail_start = (boundary // block_size) * block_size
    if boundary == tail_start:
        raise ValueError(f"boundary {boundary} is block-aligned; it is keyed as a block, not a tail")
    if boundary > len(tokens):
        raise ValueError(f"boundary {boundary} is past the end of the {len(tokens)} tokens")
    return _digest(_TAIL_TAG, parent, _token_bytes(tokens[tail_start:boundary]))


def tail_hashes(
    tokens: Sequence[int], boundaries: Sequence[int], block_size: int, parent: bytes, packed: bytes | None = None
) -> list[bytes]:
    """``tail_hash`` at each of ``boundaries``, all inside one block: the block's tokens are packed
    once and the hash state after the parent is shared (a lookup at hash unit 1 takes every boundary of
    a block; one by one this was most of its CPU). ``packed``: ``pack_tokens(tokens)``, where the caller
    has it."""
    if not boundaries:
        return []
    tail_start = (boundaries[0] // block_size) * block_size
    low, high = min(boundaries), max(boundaries)  # every boundary strictly inside the block, none past the end
    if low <= tail_start or high >= tail_start + block_size or high > len(tokens):
        raise ValueError(f"boundaries {list(boundaries)} are not all inside one block of the {len(tokens)} tokens")
    if native.KEYS is not None:
        whole = packed if packed is not None else _token_bytes(tokens[:high])
        return native.KEYS.tail_digests(whole, tail_start, boundaries, parent)
    if packed is None:
        packed = _token_bytes(tokens[tail_start:high])
    else:
        packed = memoryview(packed)[4 * tail_start : 4 * high]
    return reference_tail_digests(packed, tail_start, boundaries, parent)


def reference_tail_digests(
    packed: bytes | memoryview, tail_start: int, boundaries: Sequence[int], parent: bytes
) -> list[bytes]:
    """``tail_hashes`` in Python (``packed``: the tokens from the block's start on), the reference the
    C key builder is held to."""
    prefix = hashlib.blake2b(digest_size=HASH_BYTES)
    for part in (_TAIL_TAG, parent):
        prefix.update(struct.pack("<I", len(part)))
        prefix.update(part)
    digests = []
    for boundary in boundaries:
        size = 4 * (boundary - tail_start)
        h = prefix.copy()
        h.update(struct.pack("<I", size))
        h.update(packed[:size])
        digests.append(h.digest())
    return digests


def tail_boundaries(block_index: int, block_size: int, hash_unit: int, limit: int) -> list[int]:
    """Candidate tail boundaries inside block ``block_index``, ascending, none beyond ``limit``.

    Boundaries are the multiples of ``hash_unit`` strictly inside the block, i.e. in
    ``(block_start, block_end)``.
    """
    if hash_unit <= 0:
        raise ValueError("hash_unit must be positive")
    block_start = block_index * block_size
    last = min(block_start + block_size - 1, limit)
    first = (block_start // hash_unit + 1) * hash_unit
    return list(range(first, last + 1, hash_unit))


def save_tail_boundary(num_tokens: int, block_size: int, hash_unit: int) -> int | None:
    """The boundary at which a prompt of ``num_tokens`` tokens publishes its tail, or None.

    It is the prompt length rounded down to the ``hash_unit`` grid, when that falls strictly inside
    the last block (an aligned or empty remainder has no tail).
    """
    boundary = (num_tokens // hash_unit) * hash_unit
    if boundary % block_size == 0:
        return None
    if boundary // block_size != num_tokens // block_size:
        return None
    return boundary
