"""The one small interface every workload implements, and the helpers they share.

A workload turns a seed and a shape (block size, vocabulary, limits) into an ordered list of
steps. Each step is one request: to the producer (whose prompt it publishes to the store) or to
the consumer (whose hits are measured), with token-id prompts so that lengths are exact.

A prompt that continues a conversation depends on what the model answered, which no seed can say:
such a step names earlier steps' prompts and answers (its ``history``), and the runner resolves
them as the run goes (``Transcript``).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from pydantic import BaseModel

Target = Literal["producer", "consumer"]
FIRST_TOKEN_ID = 3  # ids 0, 1, 2 are <unk>, <s>, </s> in kvtool's generated models


@dataclass(frozen=True)
class Ref:
    """Part of an earlier step's request, known only once it ran: its prompt as sent, or its answer
    (the token ids the engine generated)."""

    step: int  # index in the workload's list
    part: Literal["prompt", "answer"]


@dataclass(frozen=True)
class Step:
    """One request of a workload.

    ``depends_on`` names the earlier steps (by index in the workload's list) whose saves this step
    is meant to reuse: a consumer step the producer's, a chat turn the consumer's answer save; the
    runner waits until they are durable before sending it.

    The prompt sent is ``history`` resolved (earlier prompts and answers, in order) followed by
    ``prompt``; without a history, ``prompt`` is the whole of it, known before the run.
    """

    target: Target
    prompt: tuple[int, ...]
    max_tokens: int
    depends_on: tuple[int, ...] = ()
    label: str = ""
    history: tuple[Ref, ...] = ()

    @property
    def publishes(self) -> bool:
        return self.target == "producer"

    @property
    def waits_for_saves(self) -> bool:
        """A consumer request is what the saves are for; any other waits only when it reuses one."""
        return self.target == "consumer" or bool(self.depends_on)


def prompts_known(steps: Sequence[Step]) -> bool:
    """Whether every prompt is known before the run (none continues an answer)."""
    return not any(step.history for step in steps)


def longest_prompts(steps: Sequence[Step]) -> list[int]:
    """The longest each step's prompt can be (an answer is at most its step's ``max_tokens``): what
    the engine's limit is checked against before the run."""
    longest: list[int] = []
    for step in steps:
        parts = (longest[ref.step] if ref.part == "prompt" else steps[ref.step].max_tokens for ref in step.history)
        longest.append(len(step.prompt) + sum(parts))
    return longest


class Transcript:
    """What a run's steps sent and what the engines answered, to resolve later steps' histories."""

    def __init__(self) -> None:
        self._parts: dict[Ref, tuple[int, ...]] = {}

    def resolve(self, index: int, step: Step) -> tuple[int, ...]:
        """The prompt step ``index`` sends (its history resolved, then its own tokens), kept for later steps."""
        prompt = tuple(token for ref in step.history for token in self._part(index, ref)) + step.prompt
        self._parts[Ref(index, "prompt")] = prompt
        return prompt

    def answered(self, index: int, answer: Sequence[int]) -> None:
        self._parts[Ref(index, "answer")] = tuple(answer)

    def _part(self, index: int, ref: Ref) -> tuple[int, ...]:
        if ref not in self._parts:
            raise ValueError(
                f"step {index} continues step {ref.step}'s {ref.part}, which is not known "
                "(a later step, or an answer the engine returned no token ids for)"
            )
        return self._parts[ref]


@dataclass(frozen=True)
class WorkloadShape:
    """What every workload is generated against."""

    block_size: int
    vocab_size: int
    requests: int  # consumer requests to aim for
    max_tokens: int  # tokens each consumer request generates
    max_prompt_tokens: int  # no prompt is longer (the engine's max_model_len minus generation)
    seed: int


class Workload(ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    # The workload's own flags of ``kvtool bench``, if it has any: a pydantic model whose fields are the
    # flags by name (``prefix_len``: ``--prefix-len``) with their defaults, bounds and help
    # (``kvtool.bench.flags`` makes the options from it, ``BenchConfig`` checks them).
    Options: ClassVar[type[BaseModel] | None] = None

    @classmethod
    def from_options(cls, options: BaseModel | None, **given: Any) -> Workload:
        """The workload its flags (an ``Options``, or None without) and ``given`` describe."""
        return cls(**given) if options is None else cls(**options.model_dump(), **given)

    @abstractmethod
    def steps(self, shape: WorkloadShape) -> list[Step]:
        """The workload's requests in the order they are sent; the same shape gives the same steps."""

    def label(self) -> str:
        """The name results are reported under."""
        return self.name


def workload_rng(name: str, seed: int) -> random.Random:
    # Seeding with a string is deterministic across processes (it hashes with SHA-512, not hash()).
    return random.Random(f"kvtool-bench:{name}:{seed}")


def random_tokens(rng: random.Random, count: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(count))


class StepList:
    """Builds a workload's steps and hands back each step's index for ``depends_on`` and ``Ref``."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def producer(
        self,
        prompt: tuple[int, ...],
        max_tokens: int = 1,
        label: str = "publish",
        depends_on: tuple[int, ...] = (),
        history: tuple[Ref, ...] = (),
    ) -> int:
        return self._add(Step("producer", tuple(prompt), max_tokens, tuple(depends_on), label, history))

    def consumer(
        self,
        prompt: tuple[int, ...],
        max_tokens: int,
        depends_on: tuple[int, ...],
        label: str,
        history: tuple[Ref, ...] = (),
    ) -> int:
        return self._add(Step("consumer", tuple(prompt), max_tokens, tuple(depends_on), label, history))

    def _add(self, step: Step) -> int:
        self.steps.append(step)
        return len(self.steps) - 1

    @property
    def consumer_count(self) -> int:
        return sum(1 for step in self.steps if step.target == "consumer")
