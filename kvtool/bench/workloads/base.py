"""The one small interface every workload implements, and the helpers they share.

A workload turns a seed and a shape (block size, vocabulary, limits) into an ordered list of
steps. Each step is one request: to the producer (whose prompt it publishes to the store) or to
the consumer (whose hits are measured), with token-id prompts so that lengths are exact.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

Target = Literal["producer", "consumer"]
FIRST_TOKEN_ID = 3  # ids 0, 1, 2 are <unk>, <s>, </s> in kvtool's generated models


@dataclass(frozen=True)
class Step:
    """One request of a workload.

    ``depends_on`` names the producer steps (by index in the workload's list) whose saves this
    consumer step is meant to reuse; the runner waits until they are durable before sending it.
    """

    target: Target
    prompt: tuple[int, ...]
    max_tokens: int
    depends_on: tuple[int, ...] = ()
    label: str = ""

    @property
    def publishes(self) -> bool:
        return self.target == "producer"


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
    """Builds a workload's steps and hands back each step's index for ``depends_on``."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def producer(self, prompt: tuple[int, ...], max_tokens: int = 1, label: str = "publish") -> int:
        self.steps.append(Step("producer", tuple(prompt), max_tokens, (), label))
        return len(self.steps) - 1

    def consumer(self, prompt: tuple[int, ...], max_tokens: int, depends_on: tuple[int, ...], label: str) -> int:
        self.steps.append(Step("consumer", tuple(prompt), max_tokens, tuple(depends_on), label))
        return len(self.steps) - 1

    @property
    def consumer_count(self) -> int:
        return sum(1 for step in self.steps if step.target == "consumer")
