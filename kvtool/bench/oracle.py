"""The ideal-reuse oracle. Pure.

For a request: the longest prefix it shares with any token sequence it may reuse, on the reuse grid
(multiples of ``hash_unit``, and block ends), capped one token short of its own length (an engine
must compute at least one prompt token). What it may reuse depends on the workload:

- planned from the workload alone (``ideal_hits``): the prompts the producer published before it,
  for each consumer request;
- fed as the run goes (``ReuseOracle``), for workloads whose prompts depend on answers (chat):
  everything either engine computed before, for every request; a request computes its prompt and
  its answer but the last token (``computed_tokens``), which covers a decoding engine's answer save.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .workloads.base import Step, prompts_known


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by bisection over slice comparisons (done in C)."""
    if type(a) is not type(b):  # a list slice never equals a tuple slice
        a, b = tuple(a), tuple(b)
    low, high = 0, min(len(a), len(b))
    if high == 0 or a[0] != b[0]:
        return 0
    if a[:high] == b[:high]:
        return high
    low = 1  # a[:low] == b[:low] holds; a[:high] == b[:high] does not
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


def on_reuse_grid(tokens: int, block_size: int, hash_unit: int) -> int:
    """The largest reusable boundary at or below ``tokens``: a block end or a hash-unit multiple."""
    return max(tokens // block_size * block_size, tokens // hash_unit * hash_unit)


def ideal_hit(prompt: Sequence[int], published: Sequence[Sequence[int]], block_size: int, hash_unit: int) -> int:
    longest = max((common_prefix_length(prompt, earlier) for earlier in published), default=0)
    # The grid applies to what can be stored; the cap to what a prompt can take (it loads part of a block).
    return max(0, min(on_reuse_grid(longest, block_size, hash_unit), len(prompt) - 1))


def computed_tokens(prompt: Sequence[int], answer: Sequence[int]) -> tuple[int, ...]:
    """The tokens a request leaves KV for: its prompt and its answer, less the last generated token
    (sampled, never fed back), which is what a decoding engine's answer save covers."""
    return (*prompt, *answer[:-1])


class Ideals(Protocol):
    """Where a run takes each step's ideal from: planned before it, or fed as it goes."""

    def of(self, index: int, prompt: Sequence[int]) -> int | None:
        """Step ``index``'s ideal reused tokens; None for a step whose reuse is not measured."""

    def ran(self, prompt: Sequence[int], answer: Sequence[int]) -> None:
        """Note what a step's request computed (its prompt as sent, the token ids it generated)."""


class ReuseOracle:
    """Ideals against every sequence noted so far, in the order the run computes them."""

    def __init__(self, block_size: int, hash_unit: int) -> None:
        self.block_size = block_size
        self.hash_unit = hash_unit
        self._sequences: list[tuple[int, ...]] = []

    def ideal(self, prompt: Sequence[int]) -> int:
        return ideal_hit(tuple(prompt), self._sequences, self.block_size, self.hash_unit)

    def note(self, tokens: Sequence[int]) -> None:
        """A sequence later requests may reuse."""
        self._sequences.append(tuple(tokens))

    # As Ideals: every request is measured, against what the requests before it computed.

    def of(self, index: int, prompt: Sequence[int]) -> int | None:
        return self.ideal(prompt)

    def ran(self, prompt: Sequence[int], answer: Sequence[int]) -> None:
        self.note(computed_tokens(prompt, answer))


@dataclass(frozen=True)
class PlannedIdeals:
    """Ideals planned before the run (``ideal_hits``): only the steps in ``by_step`` are measured."""

    by_step: dict[int, int]

    def of(self, index: int, prompt: Sequence[int]) -> int | None:
        return self.by_step.get(index)

    def ran(self, prompt: Sequence[int], answer: Sequence[int]) -> None:
        """Nothing: the plan already knows every prompt."""


def run_ideals(planned: dict[int, int] | None, block_size: int, hash_unit: int) -> Ideals:
    """A run's ideals: the planned ones, or (None: prompts known only at run time) fed as it goes."""
    return PlannedIdeals(planned) if planned is not None else ReuseOracle(block_size, hash_unit)


def ideal_hits(steps: Sequence[Step], block_size: int, hash_unit: int) -> dict[int, int]:
    """Ideal reused tokens of every consumer step, by step index, from the producer's prompts before it."""
    if not prompts_known(steps):
        raise ValueError("these steps continue answers: their ideals are fed at run time (ReuseOracle)")
    published = ReuseOracle(block_size, hash_unit)
    ideal: dict[int, int] = {}
    for index, step in enumerate(steps):
        if step.target == "consumer":
            ideal[index] = published.ideal(step.prompt)
        if step.publishes:
            published.note(step.prompt)
    return ideal
