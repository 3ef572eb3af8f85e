"""What the scheduler side keeps about each live request, and the keys that name what its blocks hold.

A request's keys are built from its prompt and identity when the connector first sees it, and built
again whenever vLLM has changed them since: a streaming-input session (``_update_request_as_session``)
extends the prompt with the kept answer and the next chunk, and may add multimodal inputs, while the
request keeps its blocks. Keys that no longer name what the blocks hold would let a later prompt load
KV of other tokens, so every use goes through ``TrackedRequest.refresh``.

A request whose identity or tokens cannot be keyed (unreadable embeddings or multimodal inputs, a token
id outside the key schema's uint32) is neither looked up nor saved: a miss, counted, never an error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..data import prompt_watermark_id
from ..core.groups import CacheGroup
from ..core.hashing import RequestIdentity, UnkeyableTokens
from ..core.hits import HitDetails
from ..core.identity import UnhashableRequest, identity_size, prompt_tokens, request_identity
from ..core.keys import watermark_key
from ..core.prefix import PromptKeys
from ..core.refs import LoadPlan, ObjectRef, StoredPrefix
from ..core.timeline import Timeline
from ..core.watermarks import SEQ_FINAL

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvtool")


@dataclass(frozen=True)
class KeySpace:
    """How an engine keys prompts: block size, hash unit, namespace, cache groups, divergence grid."""

    block_size: int
    hash_unit: int
    namespace: str
    groups: tuple[CacheGroup, ...]
    grid: int
    lead_pointers: bool = False  # config.lead_pointers
    # Whether vLLM names a multimodal input by its content: not where its prefix caching and its multimodal
    # processor cache are both off (it then names one by a per-process request counter, which another
    # process, or this one after a restart, gives another image): such requests are not keyed.
    mm_named_by_content: bool = True

    def keys(self, tokens: list[int] | tuple[int, ...], root: bytes) -> PromptKeys:
        return PromptKeys.build(
            tokens, self.block_size, self.hash_unit, self.namespace, root, self.groups, self.grid, self.lead_pointers
        )


def request_keys(request: Request, space: KeySpace) -> tuple[PromptKeys, str | None]:
    """The request's prompt keys, or empty keys and the reason it cannot be keyed."""
    try:
        if not space.mm_named_by_content and getattr(request, "mm_features", None):
            raise UnhashableRequest(
                "its multimodal inputs are named by a request counter, not their content (vLLM's prefix caching "
                "and its multimodal processor cache are both off): turn one on to store and reuse such requests"
            )
        root = request_identity(request).root_hash()
        return space.keys(prompt_tokens(request), root), None
    except (UnhashableRequest, UnkeyableTokens) as exc:
        return space.keys((), RequestIdentity().root_hash()), str(exc)


