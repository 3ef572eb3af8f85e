"""The bench's configuration: one validated object, built once from the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtool.connectors import CONNECTOR_NAMES
from kvtool.errors import UserError
from kvtool.verify import DEFAULT_LOGPROB_TOLERANCE

from .workloads import TRACE_PREFIX, WORKLOADS, TraceReplay, Workload, workload_names
from .workloads.prefix_repetition import PrefixRepetition

ConnectorName = Literal["kvtool", "vllm-mooncake-store", "lmcache", "none"]
CONNECTORS: tuple[str, ...] = CONNECTOR_NAMES
DEFAULT_WORKLOADS = ("sub-block",)
TOP_LOGPROBS = 5


class TraceOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    block_tokens: int = Field(default=16, gt=0, description="tokens one 512-token trace block becomes")
    start: int = Field(default=0, ge=0, description="first trace line to replay (0-based)")
    requests: int | None = Field(default=None, gt=0, description="trace requests to replay [default: --requests]")


class PrefixRepetitionOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    prefix_len: int = Field(default=80, gt=0)
    suffix_len: int = Field(default=24, gt=0)
    num_prefixes: int = Field(default=2, gt=0)


class BenchConfig(BaseModel):
    """Everything one bench run needs besides the pair it runs against."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    requests: int = Field(default=8, gt=0, description="consumer requests per workload")
    max_tokens: int = Field(default=8, gt=0, description="tokens each consumer request generates")
    seed: int = 0
    verify: bool = True
    tolerance: float = Field(default=DEFAULT_LOGPROB_TOLERANCE, gt=0)
    trace: TraceOptions = TraceOptions()
    prefix_repetition: PrefixRepetitionOptions = PrefixRepetitionOptions()
    durability_timeout_s: float = Field(default=30.0, gt=0)
    request_timeout_s: float = Field(default=300.0, gt=0)


def build_workload(spec: str, config: BenchConfig) -> Workload:
    """The workload a ``--workload`` value names; a UserError naming the accepted values otherwise."""
    if spec.startswith(TRACE_PREFIX):
        path = Path(spec[len(TRACE_PREFIX) :]).expanduser()
        if not path.is_file():
            raise UserError(f"trace file {path} does not exist or is not a file; give --workload trace:PATH")
        return TraceReplay(
            path=path, block_tokens=config.trace.block_tokens, start=config.trace.start, count=config.trace.requests
        )
    if spec == PrefixRepetition.name:
        return PrefixRepetition(**config.prefix_repetition.model_dump())
    if spec not in WORKLOADS:
        raise UserError(f"unknown workload {spec!r}; pick from: {', '.join(workload_names())}")
    return WORKLOADS[spec]()
