"""Whole-block copies through byte rows: the same bytes, in the same order, as the piece-by-piece copy."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.worker.blockcopy import BlockRows


def _pieces_bytes(tensors: list[torch.Tensor], block: int) -> bytes:
    return b"".join(t[block].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


@settings(max_examples=40, deadline=None)
@given(
    blocks=st.integers(1, 6),
    shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5)), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.int8]),
    data=st.data(),
)
def test_gather_and_scatter_match_the_piecewise_copy(blocks, shapes, dtype, data):
    tensors = [torch.randint(-100, 100, (blocks, *shape)).to(dtype) for shape in shapes]
    rows = BlockRows.of(tensors)
    assert rows is not None
    block = data.draw(st.integers(0, blocks - 1))
    out = torch.zeros(rows.nbytes, dtype=torch.uint8)
    rows.gather(block, out)
    assert out.numpy().tobytes() == _pieces_bytes(tensors, block)

    before = [t.clone() for t in tensors]
    target = data.draw(st.integers(0, blocks - 1))
    rows.scatter(target, out)
    for old, new in zip(before, tensors, strict=True):
        assert torch.equal(new[target], old[block])  # the block's bytes landed in the target block
        others = [i for i in range(blocks) if i != target]
        assert torch.equal(new[others], old[others])  # and nowhere else


def test_blocks_spaced_wider_than_their_bytes_are_rows_too():
    """A view whose blocks are padded apart (a state tensor inside a larger page) still copies exactly."""
    page = torch.arange(4 * 24, dtype=torch.int16).view(4, 24)
    state = page[:, :10]  # each block's 10 values, 24 apart
    rows = BlockRows.of([state])
    assert rows is not None and rows.nbytes == 20
    out = torch.zeros(20, dtype=torch.uint8)
    rows.gather(2, out)
    assert torch.equal(out.view(torch.int16), state[2])
    rows.scatter(0, out)
    assert torch.equal(page[0, :10], page[2, :10]) and page[0, 10] == 10  # padding untouched


def test_blocks_that_are_not_contiguous_fall_back():
    strided = torch.zeros(3, 4, 6)[:, :, ::2]  # a block's values are not contiguous
    assert BlockRows.of([torch.zeros(3, 8), strided]) is None


def test_a_block_outside_the_cache_or_a_short_buffer_is_refused():
    rows = BlockRows.of([torch.zeros(3, 8)])
    assert rows is not None
    with pytest.raises(IndexError):
        rows.gather(3, torch.zeros(32, dtype=torch.uint8))
    with pytest.raises(IndexError):
        rows.scatter(-1, torch.zeros(32, dtype=torch.uint8))
    with pytest.raises(ValueError):
        rows.scatter(0, torch.zeros(31, dtype=torch.uint8))
