"""The per-token cut of a block agrees with where vLLM's CPU attention kernel writes each token."""

from __future__ import annotations

import pytest
import torch

from connector.core.tokencut import cuttable, token_bytes, token_views


def kernel_layout(dtype: torch.dtype, head: int, block: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return f"CPU_ATTN:{_get_attn_isa(dtype, block, head)}"


@pytest.mark.parametrize(
    ("dtype", "head", "block"),
    [
        (torch.float32, 64, 32),
        (torch.float32, 32, 32),
        (torch.bfloat16, 128, 32),
        (torch.bfloat16, 64, 256),
        (torch.float32, 48, 32),
    ],
)
def test_the_first_tokens_of_a_block_are_where_the_kernel_wrote_them(dtype, head, block):
    from vllm import _custom_ops as ops

    layout = kernel_layout(dtype, head, block)
    heads, tokens = 2, 5
    cache = torch.zeros(3, heads, block, 2 * head, dtype=dtype)
    if not cuttable(layout, cache[1]):
        pytest.skip(f"{layout} is not cut per token on this machine")
    key_cache, value_cache = cache.view(3, heads, 2 * block, head).chunk(2, dim=2)
    keys = torch.randn(tokens, heads, head).to(dtype)
    values = torch.randn(tokens, heads, head).to(dtype)
    slots = torch.arange(block, block + tokens)  # the first tokens of block 1
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, layout.split(":")[1])
    k, v = token_views(cache[1], tokens)
    assert torch.equal(k, keys.permute(1, 2, 0)) and torch.equal(v, values.permute(1, 0, 2))
    assert token_bytes(cache[1]) * tokens == (k.numel() + v.numel()) * cache.element_size()
    # Everything outside the views is untouched by these tokens.
    k.zero_(), v.zero_()
    assert not cache.any()


def test_other_layouts_are_not_cut():
    block = torch.zeros(2, 32, 128)
    assert cuttable("CPU_ATTN:vec", block)
    assert not cuttable("CPU_ATTN:amx", block) and not cuttable(None, block) and not cuttable("FLASH_ATTN", block)
