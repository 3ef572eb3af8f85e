"""A request's hit details: the one contract between the connector and whoever reads its hits.

The scheduler side builds one per finished request and returns it to the client in the response's
``kv_transfer_params["kvtool"]``; the request log (``request_log``) writes the same fields, plus the
vLLM request id and the client's ``kvtool_tag``, one JSON line per request. ``kvtool bench``,
``kvtool inspect`` and the tests parse both with ``HitDetails.from_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .ranks import keys_on_every_rank


@dataclass(frozen=True)
class HitDetails:
    prompt_tokens: int
    lookup: str  # "hit", "miss", "error: ...", "load failed: ...", "not looked up", ...
    stored_prefix_tokens: int = 0  # the longest prefix the lookup found in the store
    local_hit_tokens: int = 0  # vLLM's own (block-aligned) prefix-cache hit
    external_hit_tokens: int = 0  # loaded from the store (what vLLM really reused of it)
    block_hit_tokens: int = 0  # of external_hit_tokens, from full-block objects
    tail_hit_tokens: int = 0  # of external_hit_tokens, from a tail object
    load_failure: str | None = None  # cause, when the load failed and vLLM recomputed
    save_objects: int = 0  # objects the save copied for its puts (a producer)
    save_tail_boundary: int | None = None
    save_last_key: str | None = None  # puts run in order: once it is stored, every put was tried
    watermark_key: str | None = None  # written after every put of the save: the save ended
    namespace: str = ""
    # A decoding engine's save of prompt + answer at request end (``save_answers``): the tokens whose KV
    # it covers (prompt + generated, less the last generated token, which has no KV), the objects it
    # copied, and its last key (puts run in order: once that key is stored, every put was tried).
    answer_tokens: int = 0
    answer_save_objects: int = 0
    answer_last_key: str | None = None
    # The lookup could not read a pointer record its best hit relied on (a store or transfer failure):
    # the hit fell back to what the lookup found without it.
    pointer_read_failed: bool = False
    # The connector did not take all the hit it found: "unprofitable: ..." (a load would have cost more
    # than the prefill it saves) or "trimmed: ..." (the partial block's object was dropped).
    load_skipped: str | None = None
    # Where its first step went: {mark: [ms, scheduler steps] since the connector first saw it}, marks
    # "answered" (lookup), "load_sent", "load_done", "computing" (connector.core.timeline).
    timeline: dict[str, list[float]] | None = None
    # With tensor parallelism, every rank's namespace (rank 0 first: the one the keys above name); each
    # rank saves its share of the KV under its own (``connector.core.ranks``). Empty for one rank.
    tp_namespaces: tuple[str, ...] = ()
    # Only in request-log records: the vLLM request id and the client's kvtool_tag.
    request_id: str | None = None
    tag: str | None = None

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens not computed: vLLM's local hit plus what the connector loaded."""
        return self.local_hit_tokens + self.external_hit_tokens

    def __post_init__(self) -> None:
        object.__setattr__(self, "tp_namespaces", tuple(self.tp_namespaces))  # JSON gives a list

    def on_every_rank(self, key: str) -> list[str]:
        """One of the keys above as every TP rank names it (a save is durable when all of them are stored)."""
        return keys_on_every_rank(key, self.tp_namespaces or (self.namespace,))

    def to_dict(self) -> dict[str, Any]:
        # Field by field, not ``asdict``: its deep copy cost every finishing request 50 us of the engine's
        # thread, and every value here is immutable or made for this object (the timeline's dict).
        data = {item.name: getattr(self, item.name) for item in _FIELDS}
        data["tp_namespaces"] = list(self.tp_namespaces)
        if self.request_id is None and self.tag is None:
            del data["request_id"], data["tag"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HitDetails:
        """Parse a response's or a request log's details; fields of a newer connector are ignored.

        Raises ValueError when a required field is missing."""
        known = {item.name for item in _FIELDS}
        try:
            return cls(**{name: value for name, value in data.items() if name in known})
        except TypeError as exc:
            raise ValueError(f"not kvtool hit details: {exc}") from None

    @classmethod
    def from_response(cls, response: dict[str, Any]) -> HitDetails | None:
        """The details in a /v1/completions response, or None when it carries none."""
        params = response.get("kv_transfer_params") or {}
        details = params.get("kvtool")
        return cls.from_dict(details) if isinstance(details, dict) else None


_FIELDS = fields(HitDetails)
