"""Watermarks: how far a producer's save of one request is confirmed in the store. Pure logic.

Per cache group, the block offset is the end of the longest run of full blocks, from the group's
first saved block (token 0, or for a sliding-window group the first block it still held), each of
which was already stored or whose put succeeded. The tail is tracked apart: it is durable only when
its own put succeeded (or it was already stored) *and* every full block before it is durable. A
group's offset is its tail boundary when the tail is durable and its block offset otherwise. The
durable offset is the smallest over the attention groups, so a failed tail put stays a miss and never
moves it. A state group (Mamba) serves a hit only where a state is stored at exactly its end: with
state groups, the durable offset is the furthest end, no further than every attention group's offset,
at which each state group has a durable state in the save (0 where there is none). A watermark never
runs ahead of loadable data.

Records are published as immutable objects (seq 0 when the save starts, seq 1 when it ends), small
UTF-8 JSON documents that ``kvtool inspect watermarks`` reads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import Enum

from .keys import KeyKind

SEQ_PENDING = 0
SEQ_FINAL = 1


class SaveState(str, Enum):
    PENDING = "pending"
    DURABLE = "durable"
    FAILED = "failed"


@dataclass(frozen=True)
class ObjectProgress:
    """One object of a save, in prompt order: its kind, where it ends, and what became of it."""

    kind: KeyKind
    token_start: int
    token_end: int
    outcome: str  # "present" (stored before), "stored", "pending", or a failure label ("no_space", "failed", ...)
    group: int = 0

    @property
    def durable(self) -> bool:
        return self.outcome in ("present", "stored")


@dataclass(frozen=True)
class WatermarkRecord:
    request_id: str
    tag: str | None
    prompt_tokens: int
    durable_offset: int
    tail_boundary: int | None
    tail_durable: bool
    state: SaveState
    reason: str | None
    updated_unix: float
    # The keys of the prompt's last full block and of its tail: a reader that hashes a prompt matches
    # records to it by these (``kvtool inspect prompt``).
    last_block_key: str | None = None
    tail_key: str | None = None

    def encode(self) -> bytes:
        return json.dumps({**asdict(self), "state": self.state.value}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> WatermarkRecord:
        """Parse a record; raises ValueError for anything that is not one."""
        try:
            fields = json.loads(data.decode("utf-8"))
            fields["state"] = SaveState(fields["state"])
            return cls(**fields)
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"not a kvtool watermark record: {exc}") from None


def watermark(
    request_id: str,
    tag: str | None,
    prompt_tokens: int,
    objects: list[ObjectProgress],
    updated_unix: float,
    last_block_key: str | None = None,
    tail_key: str | None = None,
    state_groups: tuple[int, ...] = (),
) -> WatermarkRecord:
    """The watermark of a save whose objects (per group: full blocks in order, then at most one tail,
    or a state) stand as given; ``state_groups``: the model's state groups, each of which needs a state
    in the save (one with none, its block not held, leaves nothing durable)."""
    durable_offset = _durable_offset(objects, state_groups)
    tails = [obj for obj in objects if obj.kind is KeyKind.TAIL]
    tail = tails[0] if tails else None
    tail_durable = tail is not None and durable_offset == tail.token_end
    failures = [obj for obj in objects if not obj.durable and obj.outcome != "pending"]
    if any(obj.outcome == "pending" for obj in objects):
        state, reason = SaveState.PENDING, None
    elif failures:
        first = failures[0]
        state = SaveState.FAILED
        reason = f"{first.kind.name.lower()} put ending at token {first.token_end}: {first.outcome}"
    else:
        state, reason = SaveState.DURABLE, None
    return WatermarkRecord(
        request_id=request_id,
        tag=tag,
        prompt_tokens=prompt_tokens,
        durable_offset=durable_offset,
        tail_boundary=tail.token_end if tail is not None else None,
        tail_durable=tail_durable,
        state=state,
        reason=reason,
        updated_unix=updated_unix,
        last_block_key=last_block_key,
        tail_key=tail_key,
    )


def _durable_offset(objects: list[ObjectProgress], state_groups: tuple[int, ...] = ()) -> int:
    """How far every group's objects are durable together (see the module's docstring)."""
    attention: list[int] = []
    # Per state group: the ends of its durable states (none for a state group with no object here).
    states: list[set[int]] = [set() for group in state_groups if all(obj.group != group for obj in objects)]
    for group in sorted({obj.group for obj in objects}):
        members = [obj for obj in objects if obj.group == group]
        if any(obj.kind is KeyKind.STATE for obj in members):
            states.append({obj.token_end for obj in members if obj.kind is KeyKind.STATE and obj.durable})
        else:
            attention.append(_group_offset(members))
    reach = min(attention, default=None)
    if not states:
        return reach or 0
    ends = set.intersection(*states)
    return max((end for end in ends if reach is None or end <= reach), default=0)


def _group_offset(objects: list[ObjectProgress]) -> int:
    """How far one attention group's objects are durable (see the module's docstring)."""
    blocks = sorted((obj for obj in objects if obj.kind is KeyKind.BLOCK), key=lambda obj: obj.token_start)
    tail = next((obj for obj in objects if obj.kind is KeyKind.TAIL), None)
    offset = blocks[0].token_start if blocks else (tail.token_start if tail is not None else 0)
    for obj in blocks:
        if not obj.durable or obj.token_start != offset:
            break
        offset = obj.token_end
    if tail is not None and tail.durable and tail.token_start == offset:
        return tail.token_end
    return offset
