"""What a load test sends: sessions of turns, seeded. Pure.

A session is what one user (or one agent) does: its first request, then, after a think time, a next
request that is the previous prompt, the engine's real answer and something new. The answer is known
only once the engine gave it, so a plan holds each turn's new part (``Turn.message``); the runner
builds the prompt as the session goes.

- ``agentic``: a coding agent. Every session starts with the same long system-and-tools prompt and a
  task of its own; each next request appends the answer and a tool result of varying length (tool
  results and answers end mid-block, so every turn's tail is what block-granular caches drop).
- ``chat``: a multi-turn chat. A short opening message, then user messages of a few to two blocks'
  worth of tokens.
- ``trace:PATH``: a Mooncake trace (shared/traces/README.md) at its timestamps: each request one
  single-turn session arriving at its ``timestamp`` times ``time_scale``, its prompt made from its
  ``hash_ids`` as ``kvtool bench --workload trace:`` makes it (equal ids, equal tokens; each 512-token
  trace block ``block_tokens`` tokens), its answer ``output_length`` tokens at most.

Sessions start at once (closed loop: the runner keeps ``concurrency`` of them in flight) or at
Poisson arrivals of ``session_rate`` a second (open loop).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvtool.bench.workloads.base import FIRST_TOKEN_ID
from kvtool.bench.workloads.trace import read_trace, scaled_prompt

LoadWorkload = Literal["agentic", "chat", "trace"]
LOAD_WORKLOADS: tuple[LoadWorkload, ...] = ("agentic", "chat", "trace")  # trace as trace:PATH
MAX_TURNS = 8  # turns a session takes at most (fewer when its prompt would pass the engine's limit)


@dataclass(frozen=True)
class Turn:
    message: tuple[int, ...]  # the first turn: its whole prompt; later: appended after prompt + answer
    max_tokens: int  # the answer's length (ignore_eos: exactly this many)
    think_s: float  # wait after the previous answer before this turn (0 for the first)


@dataclass(frozen=True)
class SessionPlan:
    index: int
    start_s: float  # open loop: its arrival, from the run's start; 0 in a closed loop
    turns: tuple[Turn, ...]

    @property
    def longest_prompt(self) -> int:
        """The longest prompt the session sends (every answer at its full length)."""
        total = 0
        for number, turn in enumerate(self.turns):
            total += len(turn.message) + (self.turns[number - 1].max_tokens if number else 0)
        return total


@dataclass(frozen=True)
class TraceLoad:
    """A trace replayed at its timestamps (``--load trace:PATH``)."""

    path: Path
    start: int = 0  # first trace line (0-based)
    block_tokens: int = 16  # tokens one 512-token trace block becomes
    time_scale: float = 1.0  # arrival times multiplied by this (2: half the rate)


@dataclass(frozen=True)
class LoadShape:
    workload: LoadWorkload
    sessions: int
    block_size: int
    vocab_size: int
    max_prompt_tokens: int  # no prompt is longer (the engine's max_model_len less an answer)
    answer_tokens: int  # each turn's answer
    think_s: float  # mean think time between turns (exponential)
    session_rate: float | None  # sessions a second, Poisson; None: all at once (closed loop)
    seed: int
    trace: TraceLoad | None = None  # the trace workload's


def plan_sessions(shape: LoadShape) -> list[SessionPlan]:
    """The sessions of a run; the same shape gives the same sessions."""
    rng = random.Random(f"kvtool-load:{shape.workload}:{shape.seed}")
    if shape.trace is not None:
        return _trace_sessions(rng, shape, shape.trace)
    shared = _system_prompt(rng, shape) if shape.workload == "agentic" else ()
    plans, start = [], 0.0
    for index in range(shape.sessions):
        if shape.session_rate is not None and index:
            start += rng.expovariate(shape.session_rate)
        plans.append(SessionPlan(index, start, _turns(rng, shape, shared)))
    return plans


def _tokens(rng: random.Random, count: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(count))


def _mid_block(rng: random.Random, low: int, high: int, block: int) -> int:
    """A length in [low, high] that does not end on a block boundary (when the range allows)."""
    length = rng.randint(low, max(low, high))
    return length + 1 if length % block == 0 and length + 1 <= max(low, high) else length


def _system_prompt(rng: random.Random, shape: LoadShape) -> tuple[int, ...]:
    """The agents' shared system-and-tools prompt: a third of the engine's limit, ending mid-block."""
    length = max(1, shape.max_prompt_tokens // 3)
    if length % shape.block_size == 0:
        length -= 1
    return _tokens(rng, max(1, length), shape.vocab_size)


def _turns(rng: random.Random, shape: LoadShape, shared: tuple[int, ...]) -> tuple[Turn, ...]:
    block = shape.block_size
    if shape.workload == "agentic":
        first = shared + _tokens(rng, _mid_block(rng, 8, block, block), shape.vocab_size)  # the task
        low, high = block // 2, 3 * block  # tool results: a few lines to a page
    else:
        first = _tokens(rng, _mid_block(rng, 4, 2 * block, block), shape.vocab_size)
        low, high = 4, 2 * block
    turns = [Turn(first[: shape.max_prompt_tokens], shape.answer_tokens, 0.0)]
    length = len(turns[0].message)
    while len(turns) < MAX_TURNS:
        message = _tokens(rng, _mid_block(rng, max(1, low), high, block), shape.vocab_size)
        length += shape.answer_tokens + len(message)
        if length > shape.max_prompt_tokens:
            break
        think = rng.expovariate(1.0 / shape.think_s) if shape.think_s > 0 else 0.0
        turns.append(Turn(message, shape.answer_tokens, think))
    return tuple(turns)


def _trace_sessions(rng: random.Random, shape: LoadShape, trace: TraceLoad) -> list[SessionPlan]:
    """``shape.sessions`` requests of the trace from line ``trace.start``, each a session of one turn
    at its arrival; a record without a timestamp arrives with the one before it."""
    requests = read_trace(trace.path, trace.start, shape.sessions)
    content: dict[int, tuple[int, ...]] = {}
    for request in requests:
        for block in request.hash_ids:
            if block not in content:
                content[block] = _tokens(rng, trace.block_tokens, shape.vocab_size)
    first = next((r.timestamp_ms for r in requests if r.timestamp_ms is not None), 0)
    plans, arrival = [], 0.0
    for index, request in enumerate(requests):
        if request.timestamp_ms is not None:
            arrival = max(arrival, (request.timestamp_ms - first) / 1000.0 * trace.time_scale)
        prompt = tuple(scaled_prompt(request, trace.block_tokens, content)[: shape.max_prompt_tokens])
        answer = max(1, min(request.output_length, shape.answer_tokens))
        plans.append(SessionPlan(index, arrival, (Turn(prompt, answer, 0.0),)))
    return plans
