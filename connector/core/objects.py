"""Self-describing stored objects: a fixed header followed by a block's bytes, one layer after another.

A full block object covers tokens [start, start + block_size); a tail object covers its valid tokens
(``token_end - token_start``): only those tokens' bytes where the attention kernel's layout can be cut
per token (``tokencut``), else the whole block (kernels pack block interiors differently; only
whole-block copies are layout-agnostic). The reader's layout says which: ``payload length`` must match.

A state object (a Mamba group's state after ``token_end`` tokens) is the group's block that holds it,
with ``token_start`` 0.

Header (little-endian, 96 bytes, format 3):
    magic "KVT0" | format u16 | header size u16 | namespace fingerprint 16B | chain hash 16B |
    kind u8 | group u8 | dtype 16B ascii | layers u16 | token_start u32 | token_end u32 |
    payload length u64 | payload checksum u64 (XXH3-64) | reserved 12B (zero; the payload starts
    32-byte aligned in its slot)

The payload checksum is XXH3-64: about 33 GB/s here against CRC-32's 7 (format 2), so a 100 MB
save or load spends 3 ms on it instead of 15 (``benchmarks/fast-path/data_path.py``), and it releases
the GIL on large buffers. It guards against torn or misplaced bytes, not against an adversary:
the store has no authentication, and network isolation is the operator's (README, security).

Every load checks every field against what the reader expects; any mismatch rejects the object.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import xxhash

from .keys import KeyKind

MAGIC = b"KVT0"
FORMAT_VERSION = 3
_HEADER = struct.Struct("<4sHH16s16sBB16sHIIQQ12s")
_RESERVED = bytes(12)
HEADER_SIZE = _HEADER.size
_KIND_CODES = {KeyKind.BLOCK: 0, KeyKind.TAIL: 1, KeyKind.STATE: 2}


def payload_checksum(payload: bytes | bytearray | memoryview) -> int:
    """The object payload's checksum (XXH3-64, seed 0)."""
    return xxhash.xxh3_64_intdigest(payload)


class ObjectRejected(Exception):
    """A stored object failed a check; the reason is a short, stable cause label plus detail."""

    def __init__(self, cause: str, detail: str):
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


@dataclass(frozen=True)
class ObjectHeader:
    namespace_fingerprint: bytes
    chain_hash: bytes
    kind: KeyKind
    dtype: str
    num_layers: int
    token_start: int
    token_end: int
    payload_len: int
    payload_crc: int = 0
    group: int = 0  # the KV cache group whose layers the payload holds

    @property
    def valid_tokens(self) -> int:
        return self.token_end - self.token_start


def encode_header(header: ObjectHeader) -> bytes:
    dtype = header.dtype.encode("ascii")
    if len(dtype) > 16:
        raise ValueError(f"dtype name {header.dtype!r} is longer than 16 characters")
    return _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_SIZE,
        header.namespace_fingerprint,
        header.chain_hash,
        _KIND_CODES[header.kind],
        header.group,
        dtype,
        header.num_layers,
        header.token_start,
        header.token_end,
        header.payload_len,
        header.payload_crc,
        _RESERVED,
    )


def encode_object(header: ObjectHeader, payload: bytes | memoryview) -> bytes:
    """The stored bytes: header (with length and checksum filled in from the payload) + payload."""
    data = bytearray(HEADER_SIZE + len(payload))
    data[HEADER_SIZE:] = payload
    seal_object(header, data)
    return bytes(data)


def seal_object(header: ObjectHeader, data: bytearray | memoryview) -> None:
    """Fill in the header of an object whose payload is already in place after ``HEADER_SIZE`` bytes.

    The engine's step copies a block's bytes straight into such a buffer; the checksum (XXH3-64, which
    releases the GIL on large buffers) and the header are written here, on the saver's thread."""
    payload = memoryview(data)[HEADER_SIZE:]
    filled = ObjectHeader(
        namespace_fingerprint=header.namespace_fingerprint,
        chain_hash=header.chain_hash,
        kind=header.kind,
        dtype=header.dtype,
        num_layers=header.num_layers,
        token_start=header.token_start,
        token_end=header.token_end,
        payload_len=len(payload),
        payload_crc=payload_checksum(payload),
        group=header.group,
    )
    data[:HEADER_SIZE] = encode_header(filled)


