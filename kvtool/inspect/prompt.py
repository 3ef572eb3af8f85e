"""`kvtool inspect prompt`: a prompt's keys, boundary by boundary, the hit a consumer would get now,
and why every missing boundary is missing.

The hashing is the connector's own (``PromptKeys``); the hit is the connector's own rule
(``find_stored_prefix`` then ``plan_load`` with no local prefix-cache hit), so the prediction equals
what a consumer reports as ``local_hit_tokens + external_hit_tokens``. Everything above
``prompt_report`` is pure: it works on a snapshot of the store (``misses.StoreSnapshot``), and why a
boundary misses is ``misses``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from connector.config import EXTEND_MIN_TOKENS, KVToolConfig, divergence_grid, has_lead_pointers
from connector.core.hashing import RequestIdentity, save_tail_boundary
from connector.core.keys import NAMESPACE_HEX, KeyKind, decode_key
from connector.core.objects import ObjectHeader
from connector.core.prefix import PromptKeys, plan_load
from connector.core.search import find_stored_prefix

from kvtool.errors import UserError
from kvtool.report import Report, ReportTable
from kvtool.inspect.misses import NEVER_STORED, Coverage, StoreSnapshot, check_object, miss_reason, record_coverage
from kvtool.inspect.target import Target, open_reader

if TYPE_CHECKING:
    from connector.core.profit import CostModel

# Objects read per get: the bytes API fails above the client's local buffer.
READ_BATCH = 8


@dataclass(frozen=True)
class Boundary:
    """One boundary of the prompt: a full block's end or a tail's end."""

    end_token: int
    kind: str
    key: str
    stored: bool
    in_hit: bool
    miss_reason: str | None


@dataclass(frozen=True)
class PromptInspection:
    namespace: str
    prompt_tokens: int
    block_size: int
    hash_unit: int
    save_tail_boundary: int | None  # where a producer of exactly this prompt publishes its tail
    stored_prefix_tokens: int  # longest stored prefix by existence, before the one-token cap
    hit_tokens: int  # what a consumer reports now (local + external), by existence: the connector's lookup
    block_hit_tokens: int
    tail_hit_tokens: int
    loadable_hit_tokens: int  # the same, with objects that fail their check treated as missing
    boundaries: list[Boundary]
    hidden_never_stored: int  # tail boundaries not shown: absent everywhere, no watermark, not the save boundary


def expected_header(keys: PromptKeys, kind: KeyKind, end_token: int) -> ObjectHeader:
    """The fields a reader derives from the key alone (the rest comes from its layout)."""
    start = ((end_token - 1) // keys.block_size) * keys.block_size
    chain = keys.block_chain[end_token // keys.block_size - 1] if kind is KeyKind.BLOCK else keys.tail_hash(end_token)
    return ObjectHeader(b"", chain, kind, "", 0, start, end_token, 0)


def candidate_boundaries(keys: PromptKeys) -> list[tuple[KeyKind, int, str]]:
    """Every key a lookup of this prompt could ask for, in token order: (kind, end token, key). Pointers
    (on the pair's divergence grid) stand where a stored object of another prompt holds this prefix."""
    found = [(KeyKind.BLOCK, (i + 1) * keys.block_size, keys.block_key(i)) for i in range(keys.num_full_blocks)]
    for block_index in range(len(keys.tokens) // keys.block_size + 1):
        found += [(KeyKind.TAIL, b, keys.tail_key(b)) for b in keys.tail_candidates(block_index)]
        if keys.grid:  # on the grid inside the block, and at its first token (lead pointers)
            ends = keys.pointer_ends(block_index, len(keys.tokens))
            found += [(KeyKind.POINTER, b, keys.pointer_ref(b).key) for b in ends]
    order = {KeyKind.BLOCK: 0, KeyKind.TAIL: 1, KeyKind.POINTER: 2}
    return sorted(found, key=lambda item: (item[1], order[item[0]]))


def inspect_prompt(keys: PromptKeys, snapshot: StoreSnapshot, show_all: bool = False) -> PromptInspection:
    def exists(asked: list[str]) -> list[bool]:
        return [key in snapshot.keys for key in asked]

    def loadable(asked: list[str]) -> list[bool]:
        return [key in snapshot.keys and key not in snapshot.check_failures for key in asked]

    records = snapshot.pointer_records
    read = None if records is None else lambda asked: [records.get(key) for key in asked]
    stored = find_stored_prefix(keys, exists, read, EXTEND_MIN_TOKENS)
    plan = plan_load(keys, stored, local_tokens=0)
    loadable_plan = plan_load(keys, find_stored_prefix(keys, loadable, read, EXTEND_MIN_TOKENS), local_tokens=0)
    hit_keys = {obj.key for obj in plan.objects}
    save_boundary = save_tail_boundary(len(keys.tokens), keys.block_size, keys.hash_unit)

    rows: list[Boundary] = []
    hidden = 0
    for kind, end_token, key in candidate_boundaries(keys):
        present = key in snapshot.keys
        chain = expected_header(keys, kind, end_token).chain_hash
        others = [ns for ns in snapshot.namespaces_holding(kind, end_token, chain) if ns != keys.namespace]
        reason = miss_reason(present, kind, end_token, others, snapshot.coverage, snapshot.check_failures.get(key))
        interesting = kind is KeyKind.BLOCK or present or end_token == save_boundary or reason != NEVER_STORED
        if not (interesting or show_all):
            hidden += 1
            continue
        rows.append(Boundary(end_token, kind.name.lower(), key, present, key in hit_keys, reason))
    return PromptInspection(
        namespace=keys.namespace,
        prompt_tokens=len(keys.tokens),
        block_size=keys.block_size,
        hash_unit=keys.hash_unit,
        save_tail_boundary=save_boundary,
        stored_prefix_tokens=stored.tokens,
        hit_tokens=plan.external_tokens,
        block_hit_tokens=plan.block_tokens,
        tail_hit_tokens=plan.tail_tokens,
        loadable_hit_tokens=loadable_plan.external_tokens,
        boundaries=rows,
        hidden_never_stored=hidden,
    )


def choose_namespace(given: str | None, available: Sequence[str]) -> str:
    if given is not None:
        if len(given) != NAMESPACE_HEX or any(c not in "0123456789abcdef" for c in given):
            known = f" (the store holds {', '.join(available)})" if available else ""
            raise UserError(
                f"--namespace {given!r} is not a kvtool namespace, {NAMESPACE_HEX} lower-case hex digits{known}"
            )
        return given
    if len(available) == 1:
        return available[0]
    if not available:
        raise UserError("the store holds no kvtool block or tail keys, so no namespace to hash under: give --namespace")
    raise UserError(f"the store holds several kvtool namespaces ({', '.join(available)}): choose one with --namespace")


# ---- I/O ------------------------------------------------------------------------------------


def read_pointers(target: Target, pointer_keys: list[str]) -> dict[str, bytes]:
    """The stored records of these pointers (a missing one is left out)."""
    if not pointer_keys:
        return {}
    reader = open_reader(target)
    try:
        values = reader.get(pointer_keys)
    finally:
        reader.close()
    return {key: value for key, value in zip(pointer_keys, values, strict=True) if value is not None}


def read_checks(target: Target, keys: PromptKeys, stored_keys: Iterable[tuple[KeyKind, int, str]]) -> dict[str, str]:
    """Read every stored object of the prompt and check it; key -> cause for those that fail."""
    stored_keys = list(stored_keys)
    if not stored_keys:
        return {}
    reader = open_reader(target)
    failures: dict[str, str] = {}
    try:
        for start in range(0, len(stored_keys), READ_BATCH):
            chunk = stored_keys[start : start + READ_BATCH]
            for (kind, end_token, key), data in zip(chunk, reader.get([k for _, _, k in chunk]), strict=True):
                cause = check_object(data, keys.namespace, expected_header(keys, kind, end_token))
                if cause is not None:
                    failures[key] = cause
    finally:
        reader.close()
    return failures


def _coverage(
    target: Target, chosen: str, keys: PromptKeys, every: list[str], request_ids: list[str], notes: list[str]
) -> list[Coverage]:
    """What the producers' watermark records say they stored of this prompt: the records of the given
    requests, else every record whose last block or tail key is this prompt's."""
    from kvtool.inspect.watermarks import read_watermarks

    coverage: list[Coverage] = []
    has_watermarks = any((d := decode_key(k)) is not None and d.kind is KeyKind.WATERMARK for k in every)
    if request_ids:
        wanted = set(request_ids)
        for item in read_watermarks(target, chosen, keys=every):
            record = item.record
            if record is not None and record.request_id in wanted:
                coverage.append(
                    Coverage(record.request_id, record.durable_offset, record.tail_boundary, record.tail_durable)
                )
                wanted.discard(record.request_id)
        if wanted:
            notes.append(f"no watermark record in namespace {chosen} for request(s): {', '.join(sorted(wanted))}")
    elif has_watermarks:
        # Records name their prompt's last block key and tail key: match them to this prompt by those.
        for item in read_watermarks(target, chosen, keys=every):
            matched = record_coverage(item.record, keys) if item.record is not None else None
            if matched is not None:
                coverage.append(matched)
    return coverage


def _cost_summary(target: Target, keys: PromptKeys, result: PromptInspection, cost: CostModel) -> dict[str, object]:
    """What the connector's cost model (an engine's figures) would load of the hit, and why."""
    from kvtool.inspect.cost import cost_verdict

    in_hit = [b.key for b in result.boundaries if b.in_hit and b.kind in ("block", "tail")]
    sizes = [size for size in target.store.sizes(in_hit[:1]).values() if size] if in_hit else []
    if not sizes:
        return {"cost_taken_tokens": result.hit_tokens, "cost_verdict": "no stored object of the hit to weigh"}
    taken, why = cost_verdict(result.hit_tokens, keys.block_size, sizes[0], cost)
    return {"cost_taken_tokens": taken, "cost_verdict": why}


def default_grid(block_size: int) -> int:
    """The divergence grid of a connector left at its default, on engines of ``block_size``."""
    return divergence_grid(KVToolConfig(master_server_address="127.0.0.1:1"), block_size)


def _grid_sizes(target: Target, block_size: int | None, hash_unit: int | None) -> tuple[int, int]:
    """The block size and hash unit given, else the pair's; a UserError for values that cannot be."""
    block_size = block_size if block_size is not None else target.block_size
    if block_size is None:
        raise UserError("the block size is not known: give --block-size or --pair READY_FILE")
    if block_size < 1:
        raise UserError(f"--block-size {block_size} is not a block size; give the engines' (1 or more)")
    hash_unit = hash_unit if hash_unit is not None else target.hash_unit or 1
    if not 1 <= hash_unit <= block_size:
        raise UserError(f"--hash-unit {hash_unit} is outside 1..{block_size} (the block size)")
    return block_size, hash_unit


def prompt_report(
    target: Target,
    tokens: list[int],
    namespace: str | None,
    block_size: int | None,
    hash_unit: int | None,
    cache_salt: str | None,
    request_ids: list[str],
    verify: bool,
    show_all: bool,
    cost: CostModel | None = None,
) -> Report:
    from kvtool.inspect.keys import describe_key, namespaces

    block_size, hash_unit = _grid_sizes(target, block_size, hash_unit)
    every = target.store.keys()
    chosen = choose_namespace(namespace, namespaces(describe_key(k) for k in every))
    root = RequestIdentity(cache_salt=cache_salt).root_hash()
    # The pair's grid, else the connector's default (a quarter block); lead pointers as it puts them.
    grid = target.divergence_grid if target.divergence_grid is not None else default_grid(block_size)
    keys = PromptKeys.build(tokens, block_size, hash_unit, chosen, root, None, grid, has_lead_pointers(grid))
    notes: list[str] = []

    coverage = _coverage(target, chosen, keys, every, request_ids, notes)

    present = frozenset(every)
    checks: dict[str, str] = {}
    records: dict[str, bytes] | None = None
    if verify and target.master:
        # Objects are read and checked; pointers are read, and checked as a lookup checks them.
        ours = [c for c in candidate_boundaries(keys) if c[2] in present and c[0] is not KeyKind.POINTER]
        checks = read_checks(target, keys, ours)
        records = read_pointers(
            target, [c[2] for c in candidate_boundaries(keys) if c[2] in present and c[0] is KeyKind.POINTER]
        )
    elif verify:
        notes.append("objects were not read and checked: give --master HOST:PORT or --pair READY_FILE")

    result = inspect_prompt(keys, StoreSnapshot(present, coverage, checks, records), show_all)
    if result.hidden_never_stored:
        notes.append(f"{result.hidden_never_stored} other tail boundaries: never stored (--all-boundaries lists them)")
    if result.loadable_hit_tokens != result.hit_tokens:
        notes.append(
            f"a consumer's lookup reports {result.hit_tokens} tokens but only {result.loadable_hit_tokens} would load: "
            "the rest fail their check and are recomputed"
        )
    notes.append(
        "a consumer reports this hit as local_hit_tokens + external_hit_tokens (vLLM's own prefix cache takes "
        "whole blocks first)"
    )
    payload = asdict(result)
    rows = [
        {**asdict(b), "stored": b.stored, "in_hit": b.in_hit, "miss_reason": b.miss_reason or ""}
        for b in result.boundaries
    ]
    summary = {
        name: payload[name]
        for name in ("namespace", "prompt_tokens", "hit_tokens", "block_hit_tokens", "tail_hit_tokens")
        + ("loadable_hit_tokens", "stored_prefix_tokens", "save_tail_boundary")
    }
    if cost is not None:
        summary.update(_cost_summary(target, keys, result, cost))
        payload.update(summary)
    return Report(
        tables=[
            ReportTable(
                f"prompt of {len(tokens)} tokens (block size {block_size}, hash unit {hash_unit}, "
                f"divergence grid {keys.grid or 'off'})",
                ["end_token", "kind", "stored", "in_hit", "miss_reason", "key"],
                rows,
            )
        ],
        summary=summary,
        notes=notes,
        payload={"admin": target.admin, **payload, "notes": notes},
    )
