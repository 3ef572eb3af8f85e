"""The workloads `kvtool bench` runs, by name; ``trace:PATH`` replays a trace file."""

from __future__ import annotations


from .base import Ref, Step, Target, Transcript, Workload, WorkloadShape
from .chat import Chat
from .cross_block import CrossBlock
from .max_tokens_1 import MaxTokensOne
from .multi_turn import MultiTurn
from .prefix_repetition import PrefixRepetition
from .shared_prefix import SharedPrefix
from .sub_block import SubBlock
from .trace import TraceReplay

__all__ = [
    "Ref",
    "Step",
    "Target",
    "Transcript",
    "Workload",
    "WorkloadShape",
    "WORKLOADS",
    "TRACE_PREFIX",
    "TraceReplay",
    "workload_names",
    "with_options",
]

WORKLOADS: dict[str, type[Workload]] = {
    cls.name: cls for cls in (SubBlock, CrossBlock, SharedPrefix, MultiTurn, MaxTokensOne, PrefixRepetition, Chat)
}
TRACE_PREFIX = "trace:"


def workload_names() -> list[str]:
    return [*WORKLOADS, f"{TRACE_PREFIX}PATH"]


def with_options() -> list[type[Workload]]:
    """The workloads that have flags of their own (``Workload.Options``), the trace replay's included."""
    return [cls for cls in (*WORKLOADS.values(), TraceReplay) if cls.Options is not None]
