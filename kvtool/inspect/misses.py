"""Why a prompt's boundary misses, told from a snapshot of the store (pure): never stored, evicted or
expired (a watermark of this prompt said it was durable), stored under another namespace (the same
tokens, incompatible KV), or stored but failing the check a reader makes. ``kvtool inspect prompt``
(``prompt``) walks the boundaries and asks this module about each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from connector.core.keys import KeyKind, decode_key
from connector.core.objects import ObjectHeader, ObjectRejected, decode_header, verify_object
from connector.core.prefix import PromptKeys
from connector.core.watermarks import WatermarkRecord

NEVER_STORED = "never stored"
EVICTED = "evicted or expired"
OTHER_NAMESPACE = "stored under another namespace"
FAILED_CHECK = "object failed its check"

# ---- the store, as a snapshot ---------------------------------------------------------------


@dataclass(frozen=True)
class Coverage:
    """What one watermark record says is durable for this prompt."""

    request_id: str
    durable_offset: int
    tail_boundary: int | None
    tail_durable: bool

    def covers(self, kind: KeyKind, end_token: int) -> bool:
        if kind is KeyKind.BLOCK:
            return end_token <= self.durable_offset
        return self.tail_durable and self.tail_boundary == end_token


def record_coverage(record: WatermarkRecord, keys: PromptKeys) -> Coverage | None:
    """What a watermark record says about this prompt, matched by the keys it names; None if unrelated.

    A record whose prompt's last full block is one of this prompt's blocks shares every block up to
    it; a record whose tail key is this prompt's tail key at that boundary shares the tail as well.
    """
    block_size = keys.block_size
    shared_end = 0
    for index in range(keys.num_full_blocks):
        if record.last_block_key == keys.block_key(index):
            shared_end = (index + 1) * block_size
    boundary = record.tail_boundary
    tail_shared = (
        record.tail_key is not None
        and boundary is not None
        and boundary <= len(keys.tokens)
        and boundary % block_size != 0
        and record.tail_key == keys.tail_key(boundary)
    )
    if tail_shared:
        shared_end = max(shared_end, boundary // block_size * block_size)
    if not shared_end and not tail_shared:
        return None
    return Coverage(
        record.request_id,
        min(record.durable_offset, boundary if tail_shared and record.tail_durable else shared_end),
        boundary if tail_shared else None,
        tail_shared and record.tail_durable,
    )


@dataclass
class StoreSnapshot:
    """Keys present, where chain hashes live under other namespaces, watermarks, object checks."""

    keys: frozenset[str]
    coverage: list[Coverage] = field(default_factory=list)
    # key -> cause of the failed check; keys not listed passed it (or were not read)
    check_failures: dict[str, str] = field(default_factory=dict)
    # The prompt's stored pointer records, read (a lookup reads them and checks what they name);
    # None when not read: pointers are then taken as they are.
    pointer_records: dict[str, bytes] | None = None
    _by_hash: dict[tuple[str, int, str], list[str]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for key in self.keys:
            decoded = decode_key(key)
            if decoded is not None and decoded.kind in (KeyKind.BLOCK, KeyKind.TAIL):
                ident = (decoded.kind.value, decoded.end_token, decoded.chain_hash)
                self._by_hash.setdefault(ident, []).append(decoded.namespace)

    def namespaces_holding(self, kind: KeyKind, end_token: int, chain_hash: bytes) -> list[str]:
        return sorted(self._by_hash.get((kind.value, end_token, chain_hash.hex()), []))


# ---- pure logic -----------------------------------------------------------------------------


def miss_reason(
    present: bool,
    kind: KeyKind,
    end_token: int,
    other_namespaces: Sequence[str],
    coverage: Sequence[Coverage],
    check_failure: str | None,
) -> str | None:
    """Why a boundary is not loadable, or None when it is.

    A present object that fails its check is a miss (the consumer recomputes). An absent one is
    under another namespace when the same chain hash is stored there (same tokens, incompatible KV);
    evicted or expired when a watermark of this prompt says it was durable; else never stored.
    """
    if present:
        return f"{FAILED_CHECK}: {check_failure}" if check_failure else None
    if other_namespaces:
        return f"{OTHER_NAMESPACE} ({', '.join(other_namespaces)})"
    covering = [c.request_id for c in coverage if c.covers(kind, end_token)]
    if covering:
        return f"{EVICTED} (watermark of request {covering[0]} says it was durable)"
    return NEVER_STORED


def check_object(data: bytes | None, namespace: str, expected: ObjectHeader) -> str | None:
    """Why a stored object would be rejected by a reader of ``namespace``, or None.

    Only the key's 16-hex namespace is known here, not the full fingerprint, dtype, layer count or
    payload size a reader's layout fixes, so those are taken from the header itself once its
    fingerprint's prefix matches; the rest (kind, chain hash, token range, length, checksum) is
    checked by the connector's own ``verify_object``.
    """
    if data is None:
        return "unreadable: the master lists it but its bytes could not be read (its segment's owner may have left)"
    try:
        header = decode_header(data)
        if header.namespace_fingerprint.hex()[: len(namespace)] != namespace:
            return "namespace: the header's namespace fingerprint is not the key's"
        verify_object(
            data,
            ObjectHeader(
                namespace_fingerprint=header.namespace_fingerprint,
                chain_hash=expected.chain_hash,
                kind=expected.kind,
                dtype=header.dtype,
                num_layers=header.num_layers,
                token_start=expected.token_start,
                token_end=expected.token_end,
                payload_len=header.payload_len,
            ),
        )
    except ObjectRejected as exc:
        return str(exc)
    return None
