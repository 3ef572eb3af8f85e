"""Plain data that crosses from the scheduler-side connector to the worker-side connector."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from .core.keys import KeyKind


@dataclass(frozen=True)
class BlockTransfer:
    """One stored object and the physical block (of its cache group) it is copied from or into."""

    block_id: int
    kind: KeyKind
    token_start: int
    token_end: int
    chain_hash: bytes
    group: int = 0
    # A save's pointers to this object, put right after it: (boundary, prefix hash) at every divergence
    # grid multiple inside it, and at its first token where lead pointers are on.
    pointers: tuple[tuple[int, bytes], ...] = ()
    # With pointers: the object's token ids [token_start, token_end), which each pointer record carries
    # from its boundary on (a lookup compares them with its prompt's to find the exact common prefix).
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class RequestLoad:
    req_id: str
    transfers: tuple[BlockTransfer, ...]
    failure: str | None = None  # planned to fail: the worker reports it failed without reading anything
    # What recomputing its tokens would cost (the scheduler's cost model; None: not measured yet): a load
    # still running past it is abandoned as a miss (``loader``), as recomputing would have been quicker.
    recompute_s: float | None = None


@dataclass(frozen=True)
class StoredObject:
    """An object of the prompt that the store already holds (no put needed)."""

    kind: KeyKind
    token_start: int
    token_end: int
    group: int = 0
    # Its prefix hash: the put thread asks again whether it is stored (a lookup's answer may be seconds
    # old, and the object evicted since), so the watermark never counts an object that is gone.
    chain_hash: bytes = b""


@dataclass(frozen=True)
class RequestSave:
    req_id: str
    transfers: tuple[BlockTransfer, ...]  # objects to put, in prompt order
    already_stored: tuple[StoredObject, ...] = ()
    prompt_tokens: int = 0
    state_groups: tuple[int, ...] = ()  # the model's state groups: each needs a state for anything durable
    tag: str | None = None  # the client's kvtool_tag, echoed in the watermark record
    last_block_key: str | None = None  # of the whole prompt, stored before or not
    tail_key: str | None = None
    # A state checkpoint (a Mamba group's state at a boundary inside the prompt, saved in the step that
    # computed it): its objects are put like any save's, but it writes no watermark records.
    checkpoint: bool = False
    # A decoding engine's save of prompt + answer at request end: vLLM holds the request's blocks until
    # the worker reports it in ``finished_sending``, which it does once it copied them (or gave up).
    # Its watermark records are the request's ``answer_watermark_id``.
    answer: bool = False
    # A streaming-input session's chunk (0: the first prompt): each chunk's prompt save has records of
    # its own, since records are immutable.
    turn: int = 0

    @property
    def watermark_id(self) -> str:
        return answer_watermark_id(self.req_id) if self.answer else prompt_watermark_id(self.req_id, self.turn)

    @property
    def is_prompt_save(self) -> bool:
        """A save of the prompt's own objects (those an answer save takes as covered: ``unsaved``)."""
        return not (self.answer or self.checkpoint)


def answer_watermark_id(req_id: str) -> str:
    """The id an answer save's watermark records are keyed by (the prompt's save has the request's)."""
    return f"{req_id}#answer"


def prompt_watermark_id(req_id: str, turn: int = 0) -> str:
    """The id a prompt save's watermark records are keyed by: the request's, or for a streaming-input
    session's later chunk, the request's and the chunk's number."""
    return req_id if turn == 0 else f"{req_id}#turn{turn}"


@dataclass
class KVToolMetadata(KVConnectorMetadata):
    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[RequestSave] = field(default_factory=list)
    # vLLM's copy-on-write block copies of this step, (source, destination): the worker redoes them
    # whole before the forward (``WorkerSide.repair_block_copies``).
    block_copies: tuple[tuple[int, int], ...] = ()
    step_tokens: int = 0  # tokens this step schedules: the worker times its forward pass (profit.py)


@dataclass
class KVToolWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: loads that failed, so hit details never claim tokens vLLM recomputed, and
    the measurements the cost model is fitted from (``profit.CostModel``)."""

    load_failures: dict[str, tuple[int, str]] = field(default_factory=dict)  # req_id -> (first bad token, cause)
    # (bytes, seconds of the transfer, seconds its request waited) of each load applied
    load_samples: list[tuple[int, float, float]] = field(default_factory=list)
    step_samples: list[tuple[int, float]] = field(default_factory=list)  # (tokens scheduled, forward seconds)
    # Requests whose prompt save left an object it copied unstored (a put failed, the store was full):
    # their answer save puts the prompt's objects again where they are still missing.
    unsaved: frozenset[str] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = dict(self.load_failures)
        for req_id, failure in getattr(other, "load_failures", {}).items():
            merged[req_id] = min(failure, merged.get(req_id, failure))
        loads = self.load_samples + list(getattr(other, "load_samples", []))
        steps = self.step_samples + list(getattr(other, "step_samples", []))
        return KVToolWorkerMeta(merged, loads, steps, self.unsaved | getattr(other, "unsaved", frozenset()))
