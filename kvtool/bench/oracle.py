"""The ideal-reuse oracle, computed from the workload alone. Pure.

For each consumer request: the longest prefix it shares with any prompt the producer published
before it, on the reuse grid (multiples of ``hash_unit``, and block ends), capped one token short
of its own length (an engine must compute at least one prompt token).
"""

from __future__ import annotations

from collections.abc import Sequence

from .workloads.base import Step


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by bisection over slice comparisons (done in C)."""
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


def ideal_hits(steps: Sequence[Step], block_size: int, hash_unit: int) -> dict[int, int]:
    """Ideal reused tokens of every consumer step, by step index."""
    published: list[tuple[int, ...]] = []
    ideal: dict[int, int] = {}
    for index, step in enumerate(steps):
        if step.target == "consumer":
            ideal[index] = ideal_hit(step.prompt, published, block_size, hash_unit)
        if step.publishes:
            published.append(step.prompt)
    return ideal
