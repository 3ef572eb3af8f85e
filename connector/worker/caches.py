"""The engine's KV cache as the worker side copies it, and the staging areas sized for it.

Per cache group: its layers' cache tensors with the blocks in their first dimension (a Mamba layer may
have several: its conv and SSM states), the bytes of one block across them, the byte rows a
whole-block copy moves (``blockcopy``), and the bytes a token takes where the group's kernel layout
lets a tail be cut per token (``tokencut``: a tail object then holds its valid tokens only); and the
widest view of each cache, which vLLM's copy-on-write repairs copy. Read once, when vLLM registers its
caches; the staging areas (``store.staging``) take slots of the largest object this model stores.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import ConfigError, bad_value
from ..core.objects import HEADER_SIZE
from ..core.tokencut import cuttable, token_bytes
from ..store.backend import KVStore
from ..calls import StoreError
from ..store.staging import StagingArea
from .blockcopy import BlockRows
from .devicecopy import block_major

logger = logging.getLogger("vllm.kvtool")


def cache_groups(
    kv_caches: dict[str, torch.Tensor | list[torch.Tensor]], group_layers: list[list[str]], num_blocks: int
) -> list[list[torch.Tensor]]:
    """Per group, its layers' cache tensors, each a view with the blocks in its first dimension."""
    groups = []
    for layer_names in group_layers:
        tensors = []
        for name in layer_names:
            value = kv_caches.get(name)
            if value is None:
                raise ValueError(f"no KV cache tensor for layer {name}")
            for tensor in value if isinstance(value, (list, tuple)) else [value]:
                try:
                    tensors += block_major(tensor, num_blocks)
                except ValueError as exc:
                    raise ValueError(f"layer {name}: {exc}") from None
        groups.append(tensors)
    return groups


@dataclass(frozen=True)
class EngineCaches:
    groups: list[list[torch.Tensor]]  # per KV cache group: its layers' cache tensors
    widest_views: tuple[torch.Tensor, ...]  # per cache start address, the view spanning the most bytes a block
    group_bytes: list[int]  # per group: bytes of one block across its layers
    rows: list[BlockRows | None]  # per group: its tensors' byte rows, for whole-block copies
    token_bytes: list[int]  # per group: bytes a token takes across its layers where cut per token, else 0

    @classmethod
    def of(cls, groups: list[list[torch.Tensor]], layouts: Sequence[str | None], queued: bool) -> EngineCaches:
        """``groups`` (``cache_groups``) with the kernel layout of each (``EngineLayout.attention``);
        ``queued``: copies are queued on a device's copy streams."""
        widest: dict[int, torch.Tensor] = {}
        for tensor in (t for tensors in groups for t in tensors):
            known = widest.get(tensor.data_ptr())
            if known is None or tensor[0].nbytes > known[0].nbytes:
                widest[tensor.data_ptr()] = tensor
        return cls(
            groups=groups,
            widest_views=tuple(widest.values()),
            group_bytes=[sum(t[0].numel() * t.element_size() for t in tensors) for tensors in groups],
            rows=[BlockRows.of(tensors, queued=queued) for tensors in groups],
            token_bytes=[
                sum(token_bytes(t[0]) for t in tensors)
                if index < len(layouts) and tensors and all(cuttable(layouts[index], t[0]) for t in tensors)
                else 0
                for index, tensors in enumerate(groups)
            ],
        )

    @property
    def slot_bytes(self) -> int:
        """The largest object this model stores: a whole block of its largest group, and its header."""
        return HEADER_SIZE + max(self.group_bytes, default=0)

    def log(self, namespace_key: str) -> None:
        for index, tensors in enumerate(self.groups):
            logger.info(
                "kvtool: group %d: %d cache tensors, block shape %s %s, %d bytes a block; namespace %s",
                index,
                len(tensors),
                tuple(tensors[0].shape[1:]) if tensors else (),
                tensors[0].dtype if tensors else "",
                self.group_bytes[index],
                namespace_key,
            )


def staging_area(store: KVStore, name: str, slot_bytes: int, budget_bytes: int) -> StagingArea:
    """A staging area of the budget's size (``{name}_buffer_bytes``), registered with the store. A store
    that refuses the registration still gets transfers from it (over TCP they work unregistered)."""
    if budget_bytes < slot_bytes:  # the first place that knows an object's size
        accepts = f"it should hold at least one object of this model: {slot_bytes} bytes (a block and its header)"
        raise ConfigError.of(bad_value(f"{name}_buffer_bytes", budget_bytes, accepts))
    area = StagingArea(name, slot_bytes, budget_bytes // slot_bytes)
    # Touched now, not slot by slot on the engine's step: a save's copy into a cold page costs four
    # times a warm one (page faults), which showed as 40 ms more per producer request at block 32.
    area.memory.fill_(0)
    try:
        store.register(area.address, area.nbytes)
    except StoreError as exc:
        logger.warning("kvtool: %s staging area not registered with the store (%s)", name, exc)
    logger.info("kvtool: %s staging area: %d slots of %d bytes", name, area.slots, area.slot_bytes)
    return area