def decode_header(data: bytes | memoryview) -> ObjectHeader:
    if len(data) < HEADER_SIZE:
        raise ObjectRejected("truncated", f"{len(data)} bytes is shorter than the {HEADER_SIZE}-byte header")
    (magic, version, header_size, ns, chain, kind_code, group, dtype, layers, start, end, plen, crc, reserved) = (
        _HEADER.unpack_from(data)
    )
    if magic != MAGIC:
        raise ObjectRejected("foreign", "not a kvtool object (bad magic)")
    if version != FORMAT_VERSION or header_size != HEADER_SIZE:
        raise ObjectRejected("version", f"object format {version} is not {FORMAT_VERSION}")
    kinds = {code: kind for kind, code in _KIND_CODES.items()}
    if reserved != _RESERVED:
        raise ObjectRejected("corrupt", "reserved header bytes are not zero")
    if kind_code not in kinds:
        raise ObjectRejected("corrupt", f"unknown kind code {kind_code}")
    return ObjectHeader(
        namespace_fingerprint=ns,
        chain_hash=chain,
        kind=kinds[kind_code],
        dtype=dtype.rstrip(b"\x00").decode("ascii", errors="replace"),
        num_layers=layers,
        token_start=start,
        token_end=end,
        payload_len=plen,
        payload_crc=crc,
        group=group,
    )


def verify_object(data: bytes | memoryview, expected: ObjectHeader) -> memoryview:
    """Check ``data`` against everything the reader expects; return a view of the payload.

    ``expected.payload_len`` is the exact payload size the reader's KV layout needs;
    ``expected.payload_crc`` is ignored (the checksum is checked against the payload itself).
    """
    header = decode_header(data)
    if header.namespace_fingerprint != expected.namespace_fingerprint:
        raise ObjectRejected("namespace", "object was written under another namespace")
    if header.chain_hash != expected.chain_hash:
        raise ObjectRejected("hash", "object's chain hash differs from its key's")
    checks = (
        ("kind", header.kind, expected.kind),
        ("group", header.group, expected.group),
        ("dtype", header.dtype, expected.dtype),
        ("layers", header.num_layers, expected.num_layers),
        ("token_start", header.token_start, expected.token_start),
        ("token_end", header.token_end, expected.token_end),
        ("payload_len", header.payload_len, expected.payload_len),
    )
    for name, found, wanted in checks:
        if found != wanted:
            raise ObjectRejected("mismatch", f"{name} is {found}, expected {wanted}")
    if len(data) != HEADER_SIZE + header.payload_len:
        raise ObjectRejected(
            "truncated", f"object is {len(data)} bytes, header says {HEADER_SIZE + header.payload_len}"
        )
    payload = memoryview(data)[HEADER_SIZE:]
    if payload_checksum(payload) != header.payload_crc:
        raise ObjectRejected("checksum", "payload checksum does not match")
    return payload


# -- pointers ----------------------------------------------------------------------------------------
#
# A pointer names the stored object that holds the KV of a prefix ending inside it (a divergence point):
# its key has the prefix's hash, its value says which object of the same group to load, and carries that
# object's token ids from the pointer's boundary to the object's end. A lookup compares them with the
# prompt's and claims the exact common prefix: the chain hash in the key binds everything else that
# makes KV differ (the root: salt, adapter, multimodal inputs, embeddings), so past the boundary only
# the token ids can.
#
#   magic "KVP1" | format u16 | namespace fingerprint 16B | chain hash 16B (the pointer's) | group u8 |
#   boundary u32 | target kind u8 | target token_end u32 | target chain hash 16B |
#   token ids u32 x (target token_end - boundary) | crc32 u32 of all before it

