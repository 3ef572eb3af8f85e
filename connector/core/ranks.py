"""Tensor parallelism: every rank's KV is stored under its own namespace, and a prefix is stored only
where every rank holds it.

Each TP rank's worker holds its share of the KV heads, so it saves and loads its own objects, pointer
records and watermark records under a namespace whose fingerprint carries its rank (``tp_rank``:
``layout.engine_layout`` names rank 0, the worker side its own). The scheduler side, one per engine,
builds rank 0's keys; ``on_every_rank`` makes its existence queries ask each key on every rank in the
same batch and answers present only where all ranks hold it, so a hit (and every object a pointer
names) is one that each rank's worker can load. A rank's object lost between the lookup and the load
is a failed load on that rank, which vLLM's output aggregation reports for the whole request: a miss.
Pure but for the store call it wraps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from .keys import KEY_PREFIX, Namespace

ExistsFn = Callable[[list[str]], list[bool]]


def rank_namespace(namespace: Namespace, rank: int) -> Namespace:
    """``namespace`` as TP rank ``rank`` of the same engine sees it."""
    if not 0 <= rank < namespace.tp_size:
        raise ValueError(f"TP rank {rank} is outside a TP size of {namespace.tp_size}")
    return replace(namespace, tp_rank=rank)


def rank_components(namespace: Namespace) -> tuple[str, ...]:
    """Each rank's namespace key component, rank 0 first."""
    return tuple(rank_namespace(namespace, rank).key_component() for rank in range(namespace.tp_size))


def key_on_rank(key: str, components: Sequence[str], rank: int) -> str:
    """``key`` (one of rank 0's) as rank ``rank`` names it; a key outside rank 0's namespace unchanged."""
    own = f"{KEY_PREFIX}{components[0]}/"
    if rank == 0 or not key.startswith(own):
        return key
    return f"{KEY_PREFIX}{components[rank]}/{key[len(own) :]}"


def keys_on_every_rank(key: str, components: Sequence[str]) -> list[str]:
    """``key`` on every rank, rank 0 first (just ``key`` for one rank)."""
    if len(components) <= 1:
        return [key]
    return [key_on_rank(key, components, rank) for rank in range(len(components))]


def on_every_rank(exists: ExistsFn, components: Sequence[str]) -> ExistsFn:
    """An existence query over rank 0's keys that answers True only where every rank holds the key:
    one query of ``len(keys) * ranks`` keys. With one rank, ``exists`` itself."""
    ranks = len(components)
    if ranks <= 1:
        return exists

    def every_rank(keys: list[str]) -> list[bool]:
        asked = [key_on_rank(key, components, rank) for key in keys for rank in range(ranks)]
        present = exists(asked)
        return [all(present[index * ranks : (index + 1) * ranks]) for index in range(len(keys))]

    return every_rank
