"""`kvtool inspect keys`: the store's keys, decoded by our schema, filtered and paged.

``describe_key`` and ``select_keys`` are pure; ``keys_report`` reads the master's admin endpoints.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from connector.core.keys import SCHEMA_VERSION, KeyKind, decode_key

from kvtool.store.admin import StoreAdmin
from kvtool.errors import UserError
from kvtool.report import Report, ReportTable

FOREIGN = "foreign"
KIND_NAMES = {
    KeyKind.BLOCK: "block",
    KeyKind.TAIL: "tail",
    KeyKind.STATE: "state",
    KeyKind.POINTER: "pointer",
    KeyKind.WATERMARK: "watermark",
}
KIND_CHOICES = (*KIND_NAMES.values(), FOREIGN)
KEY_COLUMNS = ["kind", "namespace", "group", "end_token", "tokens", "hash", "size_bytes", "key"]


@dataclass(frozen=True)
class KeyInfo:
    """One key as ``inspect keys`` shows it; foreign keys (not our schema) keep only ``key``."""

    key: str
    kind: str  # block, tail, state, watermark or foreign
    namespace: str | None = None
    end_token: int | None = None  # a block's end token, a tail's boundary, a state's position
    tokens: int | None = None  # tokens the object holds: block size for a block, valid tokens for a tail
    # (for a pointer: the tokens of its block it stands for)
    chain_hash: str | None = None
    request_hash: str | None = None
    seq: int | None = None
    size_bytes: int | None = None
    group: int | None = None  # the KV cache group of a block, tail or state


def describe_key(key: str, block_size: int | None = None) -> KeyInfo:
    """Decode ``key``; a tail's valid-token count needs the block size (``boundary % block_size``)."""
    decoded = decode_key(key)
    if decoded is None:
        return KeyInfo(key=key, kind=FOREIGN)
    tokens = None
    if decoded.kind in (KeyKind.TAIL, KeyKind.POINTER) and block_size:
        tokens = decoded.end_token % block_size
    elif decoded.kind is KeyKind.BLOCK and block_size:
        tokens = block_size
    return KeyInfo(
        key=key,
        kind=KIND_NAMES[decoded.kind],
        namespace=decoded.namespace,
        end_token=decoded.end_token,
        tokens=tokens,
        chain_hash=decoded.chain_hash,
        request_hash=decoded.request_hash,
        seq=decoded.seq,
        group=decoded.group,
    )


def check_kind(kind: str | None) -> None:
    if kind is not None and kind not in KIND_CHOICES:
        raise UserError(f"--kind {kind!r} is not one of: {', '.join(KIND_CHOICES)}")


def select_keys(
    infos: Iterable[KeyInfo], kind: str | None = None, namespace: str | None = None, prefix: str | None = None
) -> list[KeyInfo]:
    """Keys matching every filter given, ordered by namespace, kind, end token, then key."""
    check_kind(kind)
    chosen = [
        info
        for info in infos
        if (kind is None or info.kind == kind)
        and (namespace is None or info.namespace == namespace)
        and (prefix is None or info.key.startswith(prefix))
    ]
    return sorted(chosen, key=lambda i: (i.namespace or "~", i.kind, i.end_token or 0, i.seq or 0, i.key))


def namespaces(infos: Iterable[KeyInfo]) -> list[str]:
    """The kvtool namespaces that hold at least one block or tail key."""
    return sorted({i.namespace for i in infos if i.namespace is not None and i.kind in ("block", "tail", "state")})


def keys_report(
    store: StoreAdmin,
    kind: str | None,
    namespace: str | None,
    prefix: str | None,
    limit: int,
    offset: int,
    block_size: int | None,
    sizes: bool = True,
) -> Report:
    if limit <= 0 or offset < 0:
        raise UserError("--limit must be positive and --offset not negative")
    check_kind(kind)
    every = [describe_key(key, block_size) for key in store.keys()]
    matched = select_keys(every, kind, namespace, prefix)
    page = matched[offset : offset + limit]
    if sizes and page:
        found = store.sizes([i.key for i in page])
        page = [KeyInfo(**{**asdict(i), "size_bytes": found.get(i.key)}) for i in page]
    next_offset = offset + len(page) if offset + len(page) < len(matched) else None
    counts = {name: sum(1 for i in every if i.kind == name) for name in KIND_CHOICES}
    rows = [_row(i) for i in page]
    notes = []
    if not every and store.role() == "standby":
        from kvtool.inspect.store import STANDBY_NOTE

        notes.append(STANDBY_NOTE)
    if next_offset is not None:
        notes.append(f"showing {offset + 1}-{offset + len(page)} of {len(matched)}; next page: --offset {next_offset}")
    return Report(
        tables=[ReportTable(f"store keys at {store.url}", KEY_COLUMNS, rows)],
        summary={"total_keys": len(every), "matched": len(matched), "by_kind": counts},
        notes=notes,
        payload={
            "admin": store.url,
            "total_keys": len(every),
            "matched": len(matched),
            "offset": offset,
            "limit": limit,
            "next_offset": next_offset,
            "by_kind": counts,
            "keys": [asdict(i) for i in page],
        },
    )


def _row(info: KeyInfo) -> dict:
    row = asdict(info)
    row["hash"] = info.chain_hash or (f"req {info.request_hash} seq {info.seq}" if info.request_hash else None)
    if info.kind == FOREIGN:
        row["kind"] = f"foreign (not kvtool/{SCHEMA_VERSION})"
    return row