POINTER_MAGIC = b"KVP1"
_POINTER = struct.Struct("<4sH16s16sBIBI16s")
_CRC = struct.Struct("<I")


def pointer_size(block_size: int) -> int:
    """The most bytes a pointer record takes (a bound: a pointer stands strictly inside its object)."""
    return _POINTER.size + 4 * block_size + _CRC.size


@dataclass(frozen=True)
class PointerRecord:
    namespace_fingerprint: bytes
    chain_hash: bytes  # the hash of the prefix the pointer stands for (its key's)
    group: int
    boundary: int
    target_kind: KeyKind  # BLOCK or TAIL: an object of the same group, starting at the same block
    target_end: int
    target_hash: bytes
    token_ids: tuple[int, ...] = ()  # the target's tokens [boundary, target_end)


def encode_pointer(record: PointerRecord) -> bytes:
    head = _POINTER.pack(
        POINTER_MAGIC,
        FORMAT_VERSION,
        record.namespace_fingerprint,
        record.chain_hash,
        record.group,
        record.boundary,
        _KIND_CODES[record.target_kind],
        record.target_end,
        record.target_hash,
    )
    body = head + struct.pack(f"<{len(record.token_ids)}I", *record.token_ids)
    return body + _CRC.pack(zlib.crc32(body))


def verify_pointer(
    data: bytes | memoryview, namespace: str, chain_hash: bytes, group: int, boundary: int, block_size: int
) -> PointerRecord:
    """Check a stored pointer against the one a lookup asked for (its namespace key component, prefix
    hash, group and boundary); return it. Its target must be a block or tail of the same block that
    reaches past it, and its token ids cover exactly that reach. The object it names is checked in full
    when it is loaded."""
    if len(data) < _POINTER.size + _CRC.size:
        raise ObjectRejected("truncated", f"a pointer is at least {_POINTER.size + _CRC.size} bytes, not {len(data)}")
    magic, version, ns, chain, found_group, found_boundary, kind_code, target_end, target_hash = _POINTER.unpack_from(
        data
    )
    if magic != POINTER_MAGIC or version != FORMAT_VERSION:
        raise ObjectRejected("foreign", "not a kvtool pointer of this format")
    if len(data) != _POINTER.size + 4 * max(0, target_end - found_boundary) + _CRC.size:
        raise ObjectRejected("truncated", f"pointer of {len(data)} bytes for {target_end - found_boundary} tokens")
    body = memoryview(data)[: len(data) - _CRC.size]
    if zlib.crc32(body) != _CRC.unpack_from(data, len(body))[0]:
        raise ObjectRejected("checksum", "pointer checksum does not match")
    if not ns.hex().startswith(namespace):
        raise ObjectRejected("namespace", "pointer was written under another namespace")
    if chain != chain_hash or (found_group, found_boundary) != (group, boundary):
        raise ObjectRejected("hash", "pointer's prefix differs from its key's")
    kinds = {code: kind for kind, code in _KIND_CODES.items()}
    kind = kinds.get(kind_code)
    block_end = (boundary // block_size + 1) * block_size
    if kind not in (KeyKind.BLOCK, KeyKind.TAIL) or not boundary < target_end <= block_end:
        raise ObjectRejected("corrupt", f"pointer at {boundary} names {kind} ending at {target_end}")
    if (kind is KeyKind.BLOCK) != (target_end == block_end):
        raise ObjectRejected("corrupt", f"pointer names a {kind.name.lower()} ending at {target_end}")
    ids = struct.unpack_from(f"<{target_end - boundary}I", data, _POINTER.size)
    return PointerRecord(ns, chain, group, boundary, kind, target_end, target_hash, ids)
