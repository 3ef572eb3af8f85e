"""`kvtool inspect watermarks`: each request's latest published watermark record.

Records are immutable objects ``kvtool/2/<ns>/w/<request_hash>/<seq>``; the highest seq of a request
is its current state. ``latest_record_keys`` and ``watermark_rows`` are pure; reading the records
needs a store client (``target.open_reader``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from connector.core.keys import KeyKind, decode_key
from connector.core.watermarks import WatermarkRecord

from kvtool.report import Report, ReportTable
from kvtool.inspect.target import Target, open_reader

GetFn = Callable[[Sequence[str]], list[bytes | None]]


@dataclass(frozen=True)
class RecordKey:
    key: str
    namespace: str
    request_hash: str
    seq: int


def latest_record_keys(keys: Iterable[str], namespace: str | None = None) -> list[RecordKey]:
    """The highest-seq watermark key of every (namespace, request), optionally in one namespace."""
    latest: dict[tuple[str, str], RecordKey] = {}
    for key in keys:
        decoded = decode_key(key)
        if decoded is None or decoded.kind is not KeyKind.WATERMARK:
            continue
        if namespace is not None and decoded.namespace != namespace:
            continue
        ident = (decoded.namespace, decoded.request_hash)
        if ident not in latest or decoded.seq > latest[ident].seq:
            latest[ident] = RecordKey(key, decoded.namespace, decoded.request_hash, decoded.seq)
    return sorted(latest.values(), key=lambda r: (r.namespace, r.request_hash))


@dataclass(frozen=True)
class LoadedRecord:
    ref: RecordKey
    record: WatermarkRecord | None
    problem: str | None = None  # why record is None: gone, or not a record


def load_records(refs: list[RecordKey], get: GetFn) -> list[LoadedRecord]:
    values = get([r.key for r in refs]) if refs else []
    loaded = []
    for ref, value in zip(refs, values, strict=True):
        if value is None:
            loaded.append(LoadedRecord(ref, None, "record is gone (evicted, or its segment's owner left)"))
            continue
        try:
            loaded.append(LoadedRecord(ref, WatermarkRecord.decode(value)))
        except ValueError as exc:
            loaded.append(LoadedRecord(ref, None, str(exc)))
    return loaded


def watermark_rows(loaded: list[LoadedRecord]) -> list[dict]:
    rows = []
    for item in loaded:
        row = {"namespace": item.ref.namespace, "request_hash": item.ref.request_hash, "seq": item.ref.seq}
        record = item.record
        if record is None:
            row.update(state="unreadable", reason=item.problem)
        else:
            row.update(
                request_id=record.request_id,
                tag=record.tag,
                prompt_tokens=record.prompt_tokens,
                durable_offset=record.durable_offset,
                tail_boundary=record.tail_boundary,
                tail_durable=record.tail_durable,
                state=record.state.value,
                reason=record.reason,
                updated_unix=record.updated_unix,
            )
        rows.append(row)
    return rows


def read_watermarks(target: Target, namespace: str | None = None, keys: list[str] | None = None) -> list[LoadedRecord]:
    refs = latest_record_keys(target.store.keys() if keys is None else keys, namespace)
    if not refs:
        return []
    reader = open_reader(target)
    try:
        return load_records(refs, reader.get)
    finally:
        reader.close()


def watermarks_report(target: Target, namespace: str | None, request_id: str | None) -> Report:
    loaded = read_watermarks(target, namespace)
    if request_id is not None:
        loaded = [i for i in loaded if i.record is not None and i.record.request_id == request_id]
    rows = watermark_rows(loaded)
    columns = ["request_id", "tag", "namespace", "prompt_tokens", "durable_offset", "tail_boundary", "tail_durable"]
    columns += ["state", "reason", "seq"]
    notes = [] if rows else ["no watermark records in the store (producers publish them as they save)"]
    return Report(
        tables=[ReportTable(f"watermarks at {target.admin}", columns, rows)],
        summary={"requests": len(rows)},
        notes=notes,
        payload={"admin": target.admin, "requests": len(rows), "watermarks": rows},
    )
