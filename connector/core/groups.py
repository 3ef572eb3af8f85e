"""A model's KV cache groups, and what each needs for a prefix hit. Pure logic.

vLLM's hybrid KV cache manager gives every kind of layer its own group of blocks (one block table
per group, block ids from one shared pool). A hit of ``h`` tokens (tokens ``[0, h)`` reused) needs,
in every group:

- full attention: every block up to ``h``; the block holding token ``h - 1`` may be a tail object
  (valid up to at least ``h``) or a full block;
- sliding window of ``w`` tokens: the same, but only from the block holding the first token the
  window still attends (vLLM hands the null block out for the blocks before it);
- state (Mamba and other recurrent layers): the state after exactly ``h`` tokens, which lives in the
  group's block holding token ``h - 1``.

A hit is the longest ``h`` that every group can serve. The rules mirror vLLM 0.32's
``SlidingWindowManager.get_num_skipped_tokens`` and ``MambaManager``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

NULL_BLOCK_ID = 0  # vLLM's placeholder for a block a group does not keep (never saved or loaded)


class GroupKind(str, Enum):
    FULL = "full"
    SLIDING = "sliding"
    STATE = "state"


@dataclass(frozen=True)
class CacheGroup:
    index: int
    kind: GroupKind
    block_size: int
    window: int | None = None  # sliding: tokens one position attends (vLLM's sliding_window)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"group {self.index}: block size {self.block_size}")
        if (self.kind is GroupKind.SLIDING) != (self.window is not None and self.window > 0):
            raise ValueError(f"group {self.index}: a sliding window group needs a window, and only it")

    def describe(self) -> str:
        window = f":{self.window}" if self.window is not None else ""
        return f"{self.kind.value}:{self.block_size}{window}"

    def skipped_tokens(self, computed: int) -> int:
        """Leading tokens whose KV this group no longer needs once ``computed`` tokens are computed."""
        if self.kind is GroupKind.SLIDING:
            assert self.window is not None
            return max(0, computed - self.window + 1)
        return 0

    def first_needed_block(self, hit: int) -> int:
        """Index of the first block an attention group must hold for a hit of ``hit`` tokens."""
        return self.skipped_tokens(hit) // self.block_size

    def live_from_block(self, computed_before_step: int) -> int:
        """Blocks below this index may already be freed (the null block in vLLM's table, their ids
        reused) in a step that starts with ``computed_before_step`` tokens computed: never save them."""
        return self.skipped_tokens(computed_before_step) // self.block_size


def describe_groups(groups: tuple[CacheGroup, ...]) -> str:
    """A stable text of a model's groups for the namespace; empty for one plain full-attention group."""
    if len(groups) == 1 and groups[0].kind is GroupKind.FULL:
        return ""
    return ";".join(group.describe() for group in groups)