@dataclass
class TrackedRequest:
    """What the scheduler side keeps about one live request."""

    request: Request
    keys: PromptKeys
    keyed_size: tuple[int, int] = (0, 0)  # identity_size(request) when ``keys`` were built
    turn: int = 0  # streaming-input chunks seen before the current one (0: the first)
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    plan: LoadPlan | None = None
    stored: StoredPrefix | None = None  # what the last lookup found stored
    offered: bool = False  # a lookup answered vLLM and its allocation is still to come
    unhashable: str | None = None  # why it cannot be keyed (then it is never looked up or saved)
    stored_prefix_tokens: int = 0
    lookup: str = "not looked up"
    # Whether a lookup could pay (SchedulerSide._worth_a_lookup), for how many tokens to gain it was decided,
    # and whether its hit is taken to explore (profit.LookupVerdict).
    lookup_gain: int | None = None
    lookup_worth: bool = True
    explore: bool = False
    local_tokens: int = 0  # vLLM's own (block-aligned) prefix-cache hit, as presented to the lookup
    granted_external: int = 0  # external tokens the scheduler took
    save_scheduled: bool = False
    save_objects: int = 0
    tail_boundary_saved: int | None = None
    last_saved_key: str | None = None
    load_failure: tuple[int, str] | None = None  # (first token recomputed, cause)
    load_skipped: str | None = None  # the cost model's reason for not taking all of the hit
    saved_keys: frozenset[str] = frozenset()  # object keys the prompt's saves copied for their puts
    # Its prompt save left objects unstored (``KVToolWorkerMeta.unsaved``): its answer save takes none of
    # the prompt's objects as stored (neither its saves' nor its lookup's) and asks the store again.
    prompt_unsaved: bool = False
    loading: bool = False  # a load into its blocks is in flight (planned, not yet reported received)
    answer_tokens: int = 0
    answer_objects: int = 0
    answer_last_key: str | None = None
    timeline: Timeline | None = None  # where its first step went (connector.core.timeline)

    @classmethod
    def start(cls, request: Request, space: KeySpace, now_s: float = 0.0, step: int = 0) -> TrackedRequest:
        keys, unhashable = request_keys(request, space)
        tracked = cls(request=request, keys=keys, keyed_size=identity_size(request), unhashable=unhashable)
        arrival = getattr(request, "arrival_time", None)  # wall clock, from the API server
        tracked.timeline = Timeline.start(now_s, step, time.time() - arrival if isinstance(arrival, float) else None)
        if unhashable:
            tracked.lookup = f"not looked up: {unhashable}"
        return tracked

    def known_present(self, saves: list[ObjectRef], polled: object = None) -> list[bool]:
        """Which of ``saves`` its lookup found stored (``stored``, or ``polled``: the lookup's answer not
        taken yet). None after a failed load (the object may be gone); the worker asks the store again,
        in the background, before it puts anything."""
        stored = self.stored if self.stored is not None else polled
        if not isinstance(stored, StoredPrefix) or self.load_failure is not None:
            return [False] * len(saves)
        return [s.key in stored.present for s in saves]

    def take_blocks(self, new_block_ids: tuple[list[int], ...] | None, resumed: bool) -> None:
        """The blocks vLLM gave it in a step: a resumed request's whole tables, else more per group."""
        if resumed:
            self.block_ids = [list(ids) for ids in new_block_ids] if new_block_ids is not None else []
            return
        for group, ids in enumerate(new_block_ids or ()):
            while len(self.block_ids) <= group:
                self.block_ids.append([])
            self.block_ids[group].extend(ids)

    def refresh(self, space: KeySpace) -> bool:
        """Key the request again if vLLM changed its prompt or identity since (a streaming-input
        session's next chunk): its next save publishes the whole new prompt under its own keys.
        Returns True when it did."""
        size = identity_size(self.request)
        if size == self.keyed_size:
            return False
        self.keys, unhashable = request_keys(self.request, space)
        self.keyed_size = size
        self.unhashable = self.unhashable or unhashable
        self.turn += 1
        self.save_scheduled = False  # the new prompt is saved when it is complete
        return True

    def hit_details(self, tp_namespaces: tuple[str, ...] = ()) -> HitDetails:
        """The request's hit details, as its response and the request log carry them (``tp_namespaces``:
        every TP rank's namespace, named only for more than one)."""
        tracked = self
        plan = tracked.plan
        local = tracked.local_tokens
        external = tracked.granted_external
        block = min(plan.block_tokens, external) if plan else 0
        lookup = tracked.lookup
        if tracked.load_failure is not None:
            # vLLM recomputed from the first block that failed: report only what was really reused.
            first_bad_token, cause = tracked.load_failure
            external = max(0, min(external, first_bad_token - local))
            block = min(block, external)
            lookup = f"load failed: {cause}"
        return HitDetails(
            prompt_tokens=len(tracked.keys.tokens),
            lookup=lookup,
            stored_prefix_tokens=tracked.stored_prefix_tokens,
            local_hit_tokens=local,
            external_hit_tokens=external,
            block_hit_tokens=block,
            tail_hit_tokens=external - block,
            load_failure=tracked.load_failure[1] if tracked.load_failure else None,
            save_objects=tracked.save_objects,
            save_tail_boundary=tracked.tail_boundary_saved,
            save_last_key=tracked.last_saved_key,
            watermark_key=watermark_key(
                tracked.keys.namespace, prompt_watermark_id(tracked.request.request_id, tracked.turn), SEQ_FINAL
            )
            if tracked.save_objects
            else None,
            namespace=tracked.keys.namespace,
            answer_tokens=tracked.answer_tokens,
            answer_save_objects=tracked.answer_objects,
            answer_last_key=tracked.answer_last_key,
            load_skipped=tracked.load_skipped,
            pointer_read_failed=tracked.stored is not None and tracked.stored.pointer_read_failed,
            timeline=tracked.timeline.to_dict() if tracked.timeline is not None else None,
            tp_namespaces=tp_namespaces if len(tp_namespaces) > 1 else (),
        )
