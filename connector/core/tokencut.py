"""Which tokens of a KV block lie where: so that a tail object holds its valid tokens only.

vLLM's CPU attention kernels (``vec``, ``vec16``) keep a block of a layer as ``[heads, block, 2 * head]``
bytes in which each head's K comes first, transposed (``[head, block]``: a token is a column), then its
V (``[block, head]``: a token is a row). The first ``n`` tokens of a block are then, per head, the
first ``n`` columns of K and the first ``n`` rows of V. Other layouts (``amx`` prepacks bf16 blocks for
its tiles, GPU backends) are not cut: their tails stay whole blocks. ``tests/unit/test_tokencut.py``
checks the rule against vLLM's own cache writer (``cpu_attn_reshape_and_cache``) on this machine.
"""

from __future__ import annotations

import torch

# Kernel layouts (connector.worker.layout.attention_layout) whose blocks can be cut per token.
CUTTABLE = frozenset({"CPU_ATTN:vec", "CPU_ATTN:vec16"})


# KV dtypes the rule was checked for (an fp8 cache may pack tokens otherwise: it is not cut).
CUT_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def cuttable(layout: str | None, block: torch.Tensor) -> bool:
    """Whether a layer's block (one block of its cache tensor) can be cut per token."""
    return (
        layout in CUTTABLE
        and block.dtype in CUT_DTYPES
        and block.dim() == 3
        and block.shape[2] % 2 == 0
        and block.is_contiguous()
    )


def token_views(block: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a cuttable block's first ``tokens`` tokens: K ``[heads, head, tokens]`` (strided) and
    V ``[heads, tokens, head]``."""
    heads, size, width = block.shape
    head = width // 2
    rows = block.view(heads, 2 * size, head)
    keys = rows[:, :size].reshape(heads, head, size)  # a view: each head's K is contiguous
    return keys[:, :, :tokens], rows[:, size:][:, :tokens, :]


def token_bytes(block: torch.Tensor) -> int:
    """Bytes one token takes in a layer's block (its K and V, every head)."""
    return block[0].numel() // block.shape[1] * block.shape[0] * block.element_size()
