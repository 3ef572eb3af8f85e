"""Copies of one block between a cache group's layer tensors and an object's payload bytes.

A block spans every layer of its group: one row of each layer's tensor (a Mamba layer may have
several tensors). Copied row by row, a 2 MiB block of a 32-layer model is 32 small copies, each paying
for building its views (indexing, a dtype view, a reshape, a slice); for a 48-block save that was
12 ms (save) and 8.5 ms (load) for a 4.5 ms memory copy (``benchmarks/fast-path/data_path.py``).
``BlockRows`` finds each layer's rows once (``[blocks, bytes a block]``) and copies a block's rows
with one ``memmove`` each on host memory (5 ms for those 48 blocks, either way; the GIL is released
during each). On a device (CUDA) each row is one asynchronous copy between the device and the pinned
host buffer, queued on the calling thread's current stream (``devicecopy.CopyStream`` orders them).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch


class BlockRows:
    """The byte rows of a group's cache tensors; ``None`` from ``of`` where a tensor's blocks are not
    rows of contiguous bytes (the callers then copy the block's pieces one by one)."""

    def __init__(self, rows: list[torch.Tensor], queued: bool = False):
        self._rows = rows
        self._sizes = [row.shape[1] for row in rows]
        self.nbytes = sum(self._sizes)
        self.blocks = rows[0].shape[0] if rows else 0
        # Host rows: (address of block 0, bytes between blocks, bytes a block) for memmove; ``queued``
        # (a device's cache): torch copies, queued on the current stream.
        host = not queued and all(row.device.type == "cpu" for row in rows)
        self._spans = [(row.data_ptr(), row.stride(0), row.shape[1]) for row in rows] if host else None

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], queued: bool = False) -> BlockRows | None:
        rows = []
        for tensor in tensors:
            if not tensor[0].is_contiguous():
                return None
            try:
                rows.append(tensor.view(torch.uint8).view(tensor.shape[0], -1))
            except RuntimeError:  # a layout whose blocks are not whole rows of bytes
                return None
        return cls(rows, queued)

    def gather(self, block_id: int, out: torch.Tensor) -> None:
        """Block ``block_id``'s bytes, layer after layer, into ``out`` (contiguous uint8, ``nbytes``)."""
        self._check(block_id, out)
        if self._spans is None or out.device.type != "cpu":
            offset = 0
            for row, size in zip(self._rows, self._sizes, strict=True):
                out[offset : offset + size].copy_(row[block_id], non_blocking=True)
                offset += size
            return
        target = out.data_ptr()
        for base, stride, size in self._spans:
            ctypes.memmove(target, base + block_id * stride, size)
            target += size

    def scatter(self, block_id: int, payload: torch.Tensor) -> None:
        """``payload`` (contiguous uint8, ``nbytes``, layer after layer) into block ``block_id``."""
        self._check(block_id, payload)
        if self._spans is None or payload.device.type != "cpu":
            for row, piece in zip(self._rows, torch.split(payload, self._sizes), strict=True):
                row[block_id].copy_(piece, non_blocking=True)
            return
        source = payload.data_ptr()
        for base, stride, size in self._spans:
            ctypes.memmove(base + block_id * stride, source, size)
            source += size

    def _check(self, block_id: int, buffer: torch.Tensor) -> None:
        """Raw copies trust these: a block outside the cache or a short buffer would corrupt memory."""
        if not 0 <= block_id < self.blocks:
            raise IndexError(f"block {block_id} is outside the cache's {self.blocks} blocks")
        if buffer.dtype != torch.uint8 or buffer.numel() != self.nbytes or not buffer.is_contiguous():
            raise ValueError(f"a block copy needs {self.nbytes} contiguous bytes, not {tuple(buffer.shape)}")
