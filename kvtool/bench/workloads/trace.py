"""Replay of a Mooncake FAST'25 trace (shared/traces/README.md): one JSON object a line with
``input_length``, ``output_length`` and ``hash_ids`` (one id per 512-token block).

Token content is made from the ids: block id ``h`` always becomes the same ``block_tokens``
tokens, so equal ids at equal positions give equal prefixes. Lengths scale with the block
(``block_tokens / 512``), which keeps the reuse structure; a prompt longer than the engine takes is
cut to its first ``max_prompt_tokens`` tokens. Each request is served by the consumer from what the
requests before it published, then published by the producer for the requests after it.

Not modelled: a later request's full block extending an earlier request's partial tail (the format
cannot say when that happens; the ids of partial blocks never recur), so tails are reused only when
a prompt repeats one exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvtool.errors import UserError

from .base import Step, StepList, Workload, WorkloadShape, random_tokens, workload_rng

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    timestamp_ms: int | None = None  # its arrival, from the trace's first request (None: the record has none)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_trace_line(line: str, where: str) -> TraceRequest:
    try:
        record = json.loads(line)
        fields = (record["input_length"], record["output_length"], record["hash_ids"])
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{where} is not a Mooncake trace record ({exc}); see shared/traces/README.md") from None
    input_length, output_length, hash_ids = fields
    if not (_whole(input_length) and _whole(output_length) and output_length >= 0):
        raise UserError(f"{where}: input_length and output_length must be whole numbers (output_length 0 or more)")
    if not isinstance(hash_ids, list) or not all(_whole(block) for block in hash_ids):
        raise UserError(f"{where}: hash_ids must be a list of whole numbers, one a 512-token block")
    timestamp = record.get("timestamp")
    if timestamp is not None and not (isinstance(timestamp, int | float) and not isinstance(timestamp, bool)):
        raise UserError(f"{where}: timestamp must be a number of milliseconds")
    if timestamp is not None and timestamp < 0:
        raise UserError(f"{where}: timestamp {timestamp} must be 0 or more")
    request = TraceRequest(input_length, output_length, tuple(hash_ids), None if timestamp is None else int(timestamp))
    expected_ids = -(-request.input_length // TRACE_BLOCK_TOKENS)
    if request.input_length <= 0 or len(request.hash_ids) != expected_ids:
        raise UserError(
            f"{where}: input_length {request.input_length} needs {expected_ids} hash_ids, "
            f"it has {len(request.hash_ids)}"
        )
    return request


def read_trace(path: Path, start: int, count: int) -> list[TraceRequest]:
    """Requests ``start`` .. ``start + count - 1`` (0-based lines) of the trace at ``path``."""
    requests: list[TraceRequest] = []
    try:
        with open(path, encoding="utf-8") as trace:
            for number, line in enumerate(trace):
                if number < start or not line.strip():
                    continue
                requests.append(parse_trace_line(line, f"{path} line {number + 1}"))
                if len(requests) == count:
                    break
    except OSError as exc:
        raise UserError(f"cannot read the trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"the trace {path} is not UTF-8 text; give a Mooncake trace (JSON lines)") from None
    if not requests:
        raise UserError(f"the trace {path} has no requests from line {start + 1}; lower --trace-start")
    return requests


def scaled_prompt(request: TraceRequest, block_tokens: int, block_content: dict[int, tuple[int, ...]]) -> list[int]:
    """The request's prompt with each 512-token trace block scaled to ``block_tokens`` tokens."""
    prompt: list[int] = []
    remainder = request.input_length % TRACE_BLOCK_TOKENS
    for position, block_id in enumerate(request.hash_ids):
        content = block_content[block_id]
        is_partial_last = remainder and position == len(request.hash_ids) - 1
        if is_partial_last:
            kept = min(block_tokens - 1, max(1, round(remainder * block_tokens / TRACE_BLOCK_TOKENS)))
            content = content[:kept]
        prompt.extend(content)
    return prompt


class TraceOptions(BaseModel):
    """Its flags of ``kvtool bench`` (``--trace-start`` and ``--trace-block-tokens`` shape a load test's
    trace too)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trace_block_tokens: int = Field(default=16, gt=0, description="tokens one 512-token trace block becomes")
    trace_start: int = Field(default=0, ge=0, description="first trace line to replay (0-based)")
    trace_requests: int | None = Field(
        default=None, gt=0, description="trace requests to replay \\[default: --requests]"
    )


_DEFAULT = TraceOptions()


@dataclass
class TraceReplay(Workload):
    name = "trace"
    description = "replay of a Mooncake FAST'25 trace (trace:PATH)"
    Options = TraceOptions
    path: Path = field(default_factory=Path)
    block_tokens: int = _DEFAULT.trace_block_tokens
    start: int = _DEFAULT.trace_start
    count: int | None = _DEFAULT.trace_requests  # requests to replay; None: the shape's request count

    @classmethod
    def from_options(cls, options: BaseModel | None, **given: Any) -> TraceReplay:
        """The replay of ``given["path"]`` with the trace flags."""
        flags = options if isinstance(options, TraceOptions) else _DEFAULT
        return cls(block_tokens=flags.trace_block_tokens, start=flags.trace_start, count=flags.trace_requests, **given)

    def label(self) -> str:
        return f"trace:{self.path.name}"

    def steps(self, shape: WorkloadShape) -> list[Step]:
        requests = read_trace(self.path, self.start, self.count or shape.requests)
        rng = workload_rng(self.name, shape.seed)
        block_content: dict[int, tuple[int, ...]] = {}
        for request in requests:
            for block_id in request.hash_ids:
                if block_id not in block_content:
                    block_content[block_id] = random_tokens(rng, self.block_tokens, shape.vocab_size)
        steps = StepList()
        published: list[int] = []
        for request in requests:
            prompt = tuple(scaled_prompt(request, self.block_tokens, block_content)[: shape.max_prompt_tokens])
            generate = max(1, min(request.output_length, shape.max_tokens))
            steps.consumer(prompt, generate, tuple(published), "trace request")
            published.append(steps.producer(prompt))
        return steps.steps
